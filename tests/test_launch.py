"""Launching: jax_cgx.launch, mpirun, explicit arguments; failures and signals leave no process behind."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from allreduce_cases import oracle
from conftest import assert_same_bits
from processes import run_all

from jax_cgx import CompressionConfig
from jax_cgx.distributed import detect
from jax_cgx.launch import free_port

pytestmark = pytest.mark.multiprocess
CHECK = str(pathlib.Path(__file__).parent / "launch_check.py")
LAUNCH = [sys.executable, "-m", "jax_cgx.launch"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone, just not reaped
    except FileNotFoundError:
        return False


def _pids(out: pathlib.Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid*"))]


def _assert_no_leak(out: pathlib.Path, expected: int, timeout: float = 10) -> None:
    pids = _pids(out)
    assert len(pids) == expected, f"expected {expected} pid files, got {pids}"
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left behind"


def _check_results(out: pathlib.Path, nproc: int, devices_per_process: int) -> None:
    world = nproc * devices_per_process
    rows = np.concatenate([np.load(out / f"result{r}.npy") for r in range(nproc)])
    assert rows.shape[0] == world
    for d in range(1, world):
        assert_same_bits(rows[d], rows[0], f"device {d} vs device 0")
    xs = np.random.default_rng(0).standard_normal((world, 777)).astype(np.float32)
    assert_same_bits(rows[0], oracle(xs, CompressionConfig(bits=4, bucket_size=64))[0], "vs oracle")


def test_launcher_runs_a_compressed_psum(tmp_path):
    run = subprocess.run([*LAUNCH, "-n", "2", "--devices-per-process", "2", CHECK, str(tmp_path)],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[0] rank 0 of 2 (jax_cgx.launch): 4 devices, ok" in run.stdout
    assert "[1] rank 1 of 2 (jax_cgx.launch): 4 devices, ok" in run.stdout
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
    assert time.monotonic() - t0 < 60
    _assert_no_leak(tmp_path, 3)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
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
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4(x4)"},
         (7, 16, 3, 1, "slurm")),
    ],
)
def test_detect_reads_each_launcher(env, expected):
    info = detect(env)
    assert (info.process_index, info.process_count, info.local_rank, info.local_count, info.source) == expected


def test_detect_rejects_malformed_values():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK='x'"):
        detect({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
