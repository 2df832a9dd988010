"""jax_cgx.optax on a mesh with a model axis: the transformations inside a shard_map over
("data", "model") whose in_specs split the parameters over "model" (tensor parallelism written by
hand), their states' specs from state_specs(param_specs=), orbax and resize_state on them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from bitwise import assert_same_bits
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx.optax import compressed_mean, resize_state, shard_shapes, state_specs, topk_mean

ROWS = 32
CONFIG = jax_cgx.CompressionConfig(bits=8, bucket_size=64, min_size=16)
# "s" stays replicated over "model": it is fused apart from the split leaves (a bucket shared with
# another device's shard would decode it differently on the two model devices).
SPECS = {"b1": P("model"), "s": P(), "w1": P(None, "model"), "w2": P("model", None)}


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"b1": rng.standard_normal((64,)).astype(np.float32) * 0.1,
              "s": np.eye(4, dtype=np.float32) + rng.standard_normal((4, 4)).astype(np.float32) * 0.1,
              "w1": rng.standard_normal((16, 64)).astype(np.float32) * 0.3,
              "w2": rng.standard_normal((64, 4)).astype(np.float32) * 0.3}
    x = rng.standard_normal((ROWS, 16)).astype(np.float32)
    y = rng.standard_normal((ROWS, 4)).astype(np.float32)
    return params, x, y


def _loss(params, x, y):
    return jnp.mean(((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]) @ params["s"] - y) ** 2)


def _local_loss(params, x, y):
    """The same loss on a device's shards: the hidden units split over "model" (Megatron's MLP)."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((lax.psum(h @ params["w2"], "model") @ params["s"] - y) ** 2)


def _run(tx, mesh, params, x, y, steps):
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    local = shard_shapes(params, SPECS, mesh)
    specs = state_specs(jax.eval_shape(tx.init, local), "data", param_specs=SPECS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SPECS,), out_specs=specs))
    state = init(placed)

    def step(params, state, x, y):
        mine = jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), params)
        grads = jax.grad(_local_loss)(mine, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(SPECS, specs, P("data"), P("data")),
                                 out_specs=(SPECS, specs)))
    for _ in range(steps):
        placed, state = step(placed, state, x, y)
    return placed, state, specs


def _sgd_reference(params, x, y, lr, steps):
    for _ in range(steps):
        params = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(_loss)(params, x, y))
    return params


def _assert_placed_alike(got, mesh):
    for k in got:
        assert got[k].sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), got[k].ndim), k
    shards = [np.asarray(s.data) for s in got["s"].addressable_shards]
    for s in shards[1:]:  # the replicated leaf: the same bits on every device
        assert_same_bits(s, shards[0])


def test_compressed_mean_with_error_feedback_on_model_sharded_leaves():
    params, x, y = _problem()
    mesh, lr = device_mesh((4, 2), ("data", "model")), 0.1
    make = lambda c: optax.chain(compressed_mean("data", c, layer_min_size=16, error_feedback=True),  # noqa: E731
                                 optax.sgd(lr))
    ref = _sgd_reference(params, x, y, lr, 3)
    exact, _, _ = _run(make(jax_cgx.CompressionConfig(bits=32)), mesh, params, x, y, 3)
    for k in ref:
        np.testing.assert_allclose(exact[k], ref[k], rtol=1e-5, atol=2e-6, err_msg=k)
    got, state, specs = _run(make(CONFIG), mesh, params, x, y, 3)
    _assert_placed_alike(got, mesh)
    for k in ref:  # three 8-bit steps with error feedback stay near exact SGD
        np.testing.assert_allclose(got[k], ref[k], atol=2e-3, err_msg=k)
    # Per-device state: axis 0 over "data" first, then as the parameter is split.
    residual = specs[0].residual
    assert residual["w1"] == P("data", "model") and residual["w2"] == P(("data", "model"), None), residual
    assert residual["s"] == P("data"), residual  # replicated over "model": split over "data" alone
    assert state[0].residual["w1"].shape == (4 * 16, 64)  # the data devices' residuals, each of the whole leaf


def test_topk_mean_on_model_sharded_leaves():
    params, x, y = _problem()
    mesh, lr = device_mesh((4, 2), ("data", "model")), 0.1
    make = lambda ratio: optax.chain(topk_mean("data", ratio, momentum=0.0, min_size=16), optax.sgd(lr))  # noqa: E731
    exact, _, _ = _run(make(1.0), mesh, params, x, y, 2)
    ref = _sgd_reference(params, x, y, lr, 2)
    for k in ref:
        np.testing.assert_allclose(exact[k], ref[k], rtol=1e-5, atol=2e-6, err_msg=k)
    got, state, specs = _run(make(0.25), mesh, params, x, y, 2)
    _assert_placed_alike(got, mesh)
    assert specs[0].v["w1"] == P("data", "model") and specs[0].v["w2"] == P(("data", "model"), None)


def test_state_specs_follow_the_parameters():
    params, _, _ = _problem()
    tx = optax.chain(compressed_mean("data", CONFIG, layer_min_size=1, error_feedback=True), optax.adam(1e-3))
    specs = state_specs(jax.eval_shape(tx.init, params), "data", param_specs=SPECS)
    mean, adam = specs[0], specs[1][0]
    assert mean.residual["w1"] == P("data", "model") and mean.residual["w2"] == P(("data", "model"), None)
    # Adam runs after the mean: its moments are the same on every data device, split as the parameters.
    assert adam.mu == SPECS and adam.nu == SPECS and adam.count == P()
    with pytest.raises(ValueError, match=r"names \('data',\), the axis the mean is taken over"):
        state_specs(jax.eval_shape(tx.init, params), "data", param_specs={**SPECS, "w1": P("data")})
    powersgd = jax_cgx.optax.powersgd_mean("data", rank=2)
    with pytest.raises(NotImplementedError, match="PowerSGD with parameters sharded over model axes"):
        state_specs(jax.eval_shape(powersgd.init, params), "data", param_specs=SPECS)


def test_shard_shapes_refuses_a_dimension_its_axes_do_not_divide():
    """It rounded down (63 over 2 blocks gave 31), a shape shard_map would never pass."""
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    assert shard_shapes({"w": jnp.zeros((16, 64))}, {"w": P(None, "model")}, mesh)["w"].shape == (16, 32)
    with pytest.raises(ValueError, match=r"shard_shapes: params\['w'\]: dimension 1 of size 63 does not split evenly "
                                         r"over the mesh axes \('model',\) \(2 blocks\)"):
        shard_shapes({"w": jnp.zeros((16, 63))}, {"w": P(None, "model")}, mesh)


def test_orbax_round_trip_and_resize_over_data(tmp_path):
    params, x, y = _problem(1)
    tx = optax.chain(compressed_mean("data", CONFIG, layer_min_size=16, error_feedback=True), optax.adam(1e-2))
    _, state, specs = _run(tx, device_mesh((4, 2), ("data", "model")), params, x, y, 2)
    path = tmp_path / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = ocp.StandardCheckpointer().restore(path, target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding == b.sharding
        assert_same_bits(np.asarray(a), np.asarray(b))
    # 4 -> 2 data devices, "model" unchanged: each new device holds the old devices' mean residual.
    small = resize_state(restored, params, "data", world=2)
    old = np.asarray(restored[0].residual["w1"]).reshape(4, 16, 64)
    new = np.asarray(small[0].residual["w1"]).reshape(2, 16, 64)
    np.testing.assert_allclose(new[0], old.mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(new[0], new[1])
    # The resized state runs on the smaller mesh with the same specs.
    mesh2 = device_mesh((2, 2), ("data", "model"))
    placed = {k: jax.device_put(v, NamedSharding(mesh2, SPECS[k])) for k, v in params.items()}
    small = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh2, s)), small, specs)
    step = jax.jit(jax.shard_map(lambda p, s, x, y: tx.update(jax.grad(_local_loss)(
        jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), p), x, y), s, p),
        mesh=mesh2, in_specs=(SPECS, specs, P("data"), P("data")), out_specs=(SPECS, specs)))
    updates, _ = step(placed, small, *(jax.device_put(a, NamedSharding(mesh2, P("data"))) for a in (x, y)))
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))


def _run_zero(opt, mesh, params, x, y, steps, state=None):
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    specs = opt.state_specs(params, mesh, param_specs=SPECS)
    if state is None:
        state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(SPECS,), out_specs=specs))(placed)

    def step(params, state, x, y):
        grads = jax.grad(_local_loss)(jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), params), x, y)
        return opt.update(grads, state)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(SPECS, specs, P("data"), P("data")),
                                 out_specs=(SPECS, specs)))
    for _ in range(steps):
        placed, state = step(placed, state, x, y)
    return placed, state, specs


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error_feedback"])
def test_sharded_optimizer_over_data_with_parameters_split_over_model(error_feedback):
    params, x, y = _problem(2)
    lr = 0.1
    ref = _sgd_reference(params, x, y, lr, 2)
    mesh = device_mesh((4, 2), ("data", "model"))
    exact, _, _ = _run_zero(jax_cgx.optax.sharded(optax.sgd(lr), "data"), mesh, params, x, y, 2)
    for k in ref:
        np.testing.assert_allclose(exact[k], ref[k], rtol=1e-5, atol=2e-6, err_msg=k)
    opt = jax_cgx.optax.sharded(optax.sgd(lr), "data", grad_config=CONFIG, error_feedback=error_feedback)
    got, state, specs = _run_zero(opt, mesh, params, x, y, 2)
    _assert_placed_alike(got, mesh=mesh)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=2e-3, err_msg=k)
    # Each model shard's flat parameter in turn, split over data within it.
    assert specs.master == {"b1": P(("model", "data")), "s": P("data"), "w1": P(("model", "data")),
                            "w2": P(("model", "data"))}
    w1 = np.asarray(state.master["w1"]).reshape(2, -1)[:, :16 * 32]  # (model shard, its 512 values)
    np.testing.assert_array_equal(w1[1].reshape(16, 32), np.asarray(got["w1"])[:, 32:])

    # 4 -> 2 data devices, "model" unchanged: the master shards re-padded exactly, training goes on.
    mesh2 = device_mesh((2, 2), ("data", "model"))
    resized = resize_state(state, params, "data", world=2, param_specs=SPECS, mesh=mesh2)
    np.testing.assert_array_equal(np.asarray(resized.master["w1"]).reshape(2, -1)[:, :16 * 32], w1)
    specs2 = opt.state_specs(params, mesh2, param_specs=SPECS)
    resized = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh2, s)), resized, specs2)
    more, _, _ = _run_zero(opt, mesh2, {k: np.asarray(v) for k, v in got.items()}, x, y, 1, state=resized)
    for k in got:  # the parameters the resized state holds come back, one step further
        assert np.max(np.abs(np.asarray(more[k]) - np.asarray(got[k]))) < 0.05, k
