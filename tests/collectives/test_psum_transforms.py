"""compressed_psum under JAX's transformations, checked for exact equality with lax.psum.

In the style of mpi4jax's all-reduce tests: jit, a Python scalar, vmap, linear_transpose once
and twice, grad, jvp, vjp, two chained collectives under grad, a custom_vjp whose forward and
backward both reduce, and a custom_vjp whose backward takes a jax.vjp through the collective
(netket's ``expect``), each for bits 32, 8, 4 and 2 and for a 0-d array and 6, 1000 and 4100
values per device.

Every program runs on the 8 virtual CPU devices twice, once reducing with
``compressed_psum(..., CompressionConfig(bits, min_size=0))`` (``min_size=0``: even a 0-d
array takes the quantized lane) and once with ``lax.psum``. The inputs are ones, and everything
the programs reduce is a constant array (ones times a power of two or a small integer), so
every bucket is constant and max-min quantization represents it exactly at any bit width:
the compressed results must equal psum's bit for bit, and the analytic values
(8 for the sum of ones over 8 devices; derivatives as psum's).

Modes: ``vma`` is ``jax.shard_map(check_vma=True)`` over a 1-D mesh, ``novma`` the same with
``check_vma=False``, ``pmap`` is ``jax.pmap``. The transposes of a reduction differ between
them like psum's do: with vma types the cotangent of an invariant sum goes back unchanged
(pvary), without them it is summed again (by compressed_psum). Every case runs under ``vma`` on
every shape; the derivatives also under ``novma``, and jit under ``pmap``, on the 0-d array and
4100 values only (the Python scalar in all three modes): every compressed program costs
~0.3-0.4 s of XLA compilation on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, mesh_1d, per_device
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig

AXIS = "d"  # the mesh axis, and the pmap axis name

bits_params = pytest.mark.parametrize("bits", [32, 8, 4, 2], ids=lambda b: f"bits{b}")
SHAPES = {"scalar": (), "6": (6,), "1000": (1000,), "4100": (4100,)}
FEW_SHAPES = ("scalar", "4100")


def cases(*modes, few=()):
    """Parametrize ``(mode, shape)``: every shape under ``modes``, only ``FEW_SHAPES`` under ``few``."""
    pairs = [(m, name) for m in modes for name in SHAPES] + [(m, name) for m in few for name in FEW_SHAPES]
    return pytest.mark.parametrize(
        ("mode", "shape"), [(m, SHAPES[name]) for m, name in pairs], ids=[f"{m}-{name}" for m, name in pairs]
    )


@dataclasses.dataclass(frozen=True)
class Reduce:
    """The collective a program uses: ``compressed_psum`` at ``bits``, or ``lax.psum`` (bits None).

    Hashable, so that a program is built (and compiled, per shape) once per collective.
    """

    bits: int | None

    def __call__(self, x):
        if self.bits is None:
            return jax.lax.psum(x, AXIS)
        return jax_cgx.compressed_psum(x, AXIS, CompressionConfig(bits=self.bits, min_size=0))


PSUM = Reduce(None)


@functools.cache
def _program(transform, reduce: Reduce, mode: str):
    """``transform(reduce, x)`` on every device, jitted: global ``[W, *shape]`` -> tuple of ``[W, ...]``."""
    if mode == "pmap":
        return jax.pmap(lambda x: tuple(map(jnp.asarray, transform(reduce, x))), axis_name=AXIS)

    def body(x):
        return tuple(jnp.asarray(out)[None] for out in transform(reduce, x[0]))

    return jax.jit(
        jax.shard_map(body, mesh=mesh_1d(), in_specs=P(AXIS), out_specs=P(AXIS), check_vma=mode == "vma")
    )


def _run(transform, reduce: Reduce, shape, mode: str):
    ones = np.ones((W, *shape), np.float32)
    xs = ones if mode == "pmap" else per_device(ones, mesh_1d())
    return tuple(np.asarray(out) for out in _program(transform, reduce, mode)(xs))


@functools.cache
def _psum_result(transform, shape, mode):
    return _run(transform, PSUM, shape, mode)


def run(transform, bits: int, shape, mode: str):
    """Every device's outputs of ``transform`` with compressed_psum; asserts they equal psum's."""
    outs = _run(transform, Reduce(bits), shape, mode)
    expected = _psum_result(transform, shape, mode)
    assert len(outs) == len(expected)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        np.testing.assert_array_equal(out, ref, strict=True, err_msg=f"output {i}: compressed_psum vs psum")
    return outs


def assert_all(out, value):
    """Every device's output is ``value`` (broadcast), exactly."""
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(value, out.dtype), out.shape), strict=True)


def size(shape) -> int:
    return int(np.prod(shape, dtype=int))


def ones(x):
    """Ones shaped like ``x``, invariant across devices (a constant): the cotangent of a sum."""
    return jnp.ones(jnp.shape(x), jnp.result_type(x))


# ------------------------------------------------------------------ the transformations


def _jit(reduce, x):
    return (reduce(x),)


@bits_params
@cases("vma", few=("pmap",))
def test_jit(bits, shape, mode):
    (out,) = run(_jit, bits, shape, mode)
    assert out.shape == (W, *shape)
    assert_all(out, W)


def _scalar(reduce, x):
    del x
    # Python scalars, the same on every device (psum returns them times W, as Python numbers);
    # an int takes the exact lane.
    return reduce(1.0), reduce(2)


@bits_params
@pytest.mark.parametrize("mode", ["vma", "novma", "pmap"])
def test_python_scalar(bits, mode):
    if mode == "vma" and bits != 32:
        # With vma types a Python float is invariant: compressing it is refused (check_varying),
        # where psum would sum W copies; the int alone (exact lane) is psum's, W times it.
        with pytest.raises(ValueError, match="leaf \\(root\\) is invariant over 'd'.*use jax.lax.psum"):
            run(_scalar, bits, (), mode)
        (i,) = run(lambda reduce, x: (reduce(2),), bits, (), mode)
        assert_all(i, 2 * W)
        return
    f, i = run(_scalar, bits, (), mode)
    assert f.dtype == np.float32 and i.dtype == np.int32
    assert_all(f, W)
    assert_all(i, 2 * W)


def _vmap(reduce, x):
    batch = jnp.stack([x, 2 * x, 3 * x])
    return (jax.vmap(reduce)(batch),)


@bits_params
@cases("vma")
def test_vmap(bits, mode, shape):
    (out,) = run(_vmap, bits, shape, mode)
    assert out.shape == (W, 3, *shape)
    for k in range(3):
        assert_all(out[:, k], (k + 1) * W)


def _transpose(reduce, x):
    (t,) = jax.linear_transpose(reduce, x)(ones(x))
    return (t,)


@bits_params
@cases("vma", few=("novma",))
def test_linear_transpose(bits, shape, mode):
    # With vma types the transpose is a pvary of the cotangent, as psum's: no compressed sum runs.
    (t,) = run(_transpose, bits, shape, mode)
    assert_all(t, 1 if mode == "vma" else W)


def _transpose_twice(reduce, x):
    def transposed(ct):
        return jax.linear_transpose(reduce, x)(ct)[0]

    (tt,) = jax.linear_transpose(transposed, ones(x))(x)
    return (tt,)


@bits_params
@cases("vma", few=("novma",))
def test_linear_transpose_twice(bits, shape, mode):
    # The transpose of the transpose is the sum again; with vma types it is pvary's transpose,
    # an exact psum, as for lax.psum.
    (tt,) = run(_transpose_twice, bits, shape, mode)
    assert_all(tt, W)


def _grad(reduce, x):
    return jax.value_and_grad(lambda v: jnp.sum(reduce(v)))(x)


@bits_params
@cases("vma", few=("novma",))
def test_grad(bits, shape, mode):
    value, g = run(_grad, bits, shape, mode)
    assert_all(value, W * size(shape))
    assert_all(g, 1 if mode == "vma" else W)


def _jvp(reduce, x):
    return jax.jvp(reduce, (x,), (2 * x,))


@bits_params
@cases("vma")
def test_jvp(bits, mode, shape):
    out, tangent = run(_jvp, bits, shape, mode)
    assert_all(out, W)
    assert_all(tangent, 2 * W)


def _vjp(reduce, x):
    out, pullback = jax.vjp(reduce, x)
    (ct,) = pullback(ones(out))
    return out, ct


@bits_params
@cases("vma", few=("novma",))
def test_vjp(bits, shape, mode):
    out, ct = run(_vjp, bits, shape, mode)
    assert_all(out, W)
    assert_all(ct, 1 if mode == "vma" else W)


def _chained(reduce, x):
    def f(v):
        once = reduce(v)
        # The sum of a value the same on every device, W times it: with vma types said by a pcast
        # (compressed_psum refuses an invariant input; lax.psum inserts the same pcast itself).
        twice = reduce(jax.lax.pcast(once, AXIS, to="varying"))
        return jnp.sum(twice + once)

    return jax.value_and_grad(f)(x)


@bits_params
@cases("vma", few=("novma",))
def test_chained_under_grad(bits, shape, mode):
    value, g = run(_chained, bits, shape, mode)
    assert_all(value, (W * W + W) * size(shape))
    # With vma types each reduction hands its cotangent back unchanged, and the pcast in front of
    # the second one (its input is invariant) transposes to a psum: W + 1. Without them every
    # transpose sums: W * W + W.
    assert_all(g, W + 1 if mode == "vma" else W * W + W)


def _custom_vjp(reduce, x):
    @jax.custom_vjp
    def product_sum(a, b):
        return reduce(a * b)

    def fwd(a, b):
        return reduce(a * b), (a, b)

    def bwd(res, g):
        a, b = res
        # The backward pass reduces too. With vma types the cotangent of the (invariant) sum is
        # invariant: summing its W copies is said with a pcast, as in _chained.
        g = reduce(jax.lax.pcast(g, AXIS, to="varying"))
        return g * b, g * a

    product_sum.defvjp(fwd, bwd)
    value, (ga, gb) = jax.value_and_grad(lambda a, b: jnp.sum(product_sum(a, b)), argnums=(0, 1))(x, x + 1)
    return value, ga, gb


@bits_params
@cases("vma", few=("novma",))
def test_custom_vjp_reducing_forward_and_backward(bits, shape, mode):
    value, ga, gb = run(_custom_vjp, bits, shape, mode)
    assert_all(value, 2 * W * size(shape))
    assert_all(ga, 2 * W)  # reduce(1) * b
    assert_all(gb, W)  # reduce(1) * a


def _expect(reduce, x):
    """netket's ``expect``: the mean over devices of a local estimator, whose custom backward
    differentiates another reduction with ``jax.vjp``."""

    def local(w, s):
        return w * s

    def log_pdf(w, s):
        return w * s

    @jax.custom_vjp
    def expect(w, s):
        return reduce(local(w, s)) / W

    def fwd(w, s):
        values = local(w, s)
        mean = reduce(values) / W
        return mean, (w, s, values - mean)

    def bwd(res, g):
        w, s, centred = res

        def surrogate(w, s):
            return reduce(centred * log_pdf(w, s) + local(w, s)) / W

        _, pullback = jax.vjp(surrogate, w, s)
        return pullback(g)

    expect.defvjp(fwd, bwd)
    return jax.value_and_grad(lambda w: jnp.sum(expect(w, x)))(x)


@bits_params
@cases("vma", few=("novma",))
def test_custom_vjp_with_vjp_in_backward(bits, shape, mode):
    value, g = run(_expect, bits, shape, mode)
    assert_all(value, size(shape))
    # d(mean)/dw: the cotangent 1/W comes back unchanged with vma types, summed to 1 without.
    assert_all(g, 1 / W if mode == "vma" else 1)


def test_vmap_with_no_batched_operand():
    """vmap over keys with nearest rounding (which ignores the key): no operand is batched, and
    every element of the batch is the unbatched result (the batching rule raised StopIteration)."""
    from allreduce_cases import W, mesh_1d, per_device
    from jax.sharding import PartitionSpec as P

    from jax_cgx import CompressionConfig

    config = CompressionConfig(bits=4, bucket_size=64, min_size=16)
    mesh = mesh_1d()
    xs = per_device(jax.random.normal(jax.random.key(0), (W, 1000)), mesh)
    keys = jax.random.split(jax.random.key(1), 3)
    per_key = jax.jit(jax.shard_map(
        lambda x, ks: jax.vmap(lambda k: jax_cgx.compressed_psum(x[0], "d", config, key=k))(ks)[None],
        mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))(xs, keys)
    once = jax.jit(jax.shard_map(lambda x: jax_cgx.compressed_psum(x[0], "d", config)[None],
                                 mesh=mesh, in_specs=P("d"), out_specs=P("d")))(xs)
    for i in range(keys.shape[0]):
        np.testing.assert_array_equal(np.asarray(per_key[:, i]), np.asarray(once))
