"""jax_cgx under each MPI's launcher: Open MPI 4 (Debian's mpirun), Open MPI 5 and MPICH (their PyPI
wheels, tools/install_engines.sh). ``jax_cgx.distributed.initialize()`` finds rank, size and local
rank from each and the coordinator (jax's own detection under Open MPI 4; under Open MPI 5, where
jax's fails, 127.0.0.1 and a port from the job's PMIx namespace, or mpi4py; under MPICH mpi4py or
``JAX_COORDINATOR_ADDRESS``); the 4 processes train to the single-process run's bits."""

import shutil
import subprocess
import sys

import pytest
from engines import TRAIN, check_job, job_env, log_of, mpi_prefix, reference

from jax_cgx.launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ROOT_OPTIONS = ["--allow-run-as-root"]  # Open MPI refuses root without it (CI runs as root)


def _run(command, env, tmp_path):
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, log_of(run)
    return run


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI 4 is not installed (Debian: openmpi-bin)")
def test_open_mpi_4(tmp_path, tmp_path_factory):
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI) 4." not in version:
        pytest.skip(f"the mpirun on PATH is not Open MPI 4: {version.splitlines()[:1]}")
    _run(["mpirun", *ROOT_OPTIONS, "--oversubscribe", "-np", "4", sys.executable, TRAIN, str(tmp_path / "out")],
         job_env(), tmp_path)
    check_job(tmp_path / "out", 4, "openmpi", reference(4, 3, tmp_path_factory.getbasetemp()))


def test_open_mpi_5(tmp_path, tmp_path_factory):
    prefix, why = mpi_prefix("openmpi5")
    if prefix is None:
        pytest.skip(why)
    env = job_env(PATH=f"{prefix / 'bin'}:{job_env()['PATH']}")
    _run([str(prefix / "bin" / "mpirun"), *ROOT_OPTIONS, "--oversubscribe", "-np", "4", sys.executable, TRAIN,
                str(tmp_path / "out")], env, tmp_path)
    assert "mpirun (Open MPI) 5." in subprocess.run([str(prefix / "bin" / "mpirun"), "--version"], capture_output=True,
                                                    text=True, env=env).stdout
    check_job(tmp_path / "out", 4, "openmpi", reference(4, 3, tmp_path_factory.getbasetemp()))


@pytest.mark.parametrize("coordinator", ["mpi4py", "variable"])
def test_mpich(tmp_path, tmp_path_factory, coordinator):
    prefix, why = mpi_prefix("mpich")
    if prefix is None:
        pytest.skip(why)
    # mpi4py's wheel loads the libmpi it finds: MPICH's, not Debian's Open MPI.
    env = job_env(LD_LIBRARY_PATH=str(prefix / "lib"))
    command = [str(prefix / "bin" / "mpiexec"), "-n", "4"]
    if coordinator == "variable":
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{free_port()}"
        command += ["-genv", "JAX_COORDINATOR_ADDRESS", env["JAX_COORDINATOR_ADDRESS"]]
    _run([*command, sys.executable, TRAIN, str(tmp_path / "out")], env, tmp_path)
    check_job(tmp_path / "out", 4, "mpich", reference(4, 3, tmp_path_factory.getbasetemp()))
