"""A compressed_psum check for the launch tests: run under jax_cgx.launch or mpirun.

    python tests/launch_check.py OUT_DIR [--fail-rank R] [--hang-rank R]
                                 [--coordinator HOST:PORT --num-processes N --process-id I]

Writes OUT_DIR/pid<rank> (for the no-leak checks) and OUT_DIR/result<rank>.npy.
"""

import argparse
import os
import pathlib
import time

import jax_cgx.distributed

p = argparse.ArgumentParser()
p.add_argument("out_dir")
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--hang-rank", type=int, default=None)
p.add_argument("--coordinator", default=None)
p.add_argument("--num-processes", type=int, default=None)
p.add_argument("--process-id", type=int, default=None)
args = p.parse_args()
# First, before anything touches a device; explicit arguments (if any) win over the environment.
info = jax_cgx.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402


def main() -> None:
    out = pathlib.Path(args.out_dir)
    rank = info.process_index
    (out / f"pid{rank}").write_text(str(os.getpid()))
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} failing on purpose")
    if args.hang_rank is not None:
        time.sleep(600)  # stopped by the launcher (the failing rank) or a signal

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    xs = np.random.default_rng(0).standard_normal((len(devices), 777)).astype(np.float32)
    x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("d")), lambda idx: xs[idx])
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=64)
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config)[None], mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    y = f(x)
    local = np.stack([np.asarray(s.data)[0] for s in y.addressable_shards])
    np.save(out / f"result{rank}.npy", local)
    print(f"rank {rank} of {info.process_count} ({info.source}): {len(devices)} devices, ok", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
