"""Empty and 0-d parameters (issue 58): top-k's state saves with orbax, the ZeRO optimizer steps and
resizes, compressed_psum_scatter of an empty leaf returns its empty block; the other leaves as without them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from bitwise import assert_same_bits
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx.optax import resize_state, sharded, state_specs, topk_mean

W = 8
CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)


def _params():
    return {"e": jnp.zeros((0, 4)), "s": jnp.ones(()), "w": jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)}


def _grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((W, *p.shape)).astype(np.float32)), params)


def test_topk_state_of_empty_and_scalar_leaves_saves_and_steps(tmp_path):
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params = _params()
    tx = optax.chain(topk_mean("data", 0.1, min_size=1), optax.sgd(0.1))
    specs = state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(jax.shard_map(lambda g, s, p: tx.update(jax.tree.map(lambda v: v[0], g), s, p), mesh=mesh,
                                 in_specs=(P("data"), specs, P()), out_specs=(P(), specs)))
    updates, state = step(_grads(params, 0), state, params)
    assert updates["e"].shape == (0, 4) and np.isfinite(float(updates["s"]))
    with ocp.StandardCheckpointer() as checkpointer:  # a zero-size array in the state: orbax refused it
        checkpointer.save(tmp_path / "topk", state)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "topk", target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert_same_bits(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_sharded_optimizer_with_empty_and_scalar_parameters(axis_type, tmp_path):
    mesh = device_mesh((W,), ("data",), axis_type)
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    opt = sharded(optax.adam(1e-2), "data", grad_config=CONFIG, error_feedback=True)
    specs = opt.state_specs(params, mesh)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def update(g, s):
        return opt.update(jax.tree.map(lambda v: v[0], g), s)

    step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs)))
    grads = jax.device_put(_grads(params, 1), NamedSharding(mesh, P("data")))
    new, state = step(grads, state)
    assert new["e"].shape == (0, 4) and new["s"].shape == () and np.isfinite(float(new["s"]))
    # The same step without the empty leaf: the others' bits are the same.
    alone = {k: v for k, v in params.items() if k != "e"}
    specs_alone = opt.state_specs(alone, mesh)
    state_alone = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs_alone))(alone)
    want, _ = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), specs_alone),
                                    out_specs=(P(), specs_alone)))({k: v for k, v in grads.items() if k != "e"},
                                                                   state_alone)
    for k in want:
        assert_same_bits(np.asarray(new[k]), np.asarray(want[k]), k)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "zero", state)
    small = resize_state(jax.device_get(state), jax.device_get(params), "data", world=4)
    assert small.master["e"] == state.master["e"]  # the empty parameter's placeholder
    assert small.master["w"].shape == (64 * 64,) and small.master["s"].shape == (4,)


def test_compressed_psum_scatter_of_an_empty_leaf():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)

    def body(v):
        x = {"e": jnp.zeros((0, 4)), "w": v[0]}
        return jax_cgx.compressed_psum_scatter(x, "data", CONFIG, tiled=True)

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        jnp.ones((W, W * 64), jnp.float32))
    assert out["e"].shape == (0, 4) and out["w"].shape == (W * 64,)

