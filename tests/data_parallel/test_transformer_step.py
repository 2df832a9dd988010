"""A transformer training step in the shape of Flax's lm1b example through
jax_cgx.data_parallel_value_and_grad on 8 devices, against the unsharded float32 step: pre-LN
attention and MLP with dropout (a device key), a token-weighted cross-entropy over padded rows
(each device holding a different number of real tokens), the logits as aux (the whole batch's
rows), AdamW with a warm-up schedule, the mesh from jax.set_mesh. bits=32: equal to rounding;
8 bits: each compressed leaf within the bound its data gives (docs/algorithm.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from allreduce_cases import sra_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh
from model_axes_cases import assert_within_bound_per_shard

import jax_cgx

W, PER_DEVICE, LENGTH, VOCAB, DIM = 8, 2, 16, 64, 32
ROWS = W * PER_DEVICE
RATE = 0.1


def _init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, shape, scale: jax.random.normal(k, shape) * scale  # noqa: E731
    return {"embed": n(ks[0], (VOCAB, DIM), 0.5), "ln1": jnp.ones((DIM,)), "qkv": n(ks[1], (DIM, 3 * DIM), 0.2),
            "out": n(ks[2], (DIM, DIM), 0.2), "ln2": jnp.ones((DIM,)), "up": n(ks[3], (DIM, 4 * DIM), 0.2),
            "down": n(ks[4], (4 * DIM, DIM), 0.1), "head": n(ks[5], (DIM, VOCAB), 0.2)}


def _norm(x, scale):
    return scale * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)


def _dropout(rng, x):
    return jnp.where(jax.random.bernoulli(rng, 1 - RATE, x.shape), x / (1 - RATE), 0)


def _logits(params, tokens, rng, one_hot=False):
    r1, r2 = jax.random.split(rng)
    # one_hot: the lookup as a contraction (exact: one 1.0 per row), for the fsdp mesh below, where
    # jax 0.10.2's partitioner aborts on a gather inside a shard_map (docs/flax.md, "A sharded model").
    h = jax.nn.one_hot(tokens, VOCAB) @ params["embed"] if one_hot else params["embed"][tokens]
    q, k, v = jnp.split(_norm(h, params["ln1"]) @ params["qkv"], 3, axis=-1)
    causal = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), bool))
    attn = jax.nn.softmax(jnp.where(causal, q @ k.swapaxes(1, 2) / np.sqrt(DIM), -1e9), axis=-1)
    h = h + _dropout(r1, (attn @ v) @ params["out"])
    h = h + _dropout(r2, jax.nn.gelu(_norm(h, params["ln2"]) @ params["up"]) @ params["down"])
    return h @ params["head"]


def loss_fn(params, tokens, targets, weights, *, dropout_rng, one_hot=False):
    """lm1b's pair: the weighted cross-entropy's sum and its normalizer, and the logits as aux."""
    logits = _logits(params, tokens, dropout_rng, one_hot)
    if one_hot:  # the label's logit by a contraction too, not take_along_axis's gather
        losses = optax.softmax_cross_entropy(logits, jax.nn.one_hot(targets, VOCAB))
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (jnp.sum(losses * weights), jnp.sum(weights)), logits


def _batch(step):
    rng = np.random.default_rng(step)
    tokens = rng.integers(1, VOCAB, (ROWS, LENGTH))
    lengths = rng.integers(2, LENGTH + 1, ROWS)  # padded rows: every device holds another number of tokens
    weights = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.float32)
    targets = np.roll(tokens, -1, axis=1)
    return tokens, targets, weights


def _reference_grads(params, batch, key, groups=W, loss=loss_fn):
    """The unsharded step: one weighted mean over every row, data group d's rows masked by fold_in(key, d)."""
    per_group = ROWS // groups

    def total(p):
        sums, weights, logits = [], [], []
        for d in range(groups):
            rows = slice(d * per_group, (d + 1) * per_group)
            (s, w), lg = loss(p, *(np.asarray(b)[rows] for b in batch), dropout_rng=jax.random.fold_in(key, d))
            sums.append(s), weights.append(w), logits.append(lg)
        return sum(sums) / sum(weights), jnp.concatenate(logits)

    return jax.value_and_grad(total, has_aux=True)(params)


def _per_device_grads(params, batch, key, groups=W, loss=loss_fn):
    """Each data group's own gradient as the helper averages it: of its loss sum times groups / all weights."""
    overall = float(np.sum(batch[2]))
    per_group = ROWS // groups
    out = []
    for d in range(groups):
        rows = slice(d * per_group, (d + 1) * per_group)
        part = lambda p: loss(p, *(np.asarray(b)[rows] for b in batch),  # noqa: E731
                                 dropout_rng=jax.random.fold_in(key, d))[0][0] * groups / overall
        out.append(jax.grad(part)(params))
    return out


def _step_fn(config, param_specs=None, loss=loss_fn):
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss, config=config, has_aux=True, aux="batch", weighted=True,
                                                   device_keys=("dropout_rng",), param_specs=param_specs)
    optimizer = optax.adamw(optax.linear_schedule(0.0, 3e-3, 4), weight_decay=0.1)

    @jax.jit
    def step(params, opt_state, tokens, targets, weights, key):
        (loss, logits), grads = grad_fn(params, tokens, targets, weights, dropout_rng=key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, logits, grads

    return step, optimizer


def _placed(mesh, batch, spec=P("data")):
    return tuple(jax.device_put(jnp.asarray(b), NamedSharding(mesh, spec)) for b in batch)


def test_float32_equals_the_unsharded_step():
    mesh = jax.make_mesh((W,), ("data",))
    params = _init(jax.random.key(0))
    step, optimizer = _step_fn(jax_cgx.CompressionConfig(bits=32))
    ref_params, ref_state = params, optimizer.init(params)
    with jax.set_mesh(mesh):
        state = optimizer.init(params)
        for t in range(3):
            batch, key = _batch(t), jax.random.key(100 + t)
            params, state, loss, logits, grads = step(params, state, *_placed(mesh, batch), key)
            (want_loss, want_logits), want = _reference_grads(ref_params, batch, key)
            np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
            np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
            for k in want:
                np.testing.assert_allclose(grads[k], want[k], rtol=2e-4, atol=1e-7, err_msg=f"step {t}: {k}")
            updates, ref_state = optimizer.update(want, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
    for k in params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("leaf", ["up", "embed"])
def test_8_bits_within_the_bound_of_the_data(leaf):
    mesh = jax.make_mesh((W,), ("data",))
    params = _init(jax.random.key(1))
    config = jax_cgx.CompressionConfig(bits=8, bucket_size=128, min_size=16)
    # One leaf compressed (the bound is stated per buffer), the others exact.
    step, optimizer = _step_fn({k: config if k == leaf else None for k in params})
    batch, key = _batch(7), jax.random.key(7)
    with jax.set_mesh(mesh):
        *_, grads = step(params, optimizer.init(params), *_placed(mesh, batch), key)
    mine = np.stack([np.asarray(g[leaf]).reshape(-1) for g in _per_device_grads(params, batch, key)])
    err, bound = sra_bound(mine, np.asarray(grads[leaf]).reshape(-1) * W, config)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert np.any(err > 0)  # it was compressed
    _, want = _reference_grads(params, batch, key)
    for k in params:
        if k != leaf:
            np.testing.assert_allclose(grads[k], want[k], rtol=2e-4, atol=1e-7, err_msg=k)


# --- lm1b's mesh: ("data", "fsdp", "tensor") with its logical axis rules ------------------------
# lm1b (and MaxText) map logical axes to mesh axes: embed -> fsdp; mlp, heads, vocab -> tensor; the
# batch over (data, fsdp). Each parameter's PartitionSpec, as nn.logical_to_mesh_sharding gives it.
RULES = {"embed": "fsdp", "mlp": "tensor", "heads": "tensor", "vocab": "tensor"}
LOGICAL = {"embed": ("vocab", "embed"), "ln1": ("embed",), "qkv": ("embed", "heads"), "out": ("heads", "embed"),
           "ln2": ("embed",), "up": ("embed", "mlp"), "down": ("mlp", "embed"), "head": ("embed", "vocab")}
SPECS_3D = {k: P(*(RULES[a] for a in axes)) for k, axes in LOGICAL.items()}
GROUPS = 2  # the data axis: fsdp splits each data group's 8 rows further, exactly
LOSS_3D = functools.partial(loss_fn, one_hot=True)


def test_fsdp_and_tensor_axes_float32_equals_the_unsharded_step():
    mesh = device_mesh((GROUPS, 2, 2), ("data", "fsdp", "tensor"), jax.sharding.AxisType.Auto)
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS_3D[k])) for k, v in _init(jax.random.key(2)).items()}
    step, optimizer = _step_fn(jax_cgx.CompressionConfig(bits=32), param_specs=SPECS_3D, loss=LOSS_3D)
    batch, key = _batch(3), jax.random.key(103)
    with jax.set_mesh(mesh):
        *_, loss, logits, grads = step(params, optimizer.init(params), *_placed(mesh, batch, P(("data", "fsdp"))),
                                       key)
    (want_loss, want_logits), want = _reference_grads(jax.device_get(params), batch, key, GROUPS, LOSS_3D)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=2e-4, atol=1e-7, err_msg=k)
        assert grads[k].sharding.is_equivalent_to(NamedSharding(mesh, SPECS_3D[k]), grads[k].ndim), k


@pytest.mark.parametrize("leaf", ["up", "embed"])
def test_fsdp_and_tensor_axes_8_bits_within_the_bound_per_shard(leaf):
    mesh = device_mesh((GROUPS, 2, 2), ("data", "fsdp", "tensor"), jax.sharding.AxisType.Auto)
    params = _init(jax.random.key(4))
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS_3D[k])) for k, v in params.items()}
    config = jax_cgx.CompressionConfig(bits=8, bucket_size=128, min_size=16)
    step, optimizer = _step_fn({k: config if k == leaf else None for k in params}, param_specs=SPECS_3D,
                               loss=LOSS_3D)
    batch, key = _batch(8), jax.random.key(8)
    with jax.set_mesh(mesh):
        *_, grads = step(placed, optimizer.init(placed), *_placed(mesh, batch, P(("data", "fsdp"))), key)
    mine = _per_device_grads(params, batch, key, GROUPS, LOSS_3D)
    stacked = {leaf: np.stack([np.asarray(g[leaf]) for g in mine])}
    assert_within_bound_per_shard({leaf: grads[leaf]}, stacked, SPECS_3D, mesh, ("fsdp", "tensor"), GROUPS, config)
    assert grads[leaf].sharding.is_equivalent_to(NamedSharding(mesh, SPECS_3D[leaf]), grads[leaf].ndim)
    _, want = _reference_grads(params, batch, key, GROUPS, LOSS_3D)
    for k in params:
        if k != leaf:
            np.testing.assert_allclose(grads[k], want[k], rtol=2e-4, atol=1e-7, err_msg=k)
