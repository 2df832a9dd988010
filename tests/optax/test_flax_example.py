"""examples/train_flax.py: a Flax NNX model trained both ways, in-process on 8 devices; and
examples/train_flax_cnn.py: docs/flax.md's NNX recipe with BatchNorm, Dropout, metrics and nnx.Optimizer."""

import functools
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from allreduce_cases import sra_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx

pytest.importorskip("flax")
pytest.importorskip("sklearn")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

import train_flax  # noqa: E402
import train_flax_cnn  # noqa: E402
from flax import nnx  # noqa: E402
from meshes import device_mesh

COMMON = ["--devices", "8", "--steps", "30", "--batch", "128", "--log-every", "0"]


def _run(*flags) -> dict:
    return train_flax.run(train_flax.parse_args([*COMMON, *flags]))


def test_the_two_ways_are_the_same_mean():
    # data_parallel_value_and_grad with layer_filter(config, 1024) in a jit step, and
    # compressed_mean (whose layer filter that is) in a shard_map step: the same gradients, so the
    # same training, to the bit.
    jit, via_optax = _run("--way", "jit"), _run("--way", "optax")
    assert jit["losses"] == via_optax["losses"]
    assert jit["losses"][-1] < 0.3 * jit["losses"][0] and jit["final_accuracy"] > 85


def test_error_feedback_trains():
    # The residuals are per device: state sharded over the mesh in the shard_map step.
    result = _run("--way", "optax", "--error-feedback")
    assert result["losses"][-1] < 0.3 * result["losses"][0] and result["final_accuracy"] > 85
    assert result["losses"][1:] != _run("--way", "optax")["losses"][1:]  # the residual is added back


def test_error_feedback_needs_the_optax_way():
    with pytest.raises(SystemExit):
        train_flax.parse_args(["--error-feedback"])


# examples/train_flax_cnn.py: docs/flax.md's recipe with BatchNorm, Dropout, metrics and nnx.Optimizer.

W = 8
ROWS = 8 * W  # the global batch of the gradient checks


@pytest.fixture(scope="module")
def digits():
    x, y, _, _ = train_flax_cnn.load_data()
    return x[:ROWS].reshape(ROWS, 8, 8), y[:ROWS]


def _split(dropout, sync):
    model = train_flax_cnn.CNN(dropout=dropout, sync_batch_stats=sync, rngs=nnx.Rngs(0))
    return nnx.split(model, nnx.Param, nnx.BatchStat)


def _data_parallel(graphdef, bits):
    """The recipe's gradient, jitted: ``f(params, batch_stats, x, y, key) -> ((loss, aux), grads)``."""
    mesh = device_mesh((W,), (train_flax_cnn.AXIS,))
    grad_fn = jax_cgx.data_parallel_value_and_grad(
        train_flax_cnn.make_loss_fn(graphdef), mesh=mesh, axis_name=train_flax_cnn.AXIS,
        config=train_flax_cnn.compression(bits, 128), has_aux=True, aux=("mean", "batch"),
        device_keys=("dropout_key",))

    def place(params, batch_stats, x, y, key):
        rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(train_flax_cnn.AXIS))
        return (jax.device_put(params, rep), jax.device_put(batch_stats, rep), jax.device_put(x, split),
                jax.device_put(y, split), jax.device_put(key, rep))

    run = jax.jit(lambda p, s, x, y, k: grad_fn(p, x, y, batch_stats=s, dropout_key=k))
    return lambda *args: run(*place(*args))


def _per_device(graphdef, params, batch_stats, x, y, key):
    """Each device's ((loss, aux), grads), stacked, from ``jax.vmap`` over a device axis: the same
    loss, collectives and keys with no shard_map and no jax_cgx."""
    loss_fn = train_flax_cnn.make_loss_fn(graphdef)

    def one(x, y):
        def loss(p):  # the statistics rebuilt in this trace, where BatchNorm writes them
            mine = jax.random.fold_in(key, jax.lax.axis_index(train_flax_cnn.AXIS))  # what device_keys does
            return loss_fn(p, x, y, batch_stats=jax.tree.map(lambda v: v, batch_stats), dropout_key=mine)
        return jax.value_and_grad(loss, has_aux=True)(params)

    return jax.jit(jax.vmap(one, axis_name=train_flax_cnn.AXIS))(x.reshape(W, -1, 8, 8), y.reshape(W, -1))


def _relative(a, b) -> float:
    a, b = jnp.concatenate([v.ravel() for v in jax.tree.leaves(a)]), jnp.concatenate([v.ravel() for v in jax.tree.leaves(b)])
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_cnn_recipe_trains():
    result = train_flax_cnn.run(train_flax_cnn.parse_args(["--steps", "40", "--log-every", "0"]))
    losses = result["losses"]
    assert np.mean(losses[-5:]) < 0.4 * np.mean(losses[:5]), losses
    assert result["test_accuracy"] > 80, result["test_accuracy"]


def test_bits32_with_averaged_batch_stats_is_the_reference(digits):
    # BatchNorm over the whole batch (sync_batch_stats) and dropout on: at bits=32 the recipe's
    # loss, gradient, running statistics and logits are the vmap reference's, to float32 rounding.
    x, y = digits
    key = jax.random.key(1)
    graphdef, params, batch_stats = _split(dropout=0.5, sync=True)
    (loss, (stats, logits)), grads = _data_parallel(graphdef, 32)(params, batch_stats, x, y, key)
    (ref_loss, (ref_stats, ref_logits)), ref_grads = _per_device(graphdef, params, batch_stats, x, y, key)
    mean = functools.partial(jax.tree.map, lambda v: v.mean(0))
    assert _relative(grads, mean(ref_grads)) < 1e-5
    assert _relative(stats, mean(ref_stats)) < 1e-5
    np.testing.assert_allclose(loss, ref_loss.mean(), rtol=1e-6)
    np.testing.assert_allclose(logits, ref_logits.reshape(logits.shape), rtol=1e-5, atol=1e-5)  # the batch's rows
    assert _relative(stats, batch_stats) > 1e-3  # the step moved them (momentum 0.99: by 1%)


def test_dropout_masks_differ_between_devices(digits):
    # Every device given the same rows: with sync_batch_stats only dropout can tell them apart,
    # and each device's mask is its own (the key folded with its index).
    x, y = digits
    x, y = np.tile(x[:ROWS // W], (W, 1, 1)), np.tile(y[:ROWS // W], W)
    for dropout in (0.5, 0.0):
        graphdef, params, batch_stats = _split(dropout=dropout, sync=True)
        (_, (_, logits)), _ = _data_parallel(graphdef, 32)(params, batch_stats, x, y, jax.random.key(1))
        blocks = np.asarray(logits).reshape(W, -1)
        differ = [not np.array_equal(blocks[i], blocks[j]) for i in range(W) for j in range(i)]
        assert all(differ) if dropout else not any(differ), dropout


def test_bits32_is_the_whole_batch_only_with_averaged_batch_stats(digits):
    # README's "bits=32 gives jax.value_and_grad of the whole batch": true for BatchNorm over the
    # whole batch; with each device's own statistics (the default) another gradient.
    x, y = digits
    graphdef, params, batch_stats = _split(dropout=0.0, sync=False)  # axis_name None: runs outside a map

    def whole(params):
        model = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, batch_stats))
        return optax.softmax_cross_entropy_with_integer_labels(model(jnp.asarray(x)), y).mean()

    exact = jax.jit(jax.grad(whole))(params)
    for sync, bound in ((True, 1e-5), (False, None)):
        graphdef, params, batch_stats = _split(dropout=0.0, sync=sync)
        _, grads = _data_parallel(graphdef, 32)(params, batch_stats, x, y, jax.random.key(1))
        difference = _relative(grads, exact)
        assert difference < bound if sync else difference > 1e-2, (sync, difference)


def test_compressed_gradient_within_the_bound(digits):
    # bits=4: layer_filter compresses the one leaf of at least 1024 values, the dense kernel, alone
    # in its buffer; the error bound of docs/algorithm.md from each device's own gradient. Others exact.
    x, y = digits
    key = jax.random.key(1)
    graphdef, params, batch_stats = _split(dropout=0.5, sync=False)
    _, grads = _data_parallel(graphdef, 4)(params, batch_stats, x, y, key)
    _, per_device = _per_device(graphdef, params, batch_stats, x, y, key)
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=128, min_size=16)
    for (path, leaf), mine in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(per_device)):
        if leaf.size >= 1024:
            # W = 8: the mean times 8 is exactly the sum the bound is stated for.
            err, bound = sra_bound(np.asarray(mine).reshape(W, -1), np.asarray(leaf).reshape(-1) * W, config)
            assert np.all(err <= bound) and np.any(err > 0), (path, float(np.max(err - bound)))
        else:
            np.testing.assert_allclose(leaf, mine.mean(0), rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_the_doc_quotes_the_example():
    # docs/flax.md's recipe is this file, quoted: every python block of its section appears in it.
    root = pathlib.Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "flax.md").read_text()
    section = doc[doc.index("## BatchNorm, Dropout, metrics, nnx.Optimizer"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    source = (root / "examples" / "train_flax_cnn.py").read_text()
    assert blocks
    for block in blocks:
        assert block in source, block
