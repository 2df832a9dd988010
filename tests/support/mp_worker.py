"""One process of the multi-process all-reduce test (tests/runtime/test_multiprocess.py).

    python tests/support/mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Each process has 2 CPU devices; the mesh spans all processes' devices. Results of this
process's devices are written to OUT_DIR/process<ID>.npz.
"""

import os
import sys

if __name__ == "__main__":
    # Only as a worker: tests import CASES and inputs from here, and must keep their 8 devices.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402

CASES = {
    "bits2": jax_cgx.CompressionConfig(bits=2, bucket_size=64, min_size=16),
    "bits4": jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16),
    "bits8": jax_cgx.CompressionConfig(bits=8, bucket_size=64, min_size=16),
    "bits4_stochastic": jax_cgx.CompressionConfig(bits=4, bucket_size=64, stochastic=True, min_size=16),
    # Messages cut into many collectives in flight in one program (jax_cgx._src.exchange.wire): the same bytes.
    "bits4_segments7": jax_cgx.CompressionConfig(bits=4, bucket_size=64, pipeline_segments=7, min_size=16),
    "bits3_stochastic_segments64": jax_cgx.CompressionConfig(bits=3, bucket_size=64, stochastic=True,
                                                            pipeline_segments=64, min_size=16),
}


def inputs(world: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((world, n)).astype(np.float32)


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    xs = inputs(world, 1003)
    sharding = NamedSharding(mesh, P("d"))
    x = jax.make_array_from_callback(xs.shape, sharding, lambda idx: xs[idx])
    results = {}
    for name, config in CASES.items():
        f = jax.jit(
            jax.shard_map(
                lambda v, c=config: jax_cgx.compressed_psum(v[0], "d", c, key=jax.random.key(3))[None],
                mesh=mesh,
                in_specs=P("d"),
                out_specs=P("d"),
            )
        )
        out = f(x)
        for shard in out.addressable_shards:
            results[f"{name}/device{shard.index[0].start}"] = np.asarray(shard.data)[0]
    np.savez(os.path.join(out_dir, f"process{pid}.npz"), **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
