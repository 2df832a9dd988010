"""compressed_psum across 2 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo)."""


import jax
import numpy as np
import pytest
from allreduce_cases import oracle, sra_bound
from bitwise import assert_same_bits
from mp_worker import CASES, inputs  # noqa: E402
from processes import SUPPORT, run_all, worker_commands

pytestmark = pytest.mark.multiprocess
WORKER = SUPPORT / "mp_worker.py"


def test_two_processes_two_devices_each(tmp_path):
    nproc = 2
    for returncode, log in run_all(worker_commands(WORKER, nproc, tmp_path), timeout=300):
        assert returncode == 0, log[-4000:]

    results = {}
    for i in range(nproc):
        results.update(np.load(tmp_path / f"process{i}.npz"))
    world = 2 * nproc
    xs = inputs(world, 1003)
    for name, config in CASES.items():
        outs = [results[f"{name}/device{d}"] for d in range(world)]
        for d in range(1, world):
            assert_same_bits(outs[d], outs[0], f"{name}: device {d} vs device 0 (other process)")
        key = jax.random.key(3) if config.stochastic else None
        expected, scales, chunk = oracle(xs, config, key)
        assert_same_bits(outs[0], expected, f"{name}: vs the single-program oracle")
        err, bound = sra_bound(xs, outs[0], config)
        assert np.all(err <= bound), name
