"""reduce_in_backward: gradients bitwise those of compressed_pmean applied after jax.grad, for the
whole tree or layer by layer, under shard_map (check_vma on and off) and pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import sra_window_bound
from bitwise import assert_same_bits
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_cgx

W = 8
CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=128, min_size=0)


def _params():
    rng = np.random.default_rng(0)
    shapes = [(64, 96), (96,), (96, 10), (10,)]
    leaves = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in shapes]
    return [{"w": leaves[0], "b": leaves[1]}, {"w": leaves[2], "b": leaves[3]}]


def _batch():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((W, 16, 64)), jnp.float32),
            jnp.asarray(rng.integers(0, 10, (W, 16)), jnp.int32))


def _loss(params, x, y, mark=lambda i, layer: layer):
    for i, layer in enumerate(params):
        layer = mark(i, layer)
        x = x @ layer["w"] + layer["b"]
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x), y[:, None], axis=1))


def _shard_map(body, check_vma=True):
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P(),
                                 check_vma=check_vma))


def _after_grad(per_layer: bool, key=None, config=CONFIG):
    """compressed_pmean applied to jax.grad's result (the whole tree, or each layer on its own)."""

    def body(params, x, y):
        mine = lax.pcast(params, "d", to="varying")
        grads = jax.grad(_loss)(mine, x[0], y[0])
        if not per_layer:
            return jax_cgx.compressed_pmean(grads, "d", config, key=key)
        return [jax_cgx.compressed_pmean(g, "d", config, key=None if key is None else jax.random.fold_in(key, i))
                for i, g in enumerate(grads)]

    return body


def _in_backward(per_layer: bool, key=None, config=CONFIG):
    def body(params, x, y):
        if per_layer:
            mark = lambda i, layer: jax_cgx.reduce_in_backward(  # noqa: E731
                layer, "d", config, key=None if key is None else jax.random.fold_in(key, i))
            return jax.grad(_loss)(params, x[0], y[0], mark)
        return jax.grad(lambda p: _loss(jax_cgx.reduce_in_backward(p, "d", config, key=key), x[0], y[0]))(params)

    return body


def _same(a, b):
    """The same tree (structure, every leaf: a missing or extra leaf fails) with the same bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        assert_same_bits(np.asarray(u), np.asarray(v), jax.tree_util.keystr(path))


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole-tree", "per-layer"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_gradients_bitwise_compressed_pmean(per_layer, stochastic):
    key = jax.random.key(3) if stochastic else None
    config = CONFIG.replace(stochastic=stochastic)
    params, (x, y) = _params(), _batch()
    expected = _shard_map(_after_grad(per_layer, key, config))(params, x, y)
    got = _shard_map(_in_backward(per_layer, key, config))(params, x, y)
    _same(got, expected)
    # Within SRA's bound of every rank's own gradient, scales from those gradients (was: atol 0.05):
    # the leaves, in tree order, are one stream (per layer: consecutive pieces of it), so each
    # bucket lies within the 2B-1 values around an element. The mean times W = 8 is the sum, exactly.
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    per_rank = jax.jit(jax.shard_map(
        lambda p, x, y: jax.tree.map(lambda g: g[None], jax.grad(_loss)(lax.pcast(p, "d", to="varying"), x[0], y[0])),
        mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P("d")))(params, x, y)
    stream = np.concatenate([np.asarray(g).reshape(W, -1) for g in jax.tree.leaves(per_rank)], axis=1)
    summed = np.concatenate([np.asarray(g).reshape(-1) for g in jax.tree.leaves(got)]) * W
    err, bound = sra_window_bound(stream, summed, config)
    assert np.all(err <= bound), float(np.max(err - bound))


def test_without_check_vma():
    params, (x, y) = _params(), _batch()
    _same(_shard_map(_in_backward(True), check_vma=False)(params, x, y),
          _shard_map(_after_grad(True), check_vma=False)(params, x, y))


def test_already_varying_parameters():
    params, (x, y) = _params(), _batch()

    def body(params, x, y):
        mine = lax.pcast(params, "d", to="varying")
        grads = jax.grad(lambda p: _loss(jax_cgx.reduce_in_backward(p, "d", CONFIG), x[0], y[0]))(mine)
        return jax.tree.map(lambda g: lax.pmax(g, "d"), grads)  # varying in, varying out: make it invariant

    _same(_shard_map(body)(params, x, y), _shard_map(_after_grad(False))(params, x, y))


def test_pmap():
    params, (x, y) = _params(), _batch()
    body = jax.pmap(lambda p, x, y: jax.grad(lambda q: _loss(jax_cgx.reduce_in_backward(q, "d", CONFIG), x, y))(p),
                    axis_name="d", in_axes=(None, 0, 0), devices=jax.devices()[:W])
    got = body(params, x, y)
    expected = jax.pmap(lambda p, x, y: jax_cgx.compressed_pmean(jax.grad(_loss)(p, x, y), "d", CONFIG),
                        axis_name="d", in_axes=(None, 0, 0), devices=jax.devices()[:W])(params, x, y)
    _same(jax.tree.map(lambda v: v[0], got), jax.tree.map(lambda v: v[0], expected))


def test_forward_is_the_identity_and_errors_are_clear():
    params = _params()
    out = _shard_map(lambda p, x, y: jax_cgx.reduce_in_backward(p, "d", CONFIG), check_vma=False)(params, *_batch())
    _same(out, params)
    with pytest.raises(NameError, match="reduce_in_backward: axis name 'nope' is not bound"):
        jax_cgx.reduce_in_backward(params, "nope", CONFIG)
    with pytest.raises(TypeError, match="reduce_in_backward: key must be a PRNG key"):
        _shard_map(lambda p, x, y: jax_cgx.reduce_in_backward(p, "d", CONFIG, key=3))(params, *_batch())


@pytest.mark.parametrize("check_vma", [True, False])
def test_integer_leaves_of_a_marked_subtree_pass_through(check_vma):
    """A marked layer state with a step counter: the counter has no gradient (a float0 cotangent,
    nothing to reduce); the float leaves' gradients are those of compressed_pmean, bitwise."""
    xs = jax.random.normal(jax.random.key(0), (W, 64))
    w = jnp.linspace(-1.0, 1.0, 64)

    def loss(weights, x, marked: bool):
        layer = {"w": weights, "step": jnp.array(3, jnp.int32)}
        if marked:
            layer = jax_cgx.reduce_in_backward(layer, "d", CONFIG)
        return jnp.sum(jnp.tanh(x * layer["w"])) * layer["step"]

    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))

    def run(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(),
                                     check_vma=check_vma))(w, xs)

    got = run(lambda w, x: jax.grad(loss)(w, x[0], True))
    want = run(lambda w, x: jax_cgx.compressed_pmean(jax.grad(loss)(lax.pcast(w, "d", to="varying"), x[0], False),
                                                     "d", CONFIG))
    assert_same_bits(got, want)
