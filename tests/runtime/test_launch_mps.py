"""python -m jax_cgx.launch --mps: a private MPS daemon around the job (a fake control program here)."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

FAKE = textwrap.dedent("""\
    #!/bin/sh
    # Records each call: its arguments, its standard input, the pipe directory it was given.
    log="$FAKE_MPS_LOG"
    if [ "$1" = "-d" ]; then
        echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
        [ -n "$FAKE_MPS_FAIL" ] && { echo "$FAKE_MPS_FAIL" >&2; echo "daemon refused" > "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 3; }
        exit 0
    fi
    read line
    echo "$line $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
""")

SCRIPT = textwrap.dedent("""\
    import os, sys
    with open(os.path.join(sys.argv[1], "rank" + os.environ["JAX_CGX_PROCESS_ID"]), "w") as f:
        f.write(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "-"))
    sys.exit(int(sys.argv[2]))
""")


def _launch(tmp_path: pathlib.Path, *options: str, status: int = 0, fail: str = "", fake: bool = True):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if fake:
        control = bin_dir / "nvidia-cuda-mps-control"
        control.write_text(FAKE)
        control.chmod(0o755)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", FAKE_MPS_LOG=str(tmp_path / "mps.log"),
               FAKE_MPS_FAIL=fail)
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    return subprocess.run([sys.executable, "-m", "jax_cgx.launch", "-n", "2", *options, str(script), str(tmp_path),
                           str(status)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("status", [0, 5])
def test_mps_daemon_runs_around_the_job(tmp_path, status):
    run = _launch(tmp_path, "--mps", status=status)
    assert run.returncode == status, run.stderr
    log = (tmp_path / "mps.log").read_text().splitlines()
    assert [line.split()[0] for line in log] == ["start", "quit"]  # started once, stopped once, after the job
    pipe = log[0].split()[1]
    assert log[1].split()[1] == pipe and "jax_cgx_mps_" in pipe  # a private daemon, stopped where started
    if status == 0:  # (a failing rank stops the other, maybe before it writes)
        assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [pipe, pipe]  # both ranks its clients
    assert "started a CUDA MPS control daemon" in run.stderr
    assert not pathlib.Path(pipe).exists()  # its folder removed


def test_without_mps_no_daemon(tmp_path):
    run = _launch(tmp_path)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "mps.log").exists()
    assert (tmp_path / "rank0").read_text() == "-"


def test_mps_daemon_that_fails_to_start_is_named(tmp_path):
    run = _launch(tmp_path, "--mps", fail="An instance of this daemon is already running")
    assert run.returncode == 2
    assert "exit status 3: An instance of this daemon is already running" in run.stderr
    assert "daemon refused" in run.stderr  # its control.log
    assert not (tmp_path / "rank0").exists()  # no process started


def test_mps_without_the_control_program(tmp_path):
    run = _launch(tmp_path, "--mps", fake=False)
    assert run.returncode == 2
    assert "nvidia-cuda-mps-control is not on PATH" in run.stderr
