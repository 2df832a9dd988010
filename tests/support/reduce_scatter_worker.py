"""One process of tests/exchange/test_reduce_scatter_gloo.py: the hierarchical form's exact
reduce-scatter inside a node against numpy, bitwise, over several calls (and lax's own
psum_scatter beside it, reported: jax-ml/jax#40830 makes it wrong on gloo).

``argv``: values per rank, ranks per node ``m``. Two processes of ``m`` devices each; every node
takes ``m // 2`` devices of each process, so the reduce-scatter crosses processes."""

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src.exchange.hierarchical import reduce_scatter_exact

jax_cgx.distributed.initialize()
values, m = int(sys.argv[1]), int(sys.argv[2])
devices = jax.devices()
# Row k of (nodes, m) interleaves the two processes' devices: local rank j is process j % 2's.
order = np.array(devices).reshape(2, -1).T.reshape(-1, m)
mesh = jax.sharding.Mesh(order, ("node", "local"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
spec = P(("node", "local"))
rows = np.random.default_rng(7).standard_normal((len(devices), values)).astype(np.float32)
x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, spec), lambda idx: rows[idx])


def over(fn):
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec))


ours = over(lambda v: reduce_scatter_exact(v, "local", m))
lax_rs = over(lambda v: jax.lax.psum_scatter(v, "local", scatter_dimension=0, tiled=True))
shard = values // m
expected = {}
for k in range(len(devices)):  # row k of the data lives on mesh position k: node k // m, local rank k % m
    node, j = divmod(k, m)
    block = rows[node * m:(node + 1) * m, j * shard:(j + 1) * shard]
    total = block[j]  # the documented order: its own block, then from ranks j - 1, j - 2, ...
    for s in range(1, m):
        total = total + block[(j - s) % m]
    expected[k] = total
wrong = {"ours": 0, "lax": 0}
for _ in range(10):
    for name, fn in (("ours", ours), ("lax", lax_rs)):
        out = fn(x)
        for piece in out.addressable_shards:
            k = piece.index[0].start
            got = np.asarray(piece.data)[0]
            # lax's order is unspecified: compared bitwise for 2 ranks, to float32 rounding beyond.
            good = np.array_equal(got, expected[k]) if name == "ours" or m == 2 else \
                np.allclose(got, expected[k], rtol=1e-5, atol=1e-5)
            wrong[name] += not good
print("RESULT " + json.dumps(wrong), flush=True)
