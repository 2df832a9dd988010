"""The nccl backend on a real GPU (marked `gpu`; tools/gpu_check.sh runs it).

Several ranks share ONE GPU: each is its own process with a distinct NCCL_HOSTID, so
NCCL treats them as separate hosts and connects them over sockets on `lo`
(ARCHITECTURE.md §5). Every case runs with the nccl and the xla backend; the results
must be bitwise equal to each other, identical on every rank, and equal to the
single-program oracle of the algorithm.
"""

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import oracle, seed_rows
from conftest import assert_same_bits
from processes import run_all

import jax_cgx
from jax_cgx import _ring, _sra
from jax_cgx.launch import free_port

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nccl_gpu_worker import CASES, DTYPES, inputs  # noqa: E402

pytestmark = pytest.mark.gpu
WORKER = pathlib.Path(__file__).parent / "nccl_gpu_worker.py"


def _worker_env(pid: int, nproc: int) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the workers use the GPU, not 8 virtual CPU devices
    env.update(
        CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        NCCL_HOSTID=f"jax-cgx-test-host-{pid}",
        NCCL_SOCKET_IFNAME="lo",
        NCCL_IB_DISABLE="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.8 / nproc:.3f}",
    )
    return env


def _ring_oracle(xs, config, key):
    w, n = xs.shape
    chunk = _sra.chunk_length(n, w, config.bucket_size, config.skip_incomplete_buckets)
    out, _ = _ring.simulate_ring(
        jnp.asarray(xs), seed_rows(key, config, w), chunk=chunk, bits=config.bits,
        bucket_size=config.bucket_size, stochastic=config.stochastic,
    )
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_on_one_gpu_nccl_equals_xla_equals_oracle(tmp_path, nproc):
    port = free_port()
    commands = [[sys.executable, str(WORKER), str(i), str(nproc), str(port), str(tmp_path)] for i in range(nproc)]
    envs = [_worker_env(i, nproc) for i in range(nproc)]
    for i, (returncode, log) in enumerate(run_all(commands, timeout=900, envs=envs)):
        assert returncode == 0, f"process {i}:\n{log[-6000:]}"
    results = {}
    for i in range(nproc):
        results.update(np.load(tmp_path / f"process{i}.npz"))
    key = jax.random.key(3)
    for dtype_name, dtype in DTYPES.items():
        xs = inputs(nproc, dtype=dtype)
        for name, config in CASES.items():
            nccl = [results[f"{name}/{dtype_name}/nccl/device{d}"] for d in range(nproc)]
            xla = [results[f"{name}/{dtype_name}/xla/device{d}"] for d in range(nproc)]
            for d in range(nproc):
                assert_same_bits(nccl[d], xla[d], f"{name}/{dtype_name}: nccl vs xla backend, rank {d}")
                assert_same_bits(nccl[d], nccl[0], f"{name}/{dtype_name}: rank {d} vs rank 0")
            k = key if config.stochastic else None
            if config.algorithm == "ring":
                expected = _ring_oracle(xs, config, k)
            else:
                expected = oracle(xs, config, k)[0]
            assert_same_bits(nccl[0], np.asarray(expected, np.float32), f"{name}/{dtype_name}: vs the oracle")
    if nproc == 4:
        for name in ("2d_sra_b4", "2d_hier_b4", "2d_hier_ring_b4"):
            nccl = [results[f"{name}/f32/nccl/device{d}"] for d in range(nproc)]
            xla = [results[f"{name}/f32/xla/device{d}"] for d in range(nproc)]
            for d in range(nproc):
                assert_same_bits(nccl[d], xla[d], f"{name}: nccl vs xla backend, rank {d}")
                assert_same_bits(nccl[d], nccl[0], f"{name}: rank {d} vs rank 0")


def test_setup_on_one_gpu_and_errors():
    """One process, one GPU: setup is idempotent, W=1 reductions need no communicator,
    and backend='nccl' without communicators fails with instructions."""
    gpu = jax.devices("gpu")[0]
    mesh = jax.sharding.Mesh(np.array([gpu]), ("i",))
    jax_cgx.nccl.load()
    jax_cgx.nccl.setup(mesh)  # W=1: nothing to create
    x = jax.device_put(jnp.arange(4096, dtype=jnp.float32), gpu)
    cfg = jax_cgx.CompressionConfig(bits=4, backend="nccl")
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v, "i", cfg), mesh=mesh,
                              in_specs=jax.P(), out_specs=jax.P(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))  # a sum over one rank is exact
    assert jax_cgx.nccl.select_backend("auto", "cuda", mesh, ("i",))[0] in ("xla", "nccl")
    other = jax.sharding.Mesh(np.array([gpu]), ("j",))
    with pytest.raises(jax_cgx.nccl.NcclError, match="setup"):
        jax_cgx.nccl.select_backend("nccl", "cuda", other, ("k",))
    jax_cgx.nccl.teardown()
