"""The nccl backend on a real GPU (marked `gpu`; tools/gpu_check.sh runs it).

Several ranks share ONE GPU: each is its own process with a distinct NCCL_HOSTID, so
NCCL treats them as separate hosts and connects them over sockets on `lo`
(docs/nccl.md, "Several ranks on one GPU"). Every case runs with the nccl and the xla backend; the results
must be bitwise equal to each other, identical on every rank, and equal to the
single-program oracle of the algorithm.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import oracle, seed_rows
from bitwise import assert_same_bits
from nccl_gpu_worker import CASES, DTYPES, SHARDED_CASES, SHARDED_TARGETS, inputs  # noqa: E402
from processes import SUPPORT, run_all, worker_commands

import jax_cgx
from jax_cgx import testing
from jax_cgx._src import backends
from jax_cgx._src.exchange.chunks import chunk_length

WORKER = SUPPORT / "nccl_gpu_worker.py"


# XLA settings the nccl backend must work under: its custom calls run between XLA's own
# (async) collectives, with the latency-hiding scheduler and command buffers on or off.
XLA_VARIANTS = {
    "default": "",
    "lhs-on-cmdbuf-off": "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=",
    "lhs-off": "--xla_gpu_enable_latency_hiding_scheduler=false",
}


def _worker_env(pid: int, nproc: int, xla_flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags  # the workers use the GPU, not 8 virtual CPU devices
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
    chunk = chunk_length(n, w, config.bucket_size, config.skip_incomplete_buckets)
    out, _ = testing.simulate_ring(
        jnp.asarray(xs), seed_rows(key, config, w), chunk=chunk, bits=config.bits,
        bucket_size=config.bucket_size, stochastic=config.stochastic,
    )
    return out


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "nproc, variant", [(2, "default"), (4, "default"), (2, "lhs-on-cmdbuf-off"), (2, "lhs-off")]
)
def test_ranks_on_one_gpu_nccl_equals_xla_equals_oracle(tmp_path, nproc, variant):
    envs = [_worker_env(i, nproc, XLA_VARIANTS[variant]) for i in range(nproc)]
    _check(_run_workers(tmp_path, nproc, envs), nproc, backends=("nccl", "xla"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_same_harness_on_cpu(tmp_path):
    """The worker and the checks above, on 2 CPU processes with the xla backend (runs in CI)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    _check(_run_workers(tmp_path, 2, [env, env], "--cpu"), 2, backends=("xla",))


def _run_workers(tmp_path, nproc, envs, *flags) -> dict:
    commands = worker_commands(WORKER, nproc, tmp_path, *flags)
    for i, (returncode, log) in enumerate(run_all(commands, timeout=900, envs=envs)):
        assert returncode == 0, f"process {i}:\n{log[-6000:]}"
    results = {}
    for i in range(nproc):
        results.update(np.load(tmp_path / f"process{i}.npz"))
    return results


def _check(results: dict, nproc: int, backends) -> None:
    """Every backend bitwise equal to the first, on every rank, and to the oracle."""
    first = backends[0]
    key = jax.random.key(3)
    for dtype_name, dtype in DTYPES.items():
        xs = inputs(nproc, dtype=dtype)
        for name, config in CASES.items():
            nccl = [results[f"{name}/{dtype_name}/{first}/rank{d}"] for d in range(nproc)]
            for d in range(nproc):
                for other in backends[1:]:
                    xla = results[f"{name}/{dtype_name}/{other}/rank{d}"]
                    assert_same_bits(nccl[d], xla, f"{name}/{dtype_name}: {first} vs {other} backend, rank {d}")
                assert_same_bits(nccl[d], nccl[0], f"{name}/{dtype_name}: rank {d} vs rank 0")
            k = key if config.stochastic else None
            # The oracle, the pure-JAX reference codec, run where XLA compiles it for the CPU and
            # for the GPU: both exact (on an H100 the GPU's once was not, by its f32 divide).
            for device in {d.platform: d for d in (jax.devices("cpu")[0], jax.devices()[0])}.values():
                with jax.default_device(device):
                    if config.algorithm == "ring":
                        expected = _ring_oracle(xs, config, k)
                    else:
                        expected = oracle(xs, config, k)[0]
                what = f"{name}/{dtype_name}: vs the oracle on {device.platform}"
                assert_same_bits(nccl[0], np.asarray(expected, np.float32), what)
    names = ["tree", "tree_mean"] + (["2d_sra_b4", "2d_hier_b4", "2d_hier_ring_b4"] if nproc == 4 else [])
    for name in names:
        nccl = [results[f"{name}/f32/{first}/rank{d}"] for d in range(nproc)]
        for d in range(nproc):
            for other in backends[1:]:
                assert_same_bits(nccl[d], results[f"{name}/f32/{other}/rank{d}"], f"{name}: {first} vs {other}, rank {d}")
            assert_same_bits(nccl[d], nccl[0], f"{name}: rank {d} vs rank 0")
    for op in SHARDED_TARGETS:
        for name in SHARDED_CASES:
            for dtype_name in DTYPES:
                case = f"{op}/{name}/{dtype_name}"
                ours = [results[f"{case}/{first}/rank{d}"] for d in range(nproc)]
                for d in range(nproc):
                    for other in backends[1:]:
                        assert_same_bits(ours[d], results[f"{case}/{other}/rank{d}"], f"{case}: {first} vs {other}, rank {d}")
                    if op == "all_gather":  # every replica holds the same bits
                        assert_same_bits(ours[d], ours[0], f"{case}: rank {d} vs rank 0")


@pytest.mark.gpu
def test_setup_on_one_gpu_and_errors():
    """One process, one GPU: setup is idempotent, W=1 reductions need no communicator,
    and backend='nccl' without communicators fails with instructions."""
    gpu = jax.devices("gpu")[0]
    mesh = jax.sharding.Mesh(np.array([gpu]), ("i",))
    jax_cgx.nccl.load()
    jax_cgx.nccl.setup(mesh)  # W=1: nothing to create
    x = jax.device_put(jnp.arange(4096, dtype=jnp.float32), gpu)
    cfg = jax_cgx.CompressionConfig(bits=4, backend="nccl", min_size=16)
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v, "i", cfg), mesh=mesh,
                              in_specs=jax.P(), out_specs=jax.P(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))  # a sum over one rank is exact
    one = backends.Reduction("compressed_psum", "psum", ("i",), 1)
    assert backends.choose("auto", one, mesh, "cuda")[0] in ("xla", "nccl")
    other = jax.sharding.Mesh(np.array([gpu]), ("j",))
    with pytest.raises(jax_cgx.nccl.NcclError, match="setup"):
        backends.choose("nccl", backends.Reduction("compressed_psum", "psum", ("k",), 1), other, "cuda")
    jax_cgx.nccl.teardown()
