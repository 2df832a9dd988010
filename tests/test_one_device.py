"""A mesh of one device, where users try a library first (a laptop, one GPU) and where tests of
training code run: every public collective, the jit helper and the optax transformations work
there as lax's do, moving nothing (issue 58)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_same_bits
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx

CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32))


@pytest.mark.parametrize("name, ours, theirs, out", [
    ("psum", lambda v: jax_cgx.compressed_psum(v, "data", CONFIG), lambda v: lax.psum(v, "data"), P()),
    ("pmean", lambda v: jax_cgx.compressed_pmean(v, "data", CONFIG), lambda v: lax.pmean(v, "data"), P()),
    ("psum residual", lambda v: jax_cgx.compressed_psum(v, "data", CONFIG, return_residual=True)[0],
     lambda v: lax.psum(v, "data"), P()),
    ("psum_scatter", lambda v: jax_cgx.compressed_psum_scatter(v, "data", CONFIG, tiled=True),
     lambda v: lax.psum_scatter(v, "data", tiled=True), P("data")),
    ("all_gather", lambda v: jax_cgx.compressed_all_gather(v, "data", CONFIG, tiled=True),
     lambda v: lax.all_gather(v, "data", tiled=True), P("data")),
])
def test_every_collective_is_lax_on_one_device(name, ours, theirs, out):
    mesh = device_mesh((1,), ("data",))
    x = jax.device_put(_x(), NamedSharding(mesh, P("data")))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=out))(x)  # noqa: E731
    assert_same_bits(np.asarray(run(ours)), np.asarray(run(theirs)), name)


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_backward", "after"])
def test_the_jit_helper_is_value_and_grad_on_one_device(in_backward):
    mesh = device_mesh((1,), ("data",))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32))
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, config=CONFIG, in_backward=in_backward)
    value, grad = jax.jit(grad_fn)(jax.device_put(w, NamedSharding(mesh, P())),
                                   jax.device_put(x, NamedSharding(mesh, P("data"))))
    want_value, want = jax.jit(jax.value_and_grad(loss))(w, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("make, exact", [
    (lambda: jax_cgx.optax.compressed_mean("data", CONFIG, layer_min_size=1, error_feedback=True), "bits"),
    (lambda: jax_cgx.optax.cast_mean("data"), "bfloat16"),  # to bfloat16 and back: within its rounding
    (lambda: jax_cgx.optax.topk_mean("data", 1.0, momentum=0.0, min_size=1), "bits"),
    (lambda: jax_cgx.optax.powersgd_mean("data", rank=2), "finite"),  # a rank-2 approximation
], ids=["compressed_mean", "cast_mean", "topk_mean", "powersgd_mean"])
def test_optax_transformations_on_one_device(make, exact):
    mesh = device_mesh((1,), ("data",))
    tx = make()
    params = {"w": jnp.asarray(np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32))}
    grads = {"w": jnp.asarray(np.random.default_rng(4).standard_normal((32, 64)).astype(np.float32))}
    specs = jax_cgx.optax.state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def update(grads, state, params):
        return tx.update(lax.pcast(grads, "data", to="varying"), state, params)

    step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)))
    updates, state = step(grads, state, params)
    if exact == "bits":  # one device's mean is its gradient
        assert_same_bits(np.asarray(updates["w"]), np.asarray(grads["w"]))
    elif exact == "bfloat16":
        np.testing.assert_allclose(updates["w"], grads["w"], rtol=2**-8)
    else:
        assert np.all(np.isfinite(np.asarray(updates["w"])))


def test_the_sharded_optimizer_on_one_device():
    mesh = device_mesh((1,), ("data",))
    opt = jax_cgx.optax.sharded(optax.sgd(0.1), "data", grad_config=CONFIG)
    params = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32))}
    grads = {"w": jnp.ones((32, 64), jnp.float32)}
    specs = opt.state_specs(params, mesh)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(jax.shard_map(lambda g, s: opt.update(lax.pcast(g, "data", to="varying"), s), mesh=mesh,
                                 in_specs=(P(), specs), out_specs=(P(), specs)))
    new, _ = step(grads, state)
    np.testing.assert_allclose(new["w"], params["w"] - 0.1, rtol=1e-6)
