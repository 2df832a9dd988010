"""Launching: jax_cgx.launch, mpirun, explicit arguments; failures and signals leave no process behind."""

import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from allreduce_cases import oracle
from bitwise import assert_same_bits
from processes import SUPPORT, run_all

from jax_cgx import CompressionConfig, distributed, launch
from jax_cgx._src import exits, outputs
from jax_cgx._src.launch import processes as launch_processes
from jax_cgx.distributed import detect
from jax_cgx.launch import free_port

pytestmark = pytest.mark.multiprocess
CHECK = str(SUPPORT / "launch_check.py")
LAUNCH = [sys.executable, "-m", "jax_cgx.launch"]


def _stat(pid) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie is gone, just not reaped


def _in_groups(pgids: set[int]) -> list[int]:
    """Live processes in any of these process groups (each rank leads its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and fields[0] != "Z" and int(fields[2]) in pgids:
                found.append(int(entry))
    return found


def _pids(out: pathlib.Path, kind: str = "pid") -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob(f"{kind}[0-9]*"))]


def _assert_no_leak(out: pathlib.Path, expected: int, timeout: float = 10) -> None:
    """Every rank (pid files), every grandchild (child files) and every process in a rank's
    process group is gone."""
    pids = _pids(out)
    assert len(pids) == expected, f"expected {expected} pid files, got {pids}"
    watched = pids + _pids(out, "child")
    deadline = time.monotonic() + timeout
    while (any(_alive(p) for p in watched) or _in_groups(set(pids))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in watched if _alive(p)], "processes left behind"
    assert not _in_groups(set(pids)), "processes left behind in the ranks' process groups"


def _launch(tmp_path, *options, check=(), timeout=120):
    """Run the launcher (``options``) on launch_check.py (``check``: its options).

    Returns (the completed run, its seconds, time.time() at its end).
    """
    t0 = time.monotonic()
    run = subprocess.run([*LAUNCH, *options, CHECK, str(tmp_path), *check], capture_output=True, text=True,
                         timeout=timeout, cwd=tmp_path)
    return run, time.monotonic() - t0, time.time()


def _log(run) -> str:
    return run.stdout[-3000:] + run.stderr[-3000:]


def _check_results(out: pathlib.Path, nproc: int, devices_per_process: int) -> None:
    world = nproc * devices_per_process
    rows = np.concatenate([np.load(out / f"result{r}.npy") for r in range(nproc)])
    assert rows.shape[0] == world
    for d in range(1, world):
        assert_same_bits(rows[d], rows[0], f"device {d} vs device 0")
    xs = np.random.default_rng(0).standard_normal((world, 777)).astype(np.float32)
    assert_same_bits(rows[0], oracle(xs, CompressionConfig(bits=4, bucket_size=64, min_size=16))[0], "vs oracle")


def test_launcher_runs_a_compressed_psum(tmp_path):
    run = subprocess.run([*LAUNCH, "-n", "2", "--devices-per-process", "2", CHECK, str(tmp_path)],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[0] rank 0 of 2 (jax_cgx.launch): 4 devices, ok" in run.stdout
    assert "[1] rank 1 of 2 (jax_cgx.launch): 4 devices, ok" in run.stdout
    assert "[Gloo]" not in run.stdout, run.stdout  # gloo's 8 "Rank N is connected" lines per process: all healthy
    _check_results(tmp_path, 2, 2)
    _assert_no_leak(tmp_path, 2)


def test_a_failing_rank_stops_the_job(tmp_path):
    t0 = time.monotonic()
    run = subprocess.run(
        [*LAUNCH, "-n", "3", "--devices-per-process", "1", "--grace", "2", CHECK, str(tmp_path),
         "--fail-rank", "1", "--hang-rank", "0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "process 1 exited with 1" in run.stderr
    assert "RuntimeError: rank 1 failing on purpose" in run.stdout
    assert (tmp_path / "hook1").exists(), "the failed rank skipped the program's own exit hook"
    assert time.monotonic() - t0 < 60
    _assert_no_leak(tmp_path, 3)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_to_the_launcher_leaves_no_children(tmp_path, sig):
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--devices-per-process", "1", "--grace", "2", CHECK, str(tmp_path), "--hang-rank", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert len(_pids(tmp_path)) == 2, f"the processes did not start: {proc.communicate()[1][-2000:] if proc.poll() is not None else ''}"
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    _assert_no_leak(tmp_path, 2)


@pytest.mark.parametrize("how, status, says", [
    ("sys.exit", 3, "[1] jax_cgx: process 1 exits with status 3"),
    ("exit", 4, "[1] jax_cgx: process 1 exits with status 4"),
    ("held", 5, "[1] jax_cgx: process 1 exits with status 5"),  # absl's app.run: the SystemExit of a plain sys.exit, in a cycle
    ("hook", 1, "[1] jax_cgx: process 1 failed (RuntimeError); exiting with status 1"),  # another excepthook
    ("interrupt", 130, "[1] KeyboardInterrupt"),  # Python's own traceback, and its status for Ctrl-C
])
def test_a_rank_exit_status_reaches_the_launcher_at_once(tmp_path, how, status, says):
    # Rank 1 exits while rank 0 sleeps: without jax_cgx's exit hook, rank 1 would wait in jax's
    # shutdown barrier for rank 0 (up to 5 minutes) and its status would be lost.
    run, _, ended = _launch(tmp_path, "-n", "2", "--devices-per-process", "1", "--grace", "1",
                            check=["--exit", f"1:{status}:{how}:start", "--hang-rank", "0"])
    assert run.returncode == status, _log(run)
    assert f"process 1 exited with {status}" in run.stderr, _log(run)
    assert "process 0 exited" not in run.stderr, _log(run)
    assert says in run.stdout, _log(run)
    exited = float((tmp_path / "exit1").read_text())
    assert ended - exited < 10, f"the launcher took {ended - exited:.1f} s after the exit (jax's barrier waits 30 s+)"
    assert not (tmp_path / "end1").exists(), "rank 1 ran the exit hooks behind jax's barrier"
    assert (tmp_path / "hook1").exists(), "rank 1 skipped the program's own exit hook"
    _assert_no_leak(tmp_path, 2)


def test_a_caught_and_kept_exit_is_not_the_status(tmp_path):
    # Rank 1 catches a sys.exit(3) and keeps the SystemExit, then ends with `raise SystemExit(0)`:
    # Python would exit 0. The kept exception is not the one that ended the script.
    run, _, _ = _launch(tmp_path, "-n", "2", "--devices-per-process", "1",
                        check=["--catch-exit-rank", "1", "--exit", "1:0:raise:end"])
    assert run.returncode == 0, _log(run)
    assert "exits with status" not in run.stdout + run.stderr, _log(run)
    assert "an exception whose status jax_cgx cannot see" in run.stdout + run.stderr, _log(run)


def test_a_zero_exit_runs_jax_shutdown(tmp_path):
    # Rank 0 sys.exit(0)s right after the psum; rank 1 first catches a sys.exit(3), lingers
    # 2 s, then finishes. Rank 0 must wait for rank 1 in jax's shutdown barrier (its last exit
    # hook runs after rank 1 is done), and the caught status must not leak into the result.
    run, _, _ = _launch(tmp_path, "-n", "2", "--devices-per-process", "2",
                        check=["--exit", "0:0:sys.exit:end", "--catch-exit-rank", "1", "--linger-rank", "1"])
    assert run.returncode == 0, _log(run)
    assert "exits with status" not in run.stdout + run.stderr, _log(run)
    _check_results(tmp_path, 2, 2)
    assert (tmp_path / "end0").exists() and (tmp_path / "end1").exists(), "a rank skipped jax's shutdown"
    assert float((tmp_path / "end0").read_text()) >= float((tmp_path / "done1").read_text()), \
        "rank 0 did not wait for rank 1 in jax's shutdown barrier"
    _assert_no_leak(tmp_path, 2)


def test_a_raised_system_exit_is_named_and_its_status_kept(tmp_path):
    # `raise SystemExit(5)` is not seen by the hook: the process says so, waits for its peer in
    # jax's barrier as before (here rank 0, which exits 0), and the status still arrives.
    run, _, _ = _launch(tmp_path, "-n", "2", "--devices-per-process", "1",
                        check=["--exit", "1:5:raise:start", "--exit", "0:0:sys.exit:start"])
    assert run.returncode == 5, _log(run)
    assert "process 1 exited with 5" in run.stderr, _log(run)
    assert "[1] jax_cgx: process 1 is exiting through an exception whose status jax_cgx cannot see" in run.stdout
    assert (tmp_path / "end0").exists(), _log(run)
    _assert_no_leak(tmp_path, 2)


def test_timeout_stops_a_hung_job(tmp_path):
    # Both ranks hang, each with a grandchild; rank 0 ignores SIGTERM and must be killed.
    run, seconds, _ = _launch(tmp_path, "-n", "2", "--devices-per-process", "1", "--timeout", "8", "--grace", "1",
                              check=["--hang-rank", "0", "--ignore-term-rank", "0", "--spawn-child"])
    assert run.returncode == 124, _log(run)
    assert "--timeout 8 s passed with processes 0, 1 still running" in run.stderr, _log(run)
    assert "process 0 still running 1 s after SIGTERM (--grace); killed" in run.stderr, _log(run)
    assert 8 <= seconds < 8 + 1 + 8, seconds
    assert len(_pids(tmp_path, "child")) == 2, "the grandchildren did not start before the timeout"
    _assert_no_leak(tmp_path, 2)


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(text)
    return str(path)


def test_output_that_is_not_utf8_or_not_read_never_stalls_a_rank(tmp_path):
    # A byte that is not UTF-8 used to kill the copying thread; a closed stdout (| head) too.
    # Either way the rank blocked on a full pipe (64 KiB) and the job hung.
    script = _script(tmp_path, "import os, sys\n"
                     "os.write(1, b'bad byte \\xff here\\n')\n"
                     "for i in range(5000): print('line', i, 'x' * 40)\n"
                     "print('DONE', os.environ['JAX_CGX_PROCESS_ID'], flush=True)\n")
    run = subprocess.run([*LAUNCH, "-n", "2", "--timeout", "60", script], capture_output=True, timeout=120)
    out = run.stdout.decode()
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert "[0] bad byte \ufffd here" in out and "[0] DONE 0" in out and "[1] DONE 1" in out
    head = subprocess.Popen([*LAUNCH, "-n", "2", "--timeout", "60", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    head.stdout.readline()
    head.stdout.close()  # as `| head -1` does
    assert head.wait(timeout=120) == 0, head.stderr.read().decode()[-2000:]
    head.stderr.close()


def test_the_process_that_failed_first_is_named_first(tmp_path):
    # Rank 1 dies of SIGSEGV; rank 0 notices and exits with 3 right after (as a rank whose peer
    # vanished from a collective does): the job's status and the first name are rank 1's.
    script = _script(tmp_path, "import os, signal, sys, time, pathlib\n"
                     "rank, out = int(os.environ['JAX_CGX_PROCESS_ID']), pathlib.Path(sys.argv[1])\n"
                     # Written then renamed, so the peer never reads a created but still empty file.
                     "(out / f'pid{rank}.tmp').write_text(str(os.getpid()))\n"
                     "os.replace(out / f'pid{rank}.tmp', out / f'pid{rank}')\n"
                     "if rank == 1:\n"
                     "    time.sleep(0.5)\n"
                     "    os.kill(os.getpid(), signal.SIGSEGV)\n"
                     "while not (out / 'pid1').exists(): time.sleep(0.01)\n"
                     "pid1 = int((out / 'pid1').read_text())\n"
                     "while os.path.exists(f'/proc/{pid1}') and open(f'/proc/{pid1}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z': time.sleep(0.005)\n"
                     "sys.exit(3)\n")
    run = subprocess.run([*LAUNCH, "-n", "2", "--timeout", "60", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 128 + signal.SIGSEGV, _log(run)
    assert "jax_cgx.launch: process 1 was killed by SIGSEGV (status 139)" in run.stderr, _log(run)


@pytest.mark.multiprocess
def test_the_process_that_said_it_failed_first_is_named_first_though_it_ends_last(tmp_path):
    # Rank 1 raises; jax_cgx's hook says so at once, then the program's exit hooks take 2 s (the tcp
    # backend's teardown, which resets its peers' connections, runs there). Rank 0 fails after it
    # (as a peer of a reset connection does) and ends first. Before, the launcher named rank 0.
    script = _script(tmp_path, "import atexit, os, sys, time, pathlib\n"
                     "import jax_cgx.distributed\n"
                     "out = pathlib.Path(sys.argv[1])\n"
                     "info = jax_cgx.distributed.initialize()\n"
                     "rank = info.process_index\n"
                     "if rank == 1:\n"
                     "    atexit.register(lambda: time.sleep(2))  # a slow exit hook\n"
                     "    raise RuntimeError('the training step failed on process 1')\n"
                     "time.sleep(1)\n"
                     "raise RuntimeError('receiving from rank 1: Connection reset by peer')\n")
    run = subprocess.run([*LAUNCH, "-n", "2", "--devices-per-process", "1", "--timeout", "60", script,
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    # Rank 1 may not finish its exit hooks: jax's coordination service lives in rank 0, and aborts it
    # (SIGABRT) when rank 0 is gone. Its status, whichever, is the job's.
    assert run.returncode in (1, 128 + signal.SIGABRT), _log(run)
    report = [line for line in run.stderr.splitlines() if line.startswith("jax_cgx.launch: process")]
    assert report and report[-1].startswith("jax_cgx.launch: process 1 "), _log(run)
    assert "then process 0 exited with 1" in report[-1], _log(run)


@pytest.mark.multiprocess
def test_a_stopped_rank_is_named_not_the_survivor_jax_aborts(tmp_path):
    # Rank 1 stops itself (SIGSTOP: a hung node); jax's heartbeat (5 s here, 100 s by default)
    # aborts rank 0. Before, the launcher reported only "process 0 was killed by SIGABRT".
    script = _script(tmp_path, "import os, signal, time\n"
                     "import jax_cgx\n"
                     "jax_cgx.distributed.initialize(heartbeat_timeout_seconds=5)\n"
                     "if int(os.environ['JAX_CGX_PROCESS_ID']) == 1: os.kill(os.getpid(), signal.SIGSTOP)\n"
                     "time.sleep(120)\n")
    run = subprocess.run([*LAUNCH, "-n", "2", "--timeout", "90", "--grace", "1", script], capture_output=True,
                         text=True, timeout=150)
    assert run.returncode == 128 + signal.SIGABRT, _log(run)
    assert ("jax_cgx.launch: process 1 stopped responding: jax's coordination service reported that it stopped "
            "sending heartbeats and it is stopped (process state T") in run.stderr, _log(run)
    assert "Because of it process 0 was killed by SIGABRT" in run.stderr, _log(run)


def test_the_heartbeat_watch_reads_jax_s_report():
    watch = outputs.HeartbeatWatch()
    lines = watch.watcher()
    for line in ("E1127 coordination_service.cc:1549] ... UNAVAILABLE: The following tasks are unhealthy (stopped "
                 "sending heartbeats):\n", "1\n", "The tasks have crashed. Check the task logs\n", "2\n"):
        lines(line)
    assert watch.unhealthy == {1}  # ids only right after the marker
    lines("... (stopped sending heartbeats): 3, 4\n")
    assert watch.unhealthy == {1, 3, 4}
    assert launch.process_state(os.getpid()) in ("R", "S")
    assert launch.process_state(2**22 + 12345) is None


def test_the_script_gets_its_arguments_as_given(tmp_path):
    script = _script(tmp_path, "import sys; print(sys.argv[1:])\n")
    for given in (["--", "a", "--b"], ["a", "--", "-n", "3"], []):
        run = subprocess.run([*LAUNCH, "-n", "1", script, *given], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and f"[0] {given}" in run.stdout, (given, _log(run))


def test_the_launcher_refuses_to_run_as_one_of_an_mpirun_job(tmp_path, capsys, monkeypatch):
    # Under mpirun -np 2, each copy of the launcher would start its own job of -n processes.
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:
        launch.main(["-n", "2", CHECK, str(tmp_path)])
    assert exited.value.code == 2
    assert "one of several processes started by mpirun (Open MPI) (OMPI_COMM_WORLD_SIZE=2)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a process was started"


@pytest.mark.parametrize(
    "options, message",
    [
        (["-n", "0"], "argument -n/--nproc: must be at least 1, got 0"),
        (["-n", "two"], "argument -n/--nproc: 'two' is not a whole number"),
        (["-n", "2", "--devices-per-process", "0"], "argument --devices-per-process: must be at least 1, got 0"),
        (["-n", "2", "--devices-per-process", "-1"], "argument --devices-per-process: must be at least 1, got -1"),
        (["-n", "2", "--timeout", "0"], "argument --timeout: must be a finite number > 0"),
        (["-n", "2", "--timeout", "-5"], "argument --timeout: must be a finite number > 0"),
        (["-n", "2", "--timeout", "nan"], "argument --timeout: must be a finite number > 0"),
        (["-n", "2", "--grace", "-1"], "argument --grace: must be a finite number >= 0"),
        (["-n", "2", "--grace", "inf"], "argument --grace: must be a finite number >= 0"),
    ],
)
def test_bad_arguments_are_rejected_before_starting_anything(tmp_path, capsys, options, message):
    with pytest.raises(SystemExit) as exited:
        launch.main([*options, CHECK, str(tmp_path)])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a process was started"


def test_devices_per_process_zero_is_an_argument_error(tmp_path):
    # It used to segfault rank 0 (status 139, no message).
    run, seconds, _ = _launch(tmp_path, "-n", "2", "--devices-per-process", "0", timeout=60)
    assert run.returncode == 2, _log(run)
    assert "error: argument --devices-per-process: must be at least 1, got 0" in run.stderr
    assert not list(tmp_path.iterdir()), "a process was started"


def test_gloo_reports_a_connection_short_of_peers():
    import io

    copied = io.StringIO()
    healthy = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
    short = "[Gloo] Rank 2 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3\n"
    # Two of gloo's threads printing into one another (seen under load):
    mixed = ("[Gloo] Rank 3[Gloo] Rank  is connected to 23 is connected to  peer ranks. 3Expected number of "
             "connected peer ranks is :  peer ranks. 3Expected number of connected peer ranks is : 3\n"
             "1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n")
    outputs.copy(io.BytesIO((healthy + short + mixed + "ok\n").encode()), "[0] ", copied)
    assert copied.getvalue() == "[0] " + short + "[0] ok\n"


def test_the_recorded_system_exit_behaves_as_python_does():
    # In-process checks of what the multi-process tests cannot see: the status Python would give
    # each code, and a caught SystemExit is not taken for the process's exit.
    assert [exits._status(c) for c in (None, 0, 3, -1, 256, True, "bye")] == [0, 0, 3, 255, 0, 1, 1]
    before = exits._exit_status
    with pytest.raises(SystemExit) as caught:
        exits._sys_exit(7)
    assert caught.value.code == 7 and repr(caught.value) == "SystemExit(7)"
    del caught
    assert exits._exit_status == before
    assert type(pickle.loads(pickle.dumps(exits._SystemExit(2)))) is SystemExit
    with pytest.raises(TypeError):
        exits._sys_exit(1, 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_killing_the_launcher_outright_leaves_no_children(tmp_path):
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--devices-per-process", "1", CHECK, str(tmp_path), "--hang-rank", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert len(_pids(tmp_path)) == 2, "the processes did not start"
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    _assert_no_leak(tmp_path, 2)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (Debian: openmpi-bin)")
def test_mpirun(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for key in [k for k in env if k.startswith("JAX_CGX_")]:
        del env[key]
    run = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "XLA_FLAGS",
         sys.executable, CHECK, str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "(openmpi)" in run.stdout
    _check_results(tmp_path, 2, 2)
    _assert_no_leak(tmp_path, 2)


def test_explicit_coordinator_arguments(tmp_path):
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    commands = [
        [sys.executable, CHECK, str(tmp_path), "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i)]
        for i in range(2)
    ]
    results = run_all(commands, timeout=180, env=env, cwd=tmp_path)
    logs = [log for _, log in results]
    assert all(rc == 0 for rc, _ in results), "\n".join(log[-2000:] for log in logs)
    assert "(arguments)" in logs[0]
    _check_results(tmp_path, 2, 2)
    _assert_no_leak(tmp_path, 2)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (0, 1, 0, 1, "single")),
        ({"JAX_CGX_PROCESS_ID": "1", "JAX_CGX_NUM_PROCESSES": "4", "JAX_CGX_LOCAL_RANK": "1",
          "JAX_CGX_LOCAL_COUNT": "4"}, (1, 4, 1, 4, "jax_cgx.launch")),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4, "openmpi")),
        ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}, (2, 3, 2, 3, "mpich")),
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "3",
          "SLURM_NTASKS_PER_NODE": "4(x4)"}, (7, 16, 3, 4, "slurm")),
        # srun --ntasks=7 over 4 nodes: the 4th node's one task; SLURM_NTASKS_PER_NODE unset.
        ({"SLURM_PROCID": "6", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
          "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}, (6, 7, 0, 1, "slurm")),
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
          "SLURM_STEP_TASKS_PER_NODE": "4"}, (3, 4, 3, 4, "slurm")),
        # A batch script's own shell (no srun step): one process, not rank 0 of 4 waiting for 3 more.
        ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, (0, 1, 0, 1, "single")),
    ],
)
def test_detect_reads_each_launcher(env, expected):
    info = detect(env)
    assert (info.process_index, info.process_count, info.local_rank, info.local_count, info.source) == expected


def test_detect_rejects_malformed_values():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK='x'"):
        detect({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="JAX_CGX_PROCESS_ID is set but JAX_CGX_NUM_PROCESSES is not: a partial "
                                         "jax_cgx.launch environment"):
        detect({"JAX_CGX_PROCESS_ID": "1", "JAX_CGX_COORDINATOR": "127.0.0.1:1234"})
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not"):
        detect({"OMPI_COMM_WORLD_SIZE": "2"})
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x' is not SLURM's tasks-per-node list"):
        detect({**slurm, "SLURM_STEP_TASKS_PER_NODE": "2(x"})
    with pytest.raises(ValueError, match=r"SLURM_NODEID=2 is outside SLURM_STEP_TASKS_PER_NODE='1\(x2\)' \(2 nodes\)"):
        detect({**slurm, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "2"})


def test_a_slurm_node_name_that_does_not_resolve_is_an_error_not_a_wait(monkeypatch):
    # jax puts the coordinator on the first node of the step; an unresolvable name made every process
    # wait jax's 300 s initialization timeout.
    for key, value in {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
                       "SLURM_STEP_NODELIST": "no-such-node.invalid", "SLURM_STEP_TASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(key, value)
    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: started.append(a))
    with pytest.raises(RuntimeError, match=r"the SLURM node 'no-such-node.invalid', where jax puts the coordinator "
                                           r".* does not resolve"):
        distributed.initialize(cpu_collectives="", exit_on_uncaught_exception=False)
    assert not started


def test_open_mpi_5_on_one_node_derives_the_coordinator_from_its_namespace(monkeypatch):
    # Open MPI 5 has no OMPI_MCA_orte_hnp_uri, from which jax found the coordinator (jax issue 14576).
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-vm-12146@1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OMPI_MCA_orte_hnp_uri", raising=False)
    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **k: started.append(k))
    distributed.initialize(cpu_collectives="", exit_on_uncaught_exception=False)
    address = started[0]["coordinator_address"]
    assert address.startswith("127.0.0.1:") and 20000 <= int(address.split(":")[1]) < 50000
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    started.clear()
    distributed.initialize(cpu_collectives="", exit_on_uncaught_exception=False)
    assert started[0]["coordinator_address"] == address  # every rank derives the same
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")  # ranks on several nodes, and no mpi4py
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match="under Open MPI 5 on several nodes the coordinator address is not in"):
        distributed.initialize(cpu_collectives="", exit_on_uncaught_exception=False)


@pytest.mark.parametrize(
    "env, kwargs, expected",
    [
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, {}, [1]),
        # One process on the node, or one_gpu_per_process=False: every local GPU. [], not None:
        # with None, jax's own cluster detection would pick the GPU of the local rank.
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, {}, []),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, {"one_gpu_per_process": False}, []),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "JAX_LOCAL_DEVICE_IDS": "0,1"},
         {}, None),  # jax reads it itself
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, {"local_device_ids": [0]}, [0]),
    ],
)
def test_the_devices_each_process_drives(monkeypatch, env, kwargs, expected):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    distributed.initialize(cpu_collectives="", exit_on_uncaught_exception=False, shutdown_timeout_seconds=7,
                           **kwargs)
    assert seen["local_device_ids"] == expected
    assert seen["shutdown_timeout_seconds"] == 7  # other options reach jax as they are


def test_stdin_goes_to_rank_0_only(tmp_path):
    # Piped input went to whichever rank read first (rank 1 got it, rank 0 read '').
    script = _script(tmp_path, "import sys; print(repr(sys.stdin.read()))\n")
    run = subprocess.run([*LAUNCH, "-n", "3", script], input="for rank 0\n", capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, _log(run)
    assert "[0] 'for rank 0\\n'" in run.stdout, _log(run)
    assert "[1] ''" in run.stdout and "[2] ''" in run.stdout, _log(run)


@pytest.mark.parametrize("n", [launch.MAX_PROCESSES + 1, 100000])
def test_too_many_processes_is_an_error_that_starts_nothing(tmp_path, capsys, monkeypatch, n):
    # -n 100000 started spawning with no bound.
    started = []
    monkeypatch.setattr(launch_processes.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as exited:
        launch.main(["-n", str(n), CHECK, str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument -n/--nproc: {n} processes is more than this launcher starts on one machine (at most " \
           f"{launch.MAX_PROCESSES}: the larger of 256 and 4 per CPU core" in err
    assert "--devices-per-process K" in err and "mpirun or srun" in err
    assert not started and not list(tmp_path.iterdir()), "a process was started"
    assert launch.MAX_PROCESSES >= 256


@pytest.mark.filterwarnings("ignore:os.fork")  # the processes are started from this (multithreaded) process
def test_a_process_that_cannot_start_leaves_none_behind(monkeypatch):
    real = subprocess.Popen
    stdins, started = [], []

    def popen(*args, **kwargs):
        stdins.append(kwargs.get("stdin"))
        if len(stdins) == 3:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch_processes.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        launch.ProcessGroup([["sleep", "600"]] * 3, [dict(os.environ)] * 3)
    assert len(started) == 2 and all(p.poll() is not None for p in started), "a process was left running"
    assert stdins[0] is None and stdins[1] == subprocess.DEVNULL  # stdin: rank 0's is the launcher's


def test_a_group_needs_one_environment_per_command(monkeypatch):
    """Commands and environments of different lengths were zipped: the extra processes were
    silently never started."""
    monkeypatch.setattr(launch_processes.subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    for commands, envs in (([["true"]] * 3, [dict(os.environ)] * 2), ([], [])):
        with pytest.raises(ValueError, match=f"ProcessGroup: {len(commands)} commands and {len(envs)} environments"):
            launch.ProcessGroup(commands, envs)


def test_the_coordinator_listens_on_loopback_only(tmp_path):
    # The docstring said 127.0.0.1, but jax's coordinator bound every interface ([::]:port).
    assert launch_processes._environment(0, 2, 4321, None)["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:4321"
    script = _script(tmp_path, """
import ipaddress
import os
import jax_cgx
jax_cgx.distributed.initialize()
port = int(os.environ["JAX_CGX_COORDINATOR"].rsplit(":", 1)[1])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                # The address is in 32-bit words of host (little-endian) byte order.
                packed = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                ip = ipaddress.ip_address(packed)
                listening.append(str(getattr(ip, "ipv4_mapped", None) or ip))
if jax_cgx.distributed.detect().process_index == 0:
    print("listening:", sorted(listening))
""")
    run = subprocess.run([*LAUNCH, "-n", "2", "--devices-per-process", "1", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, _log(run)
    # jax's default, every interface, would read ['::'] (or ['0.0.0.0']).
    assert "[0] listening: ['127.0.0.1']" in run.stdout, _log(run)
