"""jax_cgx.optax.sharded: an optimizer with its state sharded over the devices (ZeRO-1/2), the
gradients reduce-scattered and the parameters all-gathered (jax_cgx/_src/optax/zero.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
import jax_cgx.optax as cgx_optax

W = 8


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _problem():
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((16, 50)).astype(np.float32) * 0.3,  # 800 values: padded to 8 x 100
              "b1": np.zeros((50,), np.float32),  # 50: padded to 8 x 7
              "w2": rng.standard_normal((50, 3)).astype(np.float32) * 0.3}
    x = rng.standard_normal((4 * W, 16)).astype(np.float32)
    y = rng.standard_normal((4 * W, 3)).astype(np.float32)
    return params, x, y


def _sharded_trainer(opt, mesh, params):
    specs = opt.state_specs(params, mesh)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def local(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(jax.lax.pcast(params, "data", to="varying"), x, y)
        params, state = opt.update(grads, state)
        return params, state, jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs, P())))
    return specs, state, step


def _replicated_trainer(tx, mesh, params):
    state = tx.init(params)

    def local(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(jax.lax.pcast(params, "data", to="varying"), x, y)
        grads = jax.lax.pmean(grads, "data")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

    return state, jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                        out_specs=(P(), P(), P())))


def test_exact_is_data_parallel_adam_with_the_state_sharded():
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    opt = cgx_optax.sharded(optax.adam(1e-2), "data")
    specs, state, step = _sharded_trainer(opt, mesh, params)
    # The master copy and Adam's moments are sharded; the step count is not.
    assert all(s == P("data") for s in jax.tree.leaves(specs.master))
    assert specs.inner[0].mu == jax.tree.map(lambda _: P("data"), params) and specs.inner[0].count == P()
    assert state.master["w1"].shape == (800,) and state.master["b1"].shape == (56,)  # padded to 8 blocks
    ref_state, ref_step = _replicated_trainer(optax.adam(1e-2), mesh, params)
    p, ref = params, params
    for _ in range(5):
        p, state, loss = step(p, state, x, y)
        ref, ref_state, ref_loss = ref_step(ref, ref_state, x, y)
    for k in params:
        np.testing.assert_allclose(p[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert int(state.skipped) == 0


def test_compressed_trains_and_replicas_agree():
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    four = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=0)
    opt = cgx_optax.sharded(optax.adam(1e-2), "data", grad_config=four, param_config=four.replace(bits=8))
    _, state, step = _sharded_trainer(opt, mesh, params)
    p, losses = params, []
    for _ in range(30):
        p, state, loss = step(p, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0]
    for k in p:  # out_specs=P() held under check_vma; the bits say the same
        shards = [np.asarray(s.data) for s in p[k].addressable_shards]
        for s in shards[1:]:
            assert_same_bits(s, shards[0], k)
    # The master copy is exact: the forward pass's 8-bit weights are within a bucket's half scale of it.
    master = np.asarray(state.master["w1"])[:800].reshape(16, 50)
    assert 0 < np.max(np.abs(np.asarray(p["w1"]) - master)) < 0.01 * np.max(np.abs(master))


def test_a_non_finite_step_is_skipped_everywhere():
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    opt = cgx_optax.sharded(optax.adam(1e-2), "data")
    _, state, step = _sharded_trainer(opt, mesh, params)
    p, state, _ = step(params, state, x, y)
    bad = np.asarray(x).copy()
    bad[0, 0] = np.inf  # one sample on device 0
    p2, state2, _ = step(p, state, jax.device_put(bad, NamedSharding(mesh, P("data"))), y)
    assert int(state2.skipped) == 1
    for a, b in zip(jax.tree.leaves((state2.master, state2.inner)), jax.tree.leaves((state.master, state.inner))):
        assert_same_bits(np.asarray(a), np.asarray(b), "state unchanged")
    for k in p:
        assert_same_bits(np.asarray(p2[k]), np.asarray(p[k]), k)
    p3, state3, _ = step(p2, state2, x, y)  # and training goes on
    assert int(state3.skipped) == 1 and np.all(np.isfinite(np.asarray(p3["w1"])))


def test_specs_need_a_mesh_axis():
    with pytest.raises(NameError):
        params, _, _ = _problem()
        cgx_optax.sharded(optax.adam(1e-2), "model").state_specs(params, device_mesh((W,), ("data",)))


def test_the_sharded_example_trains():
    # examples/train_sharded.py, a few steps of a small configuration, both ways.
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "examples"))
    import train_sharded

    small = ["--steps", "40", "--layers", "1", "--d-model", "32", "--log-every", "0", "--lr", "0.01"]
    sharded = train_sharded.run(train_sharded.parse_args(small))
    replicated = train_sharded.run(train_sharded.parse_args([*small, "--replicated"]))
    for result in (sharded, replicated):
        assert result["losses"][-1] < 0.85 * result["losses"][0] and np.isfinite(result["final_val_loss"])
    assert sharded["bytes_per_step"] < replicated["bytes_per_step"] / 1.5  # small leaves (< 1024 values) exact
    assert abs(sharded["final_val_loss"] - replicated["final_val_loss"]) < 0.1


def test_error_feedback_applies_the_true_gradients_up_to_one_residual():
    # A loss linear in the parameters: each step's true mean gradient is known. With SGD the
    # parameters move by lr times the applied means; with error feedback those add up to the true
    # means minus the last residual (summed over the devices, divided by W).
    mesh = device_mesh((W,), ("data",))
    n, steps, lr = 300, 12, 0.1
    rng = np.random.default_rng(3)
    batches = rng.standard_normal((steps, 4 * W, n)).astype(np.float32)
    two_bits = jax_cgx.CompressionConfig(bits=2, bucket_size=64, min_size=16)

    def loss(params, c):
        return jnp.mean(c @ params["w"])

    def train(error_feedback):
        opt = cgx_optax.sharded(optax.sgd(lr), "data", grad_config=two_bits, error_feedback=error_feedback)
        params = jax.device_put({"w": np.zeros(n, np.float32)}, NamedSharding(mesh, P()))
        specs = opt.state_specs(params, mesh)
        state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

        def local(params, state, c):
            grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), c)
            return opt.update(grads, state)

        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
        for c in batches:
            params, state = step(params, state, jax.device_put(c, NamedSharding(mesh, P("data"))))
        return np.asarray(state.master["w"])[:n].astype(np.float64), state

    true_sum = batches.astype(np.float64).mean(1).sum(0)  # sum over steps of the mean gradient
    with_ef, state = train(True)
    residual = np.asarray(state.residual["w"]).reshape(W, -1)[:, :n].astype(np.float64).sum(0)
    applied = -with_ef / lr
    np.testing.assert_allclose(applied + residual / W, true_sum, atol=1e-4)
    without, _ = train(False)
    assert np.max(np.abs(-without / lr - true_sum)) > 3 * np.max(np.abs(applied - true_sum))


def test_gradients_must_be_each_devices_own():
    # Without pcast, JAX hands every device the already summed gradient: W times the mean.
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    opt = cgx_optax.sharded(optax.sgd(0.1), "data")
    specs = opt.state_specs(params, mesh)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def local(params, state, x, y):
        return opt.update(jax.grad(_loss)(params, x, y), state)  # no pcast

    with pytest.raises(ValueError, match=r"needs each device's own gradient.*jax.lax.pcast\(params, 'data'"):
        jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                              out_specs=(P(), specs)))(params, state, x, y)


def test_bfloat16_parameters_keep_a_float32_master():
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), NamedSharding(mesh, P()))
    x, y = jax.device_put((x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)), NamedSharding(mesh, P("data")))
    opt = cgx_optax.sharded(optax.sgd(1e-4), "data")  # updates far below bfloat16's resolution of w1
    specs, state, step = _sharded_trainer(opt, mesh, params)
    assert state.master["w1"].dtype == jnp.float32
    start = np.asarray(state.master["w1"])
    p = params
    for _ in range(3):
        p, state, _ = step(p, state, x, y)
    assert p["w1"].dtype == jnp.bfloat16
    assert np.any(np.asarray(state.master["w1"]) != start)  # the master moved by what bfloat16 would round away


def test_the_readme_recipe_trains():
    # The user guide's "ZeRO: jax_cgx.optax.sharded" block as written (tests/runtime/test_readme.py runs it
    # too, in a fresh process), then more steps of its `step`: it trains, and the parameters it
    # returns, not updates, are bitwise the same on every device.
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    section = readme[readme.index("### ZeRO: `jax_cgx.optax.sharded`"):]
    code = re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1)
    scope = {}
    exec(compile(code, "docs/guide.md (ZeRO block)", "exec"), scope)
    step, params, state, x, y = (scope[k] for k in ("step", "params", "state", "x", "y"))
    first = float(scope["loss"])
    for _ in range(30):
        params, state, loss = step(params, state, x, y)
    assert float(loss) < 0.5 * first and int(state.skipped) == 0
    assert isinstance(state, cgx_optax.ShardedState)
    for k in params:
        shards = [np.asarray(s.data) for s in params[k].addressable_shards]
        for s in shards[1:]:
            assert_same_bits(s, shards[0], k)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_the_gradient_of_replicated_parameters_raises_naming_pcast(error_feedback):
    # Without pcast JAX has already summed the gradient over "data"; error feedback's per-device
    # residual must not hide that (it would type the sum varying, and the step would apply W times it).
    mesh = device_mesh((W,), ("data",))
    params, x, y = _problem()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    opt = cgx_optax.sharded(optax.sgd(0.1), "data", grad_config=jax_cgx.CompressionConfig(bits=4, min_size=16),
                            error_feedback=error_feedback)
    specs = opt.state_specs(params, mesh)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def local(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)  # no pcast: already summed over the devices
        return opt.update(grads, state)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs)))
    with pytest.raises(ValueError, match=r"pcast"):
        step(params, state, x, y)
