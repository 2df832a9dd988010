"""A compressed leaf typed invariant over the reduced axes raises (issue 33, item 2).

Under ``shard_map(check_vma=True)`` the gradient with respect to replicated parameters comes out
already summed by JAX; ``compressed_pmean`` of it was ``W`` times the mean gradient, silently. The
reductions now refuse a compressed leaf whose type says it is the same on every device, naming
the fix (``jax.lax.pcast(params, axis, to="varying")``); leaves reduced exactly keep
``lax.psum``'s meaning, and without ``check_vma`` (no types) nothing changes.

The loss is linear, ``sum(w * x)``, so that each device's own gradient is its row of ``x`` to
the bit and the results can be compared with ``compressed_pmean`` of the rows themselves.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, exact_psum, mesh_1d, mesh_2d, per_device, psum_1d
from bitwise import assert_same_bits
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx.optax import compressed_mean

N = 1000
CONFIG = CompressionConfig(bits=4, bucket_size=64, min_size=16)
FIX = r"jax\.lax\.pcast\(params, 'd', to='varying'\)"


def _loss(w, x):
    return jnp.sum(w * x)


def _rows(seed=0):
    return np.asarray(jax.random.normal(jax.random.key(seed), (W, N), jnp.float32))


def _grad_step(pcast: bool, reduce, check_vma=True):
    """Each device's gradient of the linear loss at replicated ``w`` (through a varying copy when
    ``pcast``), reduced by ``reduce``; jitted."""

    def body(w, x):
        mine = jax.lax.pcast(w, "d", to="varying") if pcast else w
        return reduce(jax.grad(_loss)(mine, x[0]))[None]

    mesh = mesh_1d()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"), check_vma=check_vma))


def _run(f, xs):
    mesh = mesh_1d()
    return np.asarray(f(per_device(np.zeros(N, np.float32), mesh, P()), per_device(xs, mesh)))


def test_the_gradient_of_replicated_parameters_raises_naming_pcast():
    xs = _rows()
    f = _grad_step(False, lambda g: jax_cgx.compressed_pmean({"w": g}, "d", CONFIG)["w"])
    with pytest.raises(ValueError, match=r"compressed_pmean: leaf \['w'\] is invariant over 'd'") as err:
        _run(f, xs)
    message = str(err.value)
    assert re.search(FIX, message), message
    assert f"{W} times the mean gradient" in message
    assert "data_parallel_value_and_grad" in message and "reduce_in_backward" in message


def test_compressed_psum_names_lax_psum_for_w_times_the_value():
    xs = _rows()
    f = _grad_step(False, lambda g: jax_cgx.compressed_psum(g, "d", CONFIG))
    with pytest.raises(ValueError, match=rf"compressed_psum: leaf \(root\) is invariant over 'd'.*{FIX}.*"
                                         rf"If {W} times the value is what you mean, use jax.lax.psum"):
        _run(f, xs)


def test_raises_inside_grad():
    # The reduction of an invariant value inside a differentiated function: refused while tracing.
    def body(w, x):
        return jax.grad(lambda v: jnp.sum(jax_cgx.compressed_psum(v * 2.0, "d", CONFIG)))(w)[None] + x[0][None]

    mesh = mesh_1d()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")))
    with pytest.raises(ValueError, match=rf"invariant over 'd'.*{FIX}"):
        f(per_device(np.zeros(N, np.float32), mesh, P()), per_device(_rows(), mesh))


def test_the_pcast_program_is_unaffected():
    xs = _rows(1)
    f = _grad_step(True, lambda g: jax_cgx.compressed_pmean(g, "d", CONFIG))
    out = _run(f, xs)
    # Each device's gradient is its row: the compressed mean of the rows, bitwise.
    placed = per_device(xs, mesh_1d())
    assert_same_bits(out, psum_1d(placed, None, CONFIG, mean=True))
    assert not np.array_equal(out[0], np.asarray(exact_psum(placed)) / W)  # and it did compress


def test_without_check_vma_nothing_is_checked():
    # No types: the gradient is each device's own (JAX inserts no psum), as with the pcast.
    xs = _rows(2)
    reduce = lambda g: jax_cgx.compressed_pmean(g, "d", CONFIG)  # noqa: E731
    assert_same_bits(_run(_grad_step(False, reduce, check_vma=False), xs), _run(_grad_step(True, reduce), xs))


@pytest.mark.parametrize("config", [CompressionConfig(bits=32), CompressionConfig(bits=4, min_size=2 * N), None],
                         ids=["bits32", "below_min_size", "leaf_config_none"])
def test_exact_leaves_keep_psums_meaning(config):
    # Reduced exactly, they are lax.psum: an invariant value is summed W times (an int leaf too).
    xs = _rows(3)
    spec = {"w": config, "step": None}

    def reduce(g):
        out = jax_cgx.compressed_psum({"w": g, "step": jnp.int32(1)}, "d", spec)
        return out["w"] + out["step"]

    def with_psum(g):
        return jax.lax.psum(g, "d") + jax.lax.psum(jnp.int32(1), "d")

    assert_same_bits(_run(_grad_step(False, reduce), xs), _run(_grad_step(False, with_psum), xs))


def test_psum_scatter_raises_and_all_gather_does_not():
    mesh = mesh_1d()
    invariant = per_device(np.ones((W, 64), np.float32), mesh, P())

    def scatter(x):
        return jax_cgx.compressed_psum_scatter({"g": x}, "d", CONFIG, tiled=True)["g"]

    f = jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P("d")))
    with pytest.raises(ValueError, match=rf"compressed_psum_scatter: leaf \['g'\] is invariant over 'd'.*{FIX}"):
        f(invariant)
    # Gathering a value that is the same everywhere is not a reduction: W copies of it, as lax's.
    g = jax.jit(jax.shard_map(lambda x: jax_cgx.compressed_all_gather(x, "d", CONFIG, tiled=True), mesh=mesh,
                              in_specs=P(), out_specs=P("d")))
    out = np.asarray(g(invariant)).reshape(W, W * W, 64)
    for k in range(W):
        assert_same_bits(out[k], np.ones((W * W, 64), np.float32))


def test_only_the_axes_it_is_invariant_over_are_named():
    mesh = mesh_2d((2, 4), ("a", "b"))
    xs = np.ones((2, N), np.float32)

    def body(x):  # varying over "a" (its row), invariant over "b"
        return jax_cgx.compressed_psum(x[0], ("a", "b"), CONFIG)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a")))
    with pytest.raises(ValueError, match=r"invariant over 'b'.*summing it adds 4 equal copies.*"
                                         r"pcast\(params, 'b', to='varying'\)"):
        f(jax.device_put(xs, jax.sharding.NamedSharding(mesh, P("a"))))


@pytest.mark.parametrize("error_feedback", [False, True])
def test_optax_compressed_mean_raises(error_feedback):
    # With error feedback the per-device residual would type the summed gradient varying: the
    # gradient itself is checked first.
    tx = compressed_mean("d", CONFIG, layer_min_size=16, error_feedback=error_feedback)
    mesh = mesh_1d()
    params = {"w": jnp.zeros((N // 10, 10), jnp.float32)}

    def body(w, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x[0].reshape(p["w"].shape)))(w)
        updates, _ = tx.update(grads, tx.init(grads))
        return updates["w"][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")))
    with pytest.raises(ValueError, match=rf"compressed_mean: leaf \['w'\] is invariant over 'd'.*{FIX}"):
        f(jax.device_put(params, jax.sharding.NamedSharding(mesh, P())), per_device(_rows(), mesh))
