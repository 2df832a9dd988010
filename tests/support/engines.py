"""What the engine tests (tests/engines/) share: where tools/install_engines.sh put the MPIs, the
single-process reference of engine_train.py, and the check that a job's processes found their places
and trained to the reference's bits."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
from bitwise import assert_same_bits
from processes import SUPPORT

ROOT = SUPPORT.parent.parent
ENGINES = pathlib.Path(os.environ.get("JAX_CGX_TEST_ENGINES") or ROOT / ".engines")
TRAIN = str(SUPPORT / "engine_train.py")
INSTALL = "tools/install_engines.sh"


def mpi_prefix(name: str) -> tuple[pathlib.Path | None, str]:
    """``(prefix, "")`` of the MPI ``name`` (``openmpi5``, ``mpich``) install_engines.sh installed, or
    ``(None, why not)``."""
    prefix = ENGINES / name
    launcher = prefix / "bin" / ("mpirun" if name.startswith("openmpi") else "mpiexec")
    if launcher.exists():
        return prefix, ""
    return None, f"{launcher} is missing: run {INSTALL} (.ci/run does), or set JAX_CGX_TEST_ENGINES"


def job_env(**extra: str) -> dict[str, str]:
    """This environment without another launcher's variables (a test under one must not look like a rank)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "JAX_CGX_", "OMPI_", "PMI_", "PMIX_", "XLA_FLAGS"))}
    return dict(env, **extra)


_references: dict[tuple[int, int], pathlib.Path] = {}


def reference(world: int, steps: int, tmp_root: pathlib.Path) -> pathlib.Path:
    """engine_train.py's run on ``world`` simulated devices in one process (made once per session)."""
    key = (world, steps)
    if key not in _references:
        out = tmp_root / f"reference-{world}-{steps}"
        run = subprocess.run([sys.executable, TRAIN, str(out), "--steps", str(steps), "--reference", str(world)],
                             capture_output=True, text=True, timeout=300, env=job_env())
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        _references[key] = out
    return _references[key] / "reference.npz"


def check_job(out: pathlib.Path, world: int, source: str, reference_npz: pathlib.Path | None,
              local_count: int | None = None) -> list[dict]:
    """Every process of the job wrote its place and its parameters: ranks 0..world-1 from ``source``,
    local ranks a permutation of 0..local_count-1 (default: all on one node), and, with
    ``reference_npz``, the parameters bitwise the reference's (the loss, a ``pmean`` of one value per
    process summed in gloo's order, to float rounding). Returns the places."""
    places = [json.loads((out / f"process{i}.json").read_text()) for i in range(world)]
    assert [p["process_index"] for p in places] == list(range(world)), places
    assert {p["source"] for p in places} == {source}, places
    assert {p["process_count"] for p in places} == {world}, places
    local_count = world if local_count is None else local_count
    assert {p["local_count"] for p in places} == {local_count}, places
    assert sorted(p["local_rank"] for p in places) == sorted(list(range(local_count)) * (world // local_count)), places
    if reference_npz is not None:
        want = np.load(reference_npz)
        for i in range(world):
            got = np.load(out / f"process{i}.npz")
            for name in ("w1", "w2"):
                assert_same_bits(got[name], want[name], f"process {i}'s {name} vs the single-process run")
            np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    return places


def log_of(run: subprocess.CompletedProcess) -> str:
    return f"status {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
