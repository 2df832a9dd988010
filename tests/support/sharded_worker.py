"""One process of the multi-process reduce-scatter / all-gather test (tests/collectives/test_sharded.py).

    python tests/support/sharded_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Each process has 2 CPU devices; the mesh spans all processes' devices. ``programs(mesh)`` is
what runs, here and (on 4 devices of one process) in the test; the results of this process's
devices go to OUT_DIR/process<ID>.npz.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402

CONFIG = jax_cgx.CompressionConfig(bits=3, bucket_size=64, stochastic=True, min_size=16)
M = 700  # values per block


def inputs(world: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((world, world, M)).astype(np.float32)


def programs(mesh) -> dict:
    """name -> the jitted program over ``mesh`` (input: inputs(world) sharded along "d")."""
    key = jax.random.key(11)

    def scatter(v):
        return jax_cgx.compressed_psum_scatter(v[0], "d", CONFIG, key=key)[None]

    def gather(v):
        return jax_cgx.compressed_all_gather(v[0, 0], "d", CONFIG, key=key)[None]

    return {name: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
            for name, fn in (("psum_scatter", scatter), ("all_gather", gather))}


def auto_programs(mesh) -> dict:
    """The programs with policy="auto" on the measured link: every process must take the same
    decisions (or the collectives would not pair); each result is lax's or CONFIG's bits."""
    key = jax.random.key(11)
    auto = CONFIG.replace(policy="auto")

    def scatter(v):
        return jax_cgx.compressed_psum_scatter(v[0], "d", auto, key=key)[None]

    def gather(v):
        return jax_cgx.compressed_all_gather(v[0, 0], "d", auto, key=key)[None]

    return {name: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
            for name, fn in (("psum_scatter_auto", scatter), ("all_gather_auto", gather))}


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    xs = inputs(len(devices))
    x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("d")), lambda idx: xs[idx])
    results = {}
    for name, fn in {**programs(mesh), **auto_programs(mesh)}.items():
        for shard in fn(x).addressable_shards:
            results[f"{name}/device{shard.index[0].start}"] = np.asarray(shard.data)[0]
    np.savez(os.path.join(out_dir, f"process{pid}.npz"), **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
