"""The hierarchical all-reduce over nodes, call after call, against the exact psum and its own first call.

    sudo python benchmarks/netem/run.py --nodes 2 --per-node 2 --rate 1gbit \
        --script benchmarks/netem/hierarchical_exactness.py -- 16777216    # values per device
    REPRO_LAX=1 sudo -E python ...   # the same two-level sum with lax's psum_scatter, psum, all_gather

Every call of a deterministic reduction must give the same bits, within the 4-bit bound of the
psum. Before jax_cgx stopped using gloo's ReduceScatter on CPUs of several processes
(jax-ml/jax#40830), 2 of 6 calls were wrong by ~9 where the bound is ~0.95, and the plain lax
version too (docs/multinode.md).
"""

import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx

AXES = ("node", "local")


def main() -> None:
    jax_cgx.distributed.initialize()
    devices = jax.devices()
    world = len(devices)
    local = jax_cgx.distributed.detect().local_count * jax.local_device_count()
    mesh = jax.make_mesh((world // local, local), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=devices)
    spec = P(AXES)
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 16 << 20
    x = jax.make_array_from_callback(
        (world, m), NamedSharding(mesh, spec),
        lambda idx: np.random.default_rng(idx[0].start or 0).standard_normal((1, m)).astype(np.float32))

    def over(fn):
        return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec))

    def lax_two_level(v):
        shard = jax.lax.psum_scatter(v, "local", scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(jax.lax.psum(shard, "node"), "local", tiled=True)

    config = jax_cgx.CompressionConfig(bits=4, hierarchical=True, fusion_buffer_mb=1024, min_size=0)
    plain = over(lambda v: jax.lax.psum(v, AXES))
    two_level = over(lax_two_level if os.environ.get("REPRO_LAX") else
                     lambda v: jax_cgx.compressed_psum(v, AXES, config))

    def mine(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)[0]

    exact = mine(plain(x))
    first = None
    for call in range(6):
        out = mine(two_level(x))
        first = out if first is None else first
        print(f"[{jax.process_index()}] call {call}: max |diff| to call 0 {float(np.abs(out - first).max()):.4g}, "
              f"to psum {float(np.abs(out - exact).max()):.4g}", flush=True)


if __name__ == "__main__":
    main()
