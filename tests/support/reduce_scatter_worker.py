"""One process of tests/collectives/test_reduce_scatter_gloo.py: the hierarchical form's exact
reduce-scatter inside a node against numpy's sum, bitwise, over several calls (and lax's own
psum_scatter beside it, reported: jax-ml/jax#40830 makes it wrong on gloo)."""

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src.exchange.hierarchical import _reduce_scatter_exact

jax_cgx.distributed.initialize()
values = int(sys.argv[1])
devices = jax.devices()
# Each "node" pairs device i of process 0 with device i of process 1: the reduce-scatter crosses processes.
order = np.array(devices).reshape(2, -1).T
mesh = jax.sharding.Mesh(order, ("node", "local"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
spec = P(("node", "local"))
rows = np.random.default_rng(7).standard_normal((len(devices), values)).astype(np.float32)
x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, spec), lambda idx: rows[idx])


def over(fn):
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec))


ours = over(lambda v: _reduce_scatter_exact(v, "local", 2))
lax_rs = over(lambda v: jax.lax.psum_scatter(v, "local", scatter_dimension=0, tiled=True))
half = values // 2
expected = {}
flat = order.reshape(-1)  # row k of the data lives on mesh position k: node k // 2, local rank k % 2
for k in range(len(flat)):
    node = k // 2
    expected[k] = (rows[2 * node] + rows[2 * node + 1])[(k % 2) * half:(k % 2 + 1) * half]
wrong = {"ours": 0, "lax": 0}
for _ in range(10):
    for name, fn in (("ours", ours), ("lax", lax_rs)):
        out = fn(x)
        for shard in out.addressable_shards:
            d = shard.index[0].start
            if not np.array_equal(np.asarray(shard.data)[0], expected[d]):
                wrong[name] += 1
print("RESULT " + json.dumps(wrong), flush=True)
