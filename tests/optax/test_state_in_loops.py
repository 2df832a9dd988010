"""Every stateful transformation's state, made by ``init`` inside ``shard_map(check_vma=True)``,
has the type ``update`` gives back, so it can be a ``lax.scan`` carry: on a 1-D mesh, and on a
2-D mesh whose second axis shards the parameters (tensor parallel beside data parallel). The
scanned updates are those of the same steps unrolled: to float32 rounding, not bitwise, since
the two are different programs (XLA contracts the momentum's ``0.9 * u + g`` into a fused
multiply-add in one and not the other; the transformations promise no bits across programs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cgx import CompressionConfig
from jax_cgx.optax import compressed_mean, powersgd_mean, topk_mean

STEPS = 3
TRANSFORMS = {
    "compressed_mean-ef": lambda: compressed_mean(
        "data", CompressionConfig(bits=4, bucket_size=64, min_size=16), layer_min_size=16, error_feedback=True),
    "topk-momentum": lambda: topk_mean("data", 0.1, min_size=16, momentum=0.9),
    "topk-small-leaf": lambda: topk_mean("data", 0.1, min_size=10**9, momentum=0.9),  # its u is a mean's
    "powersgd-ef": lambda: powersgd_mean("data", 2, start_iter=1),
    "powersgd": lambda: powersgd_mean("data", 2, start_iter=1, error_feedback=False),  # only q
}


@pytest.mark.parametrize("model", [1, 2], ids=["1d", "2d"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_state_made_inside_shard_map_is_a_scan_carry(name, model):
    tx = TRANSFORMS[name]()
    data = len(jax.devices()) // model
    mesh = jax.make_mesh((data, model), ("data", "model"))
    cols = 32 * model
    params = jax.device_put(jnp.zeros((64, cols), jnp.float32), NamedSharding(mesh, P(None, "model")))
    grads = jax.random.normal(jax.random.key(0), (STEPS, data, 64, cols), jnp.float32)
    grads = jax.device_put(grads, NamedSharding(mesh, P(None, "data", None, "model")))

    def body(p, gs):
        gs = gs[:, 0]

        def step(state, g):
            upd, state = tx.update({"w": g}, state)
            return state, upd["w"]

        _, scanned = lax.scan(step, tx.init({"w": p}), gs)
        state, unrolled = tx.init({"w": p}), []
        for t in range(STEPS):
            state, upd = step(state, gs[t])
            unrolled.append(upd)
        return scanned, jnp.stack(unrolled)

    spec = P(None, None, "model")  # the means are the same on every rank of "data" (check_vma checks)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P(None, "data", None, "model")),
                              out_specs=(spec, spec)))
    scanned, unrolled = f(params, grads)
    assert np.isfinite(np.asarray(scanned)).all() and np.asarray(scanned).any()
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-6, err_msg=f"{name} on a {data}x{model} mesh")
