"""jax_cgx.data_parallel_value_and_grad: a plain jax.jit step with compressed gradient averaging
(jax_cgx/_src/data_parallel/); and jax_cgx.optax reachable after ``import jax_cgx``."""

import functools
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import sra_bound
from bitwise import assert_same_bits
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx._src.data_parallel import buckets

W = 8
ROWS = 4 * W  # rows of the global batch
FOUR_BITS = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": rng.standard_normal((16, 64)).astype(np.float32) * 0.3,
              "b1": rng.standard_normal((64,)).astype(np.float32) * 0.1,
              "w2": rng.standard_normal((64, 4)).astype(np.float32) * 0.3}
    x = rng.standard_normal((ROWS, 16)).astype(np.float32)
    y = rng.standard_normal((ROWS, 4)).astype(np.float32)
    return params, x, y


def _placed(mesh, params, x, y):
    return (jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(x, NamedSharding(mesh, P("data"))),
            jax.device_put(y, NamedSharding(mesh, P("data"))))


def _shard_grads(params, x, y):
    """Each device's own gradient, stacked: [W, ...] per leaf."""
    xs, ys = x.reshape(W, -1, x.shape[1]), y.reshape(W, -1, y.shape[1])
    return jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(params, xs, ys)


def _assert_replicated(tree):
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.is_fully_replicated, leaf.sharding
        first = np.asarray(leaf.addressable_shards[0].data)
        for shard in leaf.addressable_shards[1:]:
            assert_same_bits(np.asarray(shard.data), first, f"device {shard.device}")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_bits32_is_value_and_grad_of_the_whole_batch(axis_type):
    mesh = device_mesh((W,), ("data",), axis_type)
    params, x, y = _placed(mesh, *_problem())
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=jax_cgx.CompressionConfig(bits=32))
    loss, grads = jax.jit(grad_fn)(params, x, y)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(*_problem())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k in ref_grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=2e-5, atol=1e-7, err_msg=k)
    _assert_replicated((loss, grads))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("bucket_mb", [None, 4.0, 0.001], ids=["after-backward", "one-bucket", "two-buckets"])
def test_compressed_is_the_shard_map_recipe_bitwise(axis_type, bucket_mb):
    # The helper is the README's recipe written once: pcast, value_and_grad, then compressed_pmean of
    # the whole tree (in_backward=False) or of each bucket (in backward, the default), with the
    # bucket's key fold_in(key, b). 0.001 MiB: w1 (4096 bytes) alone, then b1 and w2 (1280 bytes).
    mesh = device_mesh((W,), ("data",), axis_type)
    params, x, y = _placed(mesh, *_problem())
    key = jax.random.key(3)
    config = FOUR_BITS.replace(stochastic=True)
    in_backward = bucket_mb is not None
    options = {"in_backward": False} if not in_backward else {"bucket_mb": bucket_mb}
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=config, **options)
    leaves, treedef = jax.tree.flatten(params)
    nbytes = [leaf.nbytes for leaf in leaves]
    groups = buckets(nbytes, int(bucket_mb * 2**20)) if in_backward else None
    if bucket_mb == 0.001:
        assert groups == [(1,), (0, 2)]  # (b1, w1, w2): w1 alone, then b1 with w2

    @jax.jit
    def step(params, x, y, key):
        return grad_fn(params, x, y, key=key)

    def recipe(params, x, y, key):
        loss, grads = jax.value_and_grad(_loss)(jax.lax.pcast(params, "data", to="varying"), x, y)
        if not in_backward:
            return jax.lax.pmean(loss, "data"), jax_cgx.compressed_pmean(grads, "data", config, key=key)
        flat = treedef.flatten_up_to(grads)
        for b, members in enumerate(groups):
            mean = jax_cgx.compressed_pmean([flat[i] for i in members], "data", config,
                                            key=jax.random.fold_in(key, b))
            for i, m in zip(members, mean):
                flat[i] = m
        return jax.lax.pmean(loss, "data"), treedef.unflatten(flat)

    loss, grads = step(params, x, y, key)
    ref_loss, ref_grads = jax.jit(jax.shard_map(recipe, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                                                out_specs=P()))(params, x, y, key)
    assert_same_bits(np.asarray(loss), np.asarray(ref_loss), "loss")
    for k in grads:
        assert_same_bits(np.asarray(grads[k]), np.asarray(ref_grads[k]), k)
    _assert_replicated(grads)


def test_buckets_take_leaves_last_first():
    mib = 2**20
    # A model's layers (bias, weight) in tree order; backward produces the last layer first.
    sizes = [8, 16 * mib, 8, 16 * mib, 8, 2 * mib, 8, 3 * mib]
    # 3 MiB + 8 + 2 MiB fill one bucket; each 16 MiB weight is its own; the other biases end it.
    assert buckets(sizes, 4 * mib) == [(5, 6, 7), (3,), (1,), (0, 2, 4)]
    assert buckets(sizes, 64 * mib) == [tuple(range(8))]
    assert buckets([], 4 * mib) == []
    assert buckets([5 * mib], 4 * mib) == [(0,)]


def test_bucket_mb_is_checked():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "4"):
        with pytest.raises(ValueError, match="bucket_mb must be a positive number of MiB"):
            jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, bucket_mb=bad)


def test_compressed_gradient_within_the_bound():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    only_w1 = {"w1": FOUR_BITS, "b1": None, "w2": None}  # per-leaf configs: b1, w2 exact
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=only_w1)
    _, grads = grad_fn(*_placed(mesh, params, x, y))
    shards = _shard_grads(params, x, y)
    xs = np.asarray(shards["w1"]).reshape(W, -1)
    # W = 8: the mean times 8 is exactly the sum the bound is stated for (scales from the data).
    err, bound = sra_bound(xs, np.asarray(grads["w1"]).reshape(-1) * W, FOUR_BITS)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert np.any(err > 0)  # it was compressed
    for k in ("b1", "w2"):
        np.testing.assert_allclose(grads[k], np.asarray(shards[k]).mean(0), rtol=1e-5, atol=1e-7, err_msg=k)


def test_aux_is_averaged_like_the_loss():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()

    def loss_with_aux(params, x, y):
        loss = _loss(params, x, y)
        return loss, {"loss": loss, "rows": jnp.float32(x.shape[0])}

    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_with_aux, mesh=mesh, has_aux=True,
                                                   config=jax_cgx.CompressionConfig(bits=32))
    (loss, aux), grads = jax.jit(grad_fn)(*_placed(mesh, params, x, y))
    assert float(aux["rows"]) == ROWS // W  # each device's shard: the mean over devices of its rows
    np.testing.assert_allclose(aux["loss"], loss, rtol=1e-6)
    assert set(grads) == set(params)


def test_keyword_arguments_reach_fun_whole_and_undifferentiated():
    # On an Explicit mesh, where shard_map cannot close over a placed array: replicated, not split.
    mesh = device_mesh((W,), ("data",), AxisType.Explicit)
    placed = _placed(mesh, *_problem())
    rep = NamedSharding(mesh, P())

    def scaled(params, x, y, *, scale):
        return scale["by"] * _loss(params, x, y)

    grad_fn = jax.jit(jax_cgx.data_parallel_value_and_grad(scaled, mesh=mesh, config=jax_cgx.CompressionConfig(bits=32)))
    one = grad_fn(*placed, scale={"by": jax.device_put(jnp.float32(1), rep)})
    two = grad_fn(*placed, scale={"by": jax.device_put(jnp.float32(2), rep)})
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):  # times 2: exact in float32
        assert_same_bits(2 * np.asarray(a), np.asarray(b), "scaled")
    with pytest.raises(ValueError, match=r"scale\['by'\].*replicated"):
        grad_fn(*placed, scale={"by": jax.device_put(jnp.ones(W), NamedSharding(mesh, P("data")))})


def test_pytree_batch_and_errors():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    grad_fn = jax_cgx.data_parallel_value_and_grad(lambda p, batch: _loss(p, batch["x"], batch["y"]), mesh=mesh,
                                                   config=jax_cgx.CompressionConfig(bits=32))
    loss, _ = grad_fn(params, {"x": x, "y": y})
    np.testing.assert_allclose(loss, _loss(params, x, y), rtol=1e-6)
    with pytest.raises(ValueError, match=r"batch argument 0 \(`batch`\)\['x'\] has 12 rows, not divisible by the 8 devices"):
        grad_fn(params, {"x": x[:12], "y": y[:12]})
    with pytest.raises(ValueError, match=r"batch argument 0 \(`batch`\)\['y'\] is a scalar"):
        grad_fn(params, {"x": x, "y": 1.0})
    with pytest.raises(TypeError, match="needs at least one batch argument"):
        grad_fn(params)
    with pytest.raises(ValueError, match=r"axis 'batch' is not an axis of the mesh \(its axes: \('data',\)\)"):
        jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, axis_name="batch")
    with pytest.raises(TypeError, match="fun must be callable"):
        jax_cgx.data_parallel_value_and_grad(None, mesh=mesh)


def test_an_empty_batch_is_refused_by_name():
    # Before: NaN silently (or an error from inside XLA's partitioner).
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch argument 0 \(`x`\) has no rows: .* Skip empty batches"):
        grad_fn(params, x[:0], y[:0])


@pytest.mark.parametrize("in_backward", [True, False])
def test_integer_parameters_need_allow_int_and_get_float0(in_backward):
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    with_int = dict(params, steps=np.int32(3))

    def loss(p, x, y):
        return _loss(p, x, y) * p["steps"].astype(jnp.float32)

    exact = jax_cgx.CompressionConfig(bits=32)
    refused = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, in_backward=in_backward, config=exact)
    with pytest.raises(ValueError, match=r"params\['steps'\] is int32, which has no gradient: pass allow_int=True"):
        refused(with_int, x, y)
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, in_backward=in_backward, config=exact,
                                                   allow_int=True)
    value, grads = jax.jit(grad_fn)(*_placed(mesh, with_int, x, y))
    want_value, want = jax.value_and_grad(loss, allow_int=True)(with_int, x, y)
    assert grads["steps"].dtype == jax.dtypes.float0
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("in_backward", [True, False])
def test_a_config_function_is_resolved_once_and_each_leaf_keeps_its_own(in_backward):
    """config=f(path, leaf) runs once per leaf per trace (the tree is resolved where the paths are
    known; the buckets reduced in backward get the resolved configs as they are), and gives
    bitwise the gradients of the equal config pytree, an integer leaf in the same bucket."""
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    params = dict(params, steps=np.int32(3))
    own = {"w1": FOUR_BITS, "b1": None, "w2": jax_cgx.CompressionConfig(bits=8, bucket_size=32, min_size=16),
           "steps": None}
    calls = []

    def config(path, leaf):
        calls.append(jax.tree_util.keystr(path))
        return own[path[0].key]

    def grads(config):
        grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, in_backward=in_backward, config=config,
                                                       allow_int=True)
        return jax.jit(grad_fn)(*_placed(mesh, params, x, y))[1]

    by_function, by_tree = grads(config), grads(own)
    assert sorted(calls) == sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    for k in ("w1", "b1", "w2"):
        assert_same_bits(by_function[k], by_tree[k], k)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_explicit_mesh_errors_name_the_argument_and_the_fix(jit):
    # jax.make_mesh's default axes are Explicit, where shard_map refuses an argument whose type has
    # another sharding than its in_specs; the error must speak of the caller's argument, not of
    # jax_cgx's shard_map, and its fix must work as written.
    mesh = jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])
    assert mesh.axis_types == (AxisType.Explicit,)
    params, x, y = _problem()
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=FOUR_BITS)
    call = jax.jit(grad_fn) if jit else grad_fn
    placed_params, placed_x, placed_y = _placed(mesh, params, x, y)
    with pytest.raises(ValueError, match=re.escape(
            "batch argument 0 (`x`) is float32[32,16] with sharding P(None, None); it must be split along its "
            "leading dimension over 'data', and along no other. Place it first (in or outside jit): "
            "jax.device_put(x, NamedSharding(mesh, P('data')))")):
        call(placed_params, x, placed_y)
    sideways = jax.device_put(y, NamedSharding(mesh, P(None, None)))
    with pytest.raises(ValueError, match=re.escape("batch argument 1 (`y`) is float32[32,4] with sharding P(None, None)")):
        call(placed_params, placed_x, sideways)
    split_w1 = dict(placed_params, w1=jax.device_put(params["w1"], NamedSharding(mesh, P("data"))))
    with pytest.raises(ValueError, match=re.escape(
            "params['w1'] is float32[16@data,64] with sharding P('data', None); it must be replicated over 'data'")):
        call(split_w1, placed_x, placed_y)
    # The fix as the message writes it, and the same call on an Auto mesh, give the same bits.
    fixed = call(placed_params, jax.device_put(x, NamedSharding(mesh, P("data"))), placed_y)
    auto = device_mesh((W,), ("data",), AxisType.Auto)
    grad_auto = jax_cgx.data_parallel_value_and_grad(_loss, mesh=auto, config=FOUR_BITS)
    want = (jax.jit(grad_auto) if jit else grad_auto)(params, x, y)
    for got, ref in zip(jax.tree.leaves(fixed), jax.tree.leaves(want)):
        assert_same_bits(np.asarray(got), np.asarray(ref), "explicit mesh, placed vs auto mesh")


def test_optax_subpackage_after_import_jax_cgx():
    code = ("import sys, jax_cgx; assert 'jax_cgx.optax' not in sys.modules; "
            "t = jax_cgx.optax.compressed_mean; assert 'jax_cgx.optax' in sys.modules; "
            "assert 'optax' in dir(jax_cgx); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    with pytest.raises(AttributeError, match="module 'jax_cgx' has no attribute 'nonexistent'"):
        jax_cgx.nonexistent  # noqa: B018


def test_flax_linen_and_equinox_parameters():
    # docs/flax.md's recipes: a linen params dict, and Equinox's partition (None where static).
    linen = pytest.importorskip("flax.linen")
    eqx = pytest.importorskip("equinox")
    import optax

    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    _, x, y = _problem()
    labels = (np.abs(y[:, 0]) * 3).astype(np.int32) % 4
    exact = jax_cgx.CompressionConfig(bits=32)

    model = linen.Sequential([linen.Dense(32), linen.relu, linen.Dense(4)])
    variables = model.init(jax.random.key(0), x[:1])

    def linen_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()

    loss, grads = jax_cgx.data_parallel_value_and_grad(linen_loss, mesh=mesh, config=exact)(
        variables["params"], x, labels)
    ref_loss, ref = jax.value_and_grad(linen_loss)(variables["params"], x, labels)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads, ref)

    mlp = eqx.nn.MLP(16, 4, 32, depth=2, key=jax.random.key(1))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    def eqx_loss(params, x, y):
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax_cgx.data_parallel_value_and_grad(eqx_loss, mesh=mesh, config=FOUR_BITS)(params, x, labels)
    ref_loss, ref = jax.value_and_grad(eqx_loss)(params, x, labels)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref)  # the Nones where the static parts were
    # The weight matrices went through the 4-bit exchange (their bound: the tests above).
    assert any(np.any(np.asarray(g) != r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)) if r.size >= 512)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_other_mesh_axes_stay_with_the_partitioner(axis_type):
    # A ("data", "model") mesh: only "data" is mapped by hand; the result is still the full-batch gradient.
    # With Explicit axes too: with another axis left to the partitioner, shard_map converts the
    # batch's sharding itself, so no argument is refused there.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=jax.devices()[:W])
    params, x, y = _problem()
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=jax_cgx.CompressionConfig(bits=32))
    loss, grads = jax.jit(grad_fn)(params, x, y)
    ref_loss, ref = jax.value_and_grad(_loss)(params, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k in ref:
        np.testing.assert_allclose(grads[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=k)


# --- what a transformer's step returns and takes (issue 47) ---------------------------------------

def test_the_mesh_comes_from_the_context():
    mesh = device_mesh((W,), ("data",), AxisType.Explicit)
    params, x, y = _placed(mesh, *_problem())
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, config=jax_cgx.CompressionConfig(bits=32))
    with pytest.raises(ValueError, match=r"no mesh: pass mesh=, or call grad_fn inside `with jax.set_mesh\(mesh\):`"):
        grad_fn(params, x, y)
    want = jax.jit(jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=jax_cgx.CompressionConfig(bits=32)))(
        params, x, y)
    with jax.set_mesh(mesh):
        got = jax.jit(grad_fn)(params, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:`, jax's older form: still honored
        with mesh:
            legacy = jax.jit(grad_fn)(params, x, y)
    for tree in (got, legacy):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
            assert_same_bits(np.asarray(a), np.asarray(b))


def _logits_loss(params, x, y):
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((logits - y) ** 2), {"logits": logits, "rows": jnp.float32(x.shape[0])}


@pytest.mark.parametrize("mode", ["mean", "sum", "batch", "per_device"])
def test_aux_modes(mode, caplog):
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    grad_fn = jax_cgx.data_parallel_value_and_grad(_logits_loss, mesh=mesh, has_aux=True, aux=mode,
                                                   config=jax_cgx.CompressionConfig(bits=32))
    if mode == "batch":  # every aux leaf must have the device's rows first
        with pytest.raises(ValueError, match=r"aux='batch', but aux\['rows'\] is a scalar"):
            grad_fn(params, x, y)
        grad_fn = jax_cgx.data_parallel_value_and_grad(lambda p, x, y: (_logits_loss(p, x, y)[0],
                                                                       _logits_loss(p, x, y)[1]["logits"]),
                                                       mesh=mesh, has_aux=True, aux=mode,
                                                       config=jax_cgx.CompressionConfig(bits=32))
    with caplog.at_level("WARNING", logger="jax_cgx"):
        (loss, extra), _ = grad_fn(params, x, y)
    logits = np.asarray(_logits_loss(params, x, y)[1]["logits"])
    shards = logits.reshape(W, -1, logits.shape[-1])
    if mode == "batch":
        np.testing.assert_allclose(extra, logits, rtol=1e-5, atol=1e-6)  # the whole batch's rows, as unsharded
        assert extra.sharding.spec[0] == "data"
    elif mode == "per_device":
        np.testing.assert_allclose(extra["logits"], shards, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(extra["rows"], np.full(W, ROWS // W))
    elif mode == "sum":
        assert float(extra["rows"]) == ROWS
    else:
        np.testing.assert_allclose(extra["logits"], shards.mean(0), rtol=1e-5)
        assert "aux['logits'] has the device's 4 rows first; aux='mean' averages it" in caplog.text
    with pytest.raises(ValueError, match="aux must be one of"):
        jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, aux="gather")


def _weighted_loss(params, x, y, weights):
    per_row = jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2, axis=-1)
    return jnp.sum(per_row * weights), jnp.sum(weights)


@pytest.mark.parametrize("in_backward", [True, False])
def test_a_weighted_loss_is_the_unsharded_weighted_mean(in_backward):
    # Each device holds a different number of real (weight 1) rows: the mean of the devices' means
    # is not the batch's weighted mean; weighted=True gives the latter, as one unsharded step would.
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    per_device = ROWS // W
    real = np.arange(W) % per_device + 1  # device d holds d % 4 + 1 real rows, the rest padding
    weights = (np.arange(per_device)[None, :] < real[:, None]).astype(np.float32).reshape(ROWS)
    def unsharded(p):
        total, weight = _weighted_loss(p, x, y, weights)
        return total / weight
    want_loss, want = jax.value_and_grad(unsharded)(params)
    grad_fn = jax_cgx.data_parallel_value_and_grad(_weighted_loss, mesh=mesh, weighted=True, in_backward=in_backward,
                                                   config=jax_cgx.CompressionConfig(bits=32))
    loss, grads = grad_fn(params, x, y, weights)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    naive = jax_cgx.data_parallel_value_and_grad(lambda p, x, y, w: jnp.divide(*_weighted_loss(p, x, y, w)),
                                                 mesh=mesh, config=jax_cgx.CompressionConfig(bits=32))
    assert abs(float(naive(params, x, y, weights)[0]) - float(want_loss)) > 1e-3  # what weighted=True fixes


def _dropout_loss(params, x, y, *, rng):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(rng, 0.5, h.shape)
    return jnp.mean(((h * keep) @ params["w2"] - y) ** 2)


def test_device_keys_draw_a_mask_per_device_and_undeclared_keys_are_refused():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    key = jax.random.key(5)
    exact = jax_cgx.CompressionConfig(bits=32)
    with pytest.raises(ValueError, match=r"keyword argument rng is a PRNG key: every device would draw the same "
                                         r"random numbers .* device_keys=\('rng',\)"):
        jax_cgx.data_parallel_value_and_grad(_dropout_loss, mesh=mesh, config=exact)(params, x, y, rng=key)
    with pytest.raises(ValueError, match="device_keys names 'dropout'"):
        jax_cgx.data_parallel_value_and_grad(_dropout_loss, mesh=mesh, device_keys="dropout")(params, x, y, rng=key)
    grad_fn = jax_cgx.data_parallel_value_and_grad(_dropout_loss, mesh=mesh, device_keys=("rng",), config=exact)
    loss, grads = grad_fn(params, x, y, rng=key)
    # The unsharded step with device d's rows masked by fold_in(key, d): the same loss and gradient.
    xs, ys = x.reshape(W, -1, x.shape[1]), y.reshape(W, -1, y.shape[1])

    def reference(p):
        return jnp.mean(jnp.stack([_dropout_loss(p, xs[d], ys[d], rng=jax.random.fold_in(key, d)) for d in range(W)]))

    want_loss, want = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    shared = jax_cgx.data_parallel_value_and_grad(_dropout_loss, mesh=mesh, shared_keys=("rng",), config=exact)
    assert float(shared(params, x, y, rng=key)[0]) != float(loss)  # one mask for every device: another loss
    raw = jax.random.PRNGKey(5)  # a raw uint32[2] key is a key too
    with pytest.raises(ValueError, match="is a PRNG key"):
        jax_cgx.data_parallel_value_and_grad(_dropout_loss, mesh=mesh, config=exact)(params, x, y, rng=raw)


_MODULE_POSITIONS = np.arange(32, dtype=np.float32)[:, None]  # a module-level per-row array, read by a loss


def _loss_reading_a_module_level_array(p, x, y):
    return _loss(p, x + _MODULE_POSITIONS, y)


def test_a_module_level_per_row_array_is_refused_by_name():
    # It used to fail with a broadcasting error from inside the step (each device has 32 // 8 rows).
    assert ROWS == len(_MODULE_POSITIONS)
    with pytest.raises(ValueError, match=r"fun reads the module-level `_MODULE_POSITIONS` \(float32\[32, 1\]\), "
                                         r"whose leading dimension is the batch's 32 rows"):
        jax_cgx.data_parallel_value_and_grad(_loss_reading_a_module_level_array,
                                             mesh=device_mesh((W,), ("data",), AxisType.Auto))(*_problem())


def test_a_loss_closing_over_a_module_runs():
    # A loss made where jax.numpy was imported locally closes over the module, whose `shape` is a
    # function: the closure check used to fail on it with a TypeError (a Ray actor's pickled loss).
    import jax.numpy as local_jnp

    def loss_fn(p, x, y):
        return local_jnp.mean((local_jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    loss, _ = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh)(*_problem())
    assert np.isfinite(float(loss))


def test_a_closed_over_per_row_array_is_refused_by_name():
    mesh = device_mesh((W,), ("data",), AxisType.Auto)
    params, x, y = _problem()
    positions = np.arange(ROWS, dtype=np.float32)[:, None]

    def loss_fn(p, x, y):
        return _loss(p, x + positions, y)

    with pytest.raises(ValueError, match=r"fun closes over `positions` \(float32\[32, 1\]\), whose leading dimension "
                                         r"is the batch's 32 rows: .* Pass per-row arrays .* as batch arguments"):
        jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh)(params, x, y)
    with pytest.raises(ValueError, match=r"functools.partial keyword 'positions'"):
        jax_cgx.data_parallel_value_and_grad(functools.partial(lambda p, x, y, positions: _loss(p, x + positions, y),
                                                               positions=positions), mesh=mesh)(params, x, y)
