"""One process of the one-GPU multi-rank NCCL test (tests/nccl/test_nccl_gpu.py).

    python tests/support/nccl_gpu_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--cpu]

Every process drives the same GPU (device 0): NCCL accepts that when each process has
its own NCCL_HOSTID (the parent sets it, with the socket transport on `lo`), which
makes the ranks look like separate hosts. Each process runs every case with the nccl
and the xla backend, checks which backend each program used (from its HLO), and
writes its rank's results to OUT_DIR/process<ID>.npz.

``--cpu`` runs the same harness on one CPU device per process (gloo) with the xla
backend only: CI checks the harness itself that way.
"""

import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig

N = 100_003  # odd: a short last chunk and zero padding
CASES = {
    "sra_b4": CompressionConfig(bits=4, bucket_size=512, min_size=16),
    "sra_b8_stochastic": CompressionConfig(bits=8, bucket_size=128, stochastic=True, min_size=16),
    "sra_b2_segments3": CompressionConfig(bits=2, bucket_size=64, pipeline_segments=3, min_size=16),
    "sra_b4_stochastic_segments5": CompressionConfig(bits=4, bucket_size=100, stochastic=True, pipeline_segments=5, min_size=16),
    "ring_b4": CompressionConfig(bits=4, bucket_size=512, algorithm="ring", min_size=16),
    "ring_b3_stochastic_segments2": CompressionConfig(bits=3, bucket_size=256, stochastic=True, algorithm="ring",
                                                      pipeline_segments=2, min_size=16),
}
DTYPES = {"f32": np.float32, "bf16": jax.numpy.bfloat16}
# compressed_psum_scatter (tiled: each rank's [W * M] -> its [M]) and compressed_all_gather ([M] -> [W, M]).
M = 25_001  # odd: blocks not a multiple of the kernels' alignment
SHARDED_CASES = {
    "b4": CompressionConfig(bits=4, bucket_size=512, min_size=16),
    "b8_stochastic_segments3": CompressionConfig(bits=8, bucket_size=128, stochastic=True, pipeline_segments=3, min_size=16),
    "b2_segments5": CompressionConfig(bits=2, bucket_size=100, pipeline_segments=5, min_size=16),
}
SHARDED_TARGETS = {"psum_scatter": "jax_cgx_nccl_reduce_scatter", "all_gather": "jax_cgx_nccl_all_gather"}


def inputs(world: int, n: int = N, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((world, n)).astype(dtype)


def _compiled(body, mesh, in_specs, out_specs, x, target: str):
    """``body`` under shard_map, compiled once: (the executable, whether it calls ``target``)."""
    compiled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)).lower(x).compile()
    return compiled, target in compiled.as_text()


def _psum(mesh, axes, spec, config, x):
    def body(v):
        return jax_cgx.compressed_psum(v.reshape(-1), axes, config, key=jax.random.key(3)).reshape(v.shape)

    return _compiled(body, mesh, spec, spec, x, "jax_cgx_nccl_allreduce")


def _run(mesh, axes, spec, config, x):
    compiled, used_nccl = _psum(mesh, axes, spec, config, x)
    return compiled(x), used_nccl


def _run_sharded(mesh, axis, op, config, x):
    def body(v):
        if op == "psum_scatter":
            return jax_cgx.compressed_psum_scatter(v[0], axis, config, tiled=True, key=jax.random.key(4))[None]
        return jax_cgx.compressed_all_gather(v[0], axis, config, key=jax.random.key(4))[None]

    compiled, used_nccl = _compiled(body, mesh, P(axis), P(axis), x, SHARDED_TARGETS[op])
    return compiled(x), used_nccl


def _local(out) -> dict:
    """This process's results by rank (the row of the global array each shard holds)."""
    return {s.index[0].start or 0: np.asarray(s.data).reshape(-1) for s in out.addressable_shards}


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cpu = "--cpu" in sys.argv[5:]
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    else:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, local_device_ids=[0])
    devices = jax.devices()
    assert len(devices) == nproc and devices[0].platform == ("cpu" if cpu else "gpu"), devices
    backends = ("xla",) if cpu else ("nccl", "xla")
    meshes = {"flat": (jax.make_mesh((nproc,), ("i",), devices=devices), "i", P("i"))}
    if nproc == 4:
        meshes["2d"] = (jax.make_mesh((2, 2), ("node", "local"), devices=devices), ("node", "local"),
                        P(("node", "local")))
    results = {}
    for mesh_name, (mesh, axes, spec) in meshes.items():
        if not cpu:
            jax_cgx.nccl.setup(mesh)
        cases = dict(CASES)
        if mesh_name == "2d":
            cases = {"2d_sra_b4": CASES["sra_b4"], "2d_hier_b4": CASES["sra_b4"].replace(hierarchical=True),
                     "2d_hier_ring_b4": CASES["ring_b4"].replace(hierarchical=True)}
        for dtype_name, dtype in DTYPES.items():
            if mesh_name == "2d" and dtype_name != "f32":
                continue
            xs = inputs(nproc, dtype=dtype)
            x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, spec), lambda idx: xs[idx])
            for name, config in cases.items():
                for backend in backends:
                    out, used_nccl = _run(mesh, axes, spec, config.replace(backend=backend), x)
                    assert used_nccl == (backend == "nccl"), (name, backend, used_nccl)
                    for rank, value in _local(out).items():
                        results[f"{name}/{dtype_name}/{backend}/rank{rank}"] = value.astype(np.float32)
                # auto runs xla even where communicators exist (the nccl backend measured slower;
                # compiled, not run: only its choice matters)
                _, used_nccl = _psum(mesh, axes, spec, config.replace(backend="auto"), x)
                assert not used_nccl, f"{name}: backend='auto' picked nccl"
    # A pytree: a large leaf through the custom call next to small leaves that XLA sums
    # with its own NCCL collectives, in one program (ordering of both kinds of calls).
    mesh, axes, spec = meshes["flat"]
    xs = inputs(nproc)
    x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, spec), lambda idx: xs[idx])
    # The mean too: the nccl call divides in its own decode (its scale attribute).
    for backend, (tree_name, reduce) in itertools.product(
            backends, [("tree", jax_cgx.compressed_psum), ("tree_mean", jax_cgx.compressed_pmean)]):
        config = CompressionConfig(bits=4, min_size=1024, fusion_buffer_mb=0.1, backend=backend)

        def tree_body(v, config=config, reduce=reduce):
            v = v.reshape(-1)
            tree = {"big": v, "small": v[:100] * 2.0, "big2": v[::-1] + 1.0}
            out = reduce(tree, axes, config, key=jax.random.key(5))
            return jnp.concatenate([out["big"], out["small"], out["big2"]])[None]

        compiled, used_nccl = _compiled(tree_body, mesh, spec, spec, x, "jax_cgx_nccl_allreduce")
        assert used_nccl == (backend == "nccl")
        for rank, value in _local(compiled(x)).items():
            results[f"{tree_name}/f32/{backend}/rank{rank}"] = value

    # Reduce-scatter and all-gather: the nccl backend's custom calls against the xla backend.
    for dtype_name, dtype in DTYPES.items():
        for op in SHARDED_TARGETS:
            xs = inputs(nproc, nproc * M if op == "psum_scatter" else M, dtype=dtype)
            x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, spec), lambda idx, xs=xs: xs[idx])
            for name, config in SHARDED_CASES.items():
                for backend in backends:
                    out, used_nccl = _run_sharded(mesh, axes, op, config.replace(backend=backend), x)
                    assert used_nccl == (backend == "nccl"), (op, name, backend, used_nccl)
                    for rank, value in _local(out).items():
                        results[f"{op}/{name}/{dtype_name}/{backend}/rank{rank}"] = value.astype(np.float32)

    np.savez(os.path.join(out_dir, f"process{pid}.npz"), **results)
    if not cpu:
        info = jax_cgx.nccl.communicators()
        print(f"process {pid}: {len(info)} communicators: {info}", flush=True)
        jax_cgx.nccl.teardown()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
