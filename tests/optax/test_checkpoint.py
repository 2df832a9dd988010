"""Every stateful thing of jax_cgx checkpointed with orbax as it is, across processes: 2 processes of
4 CPU devices each save after 3 steps; 2 new processes restore and take the next 3, bitwise equal to
the uninterrupted run (tests/support/checkpoint_worker.py; the cases: checkpoint_cases.py)."""


import numpy as np
import pytest
from bitwise import assert_same_bits
from checkpoint_cases import CASES
from checkpoint_worker import MORE, SAVE_AT
from processes import run_all, worker_commands

pytest.importorskip("orbax.checkpoint")


def _launch(directory, mode: str) -> list[dict]:
    nproc = 2
    for returncode, log in run_all(worker_commands("checkpoint_worker.py", nproc, directory, mode), timeout=600):
        assert returncode == 0, log[-4000:]
    return [dict(np.load(directory / f"{mode}-process{i}.npz")) for i in range(nproc)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_orbax_restores_every_state_bitwise_in_new_processes(tmp_path):
    full = _launch(tmp_path, "full")
    resumed = _launch(tmp_path, "resume")
    for process, (want, got) in enumerate(zip(full, resumed)):
        assert set(got) == set(want)
        for case in (*CASES, "planner"):
            keys = [k for k in want if k.startswith(f"{case}/")]
            assert keys and {int(k.split("/")[1]) for k in keys} == set(range(SAVE_AT, SAVE_AT + MORE)), case
            for k in keys:
                assert_same_bits(got[k], want[k], f"process {process}: {k}")
    # the runs did change something after the break (the comparison is not of constants)
    for case in CASES:
        first, last = (full[0][f"{case}/{t}/w"] for t in (SAVE_AT, SAVE_AT + MORE - 1))
        assert not np.array_equal(first, last), case
    assert full[0][f"planner/{SAVE_AT}/changes"] > 0
