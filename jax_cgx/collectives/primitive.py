"""The compressed all-reduce of one buffer as a JAX primitive: its rules and lowering.

``compressed_allreduce_p`` takes rows ``x[R, n]`` (vmapped examples become rows),
``seeds[R, W+1, 2]`` (one seed per chunk plus one for the re-quantization) and
``valid[R]`` int32: how many of each row's values are real (``n`` except for a
hierarchical shard, whose tail may be padding). Its JAX rules make it behave like
``psum``: abstract evaluation drops the reduced axes from the varying-axes type,
differentiation is linear (transpose = ``pvary`` of the cotangent under ``check_vma``,
the same compressed sum without it), and vmap over a non-reduced axis folds into rows.

It lowers, on every platform, to the xla backend (:func:`lower_xla`): the chosen
algorithm (:mod:`~jax_cgx.collectives.sra` or :mod:`~jax_cgx.collectives.ring`) written
with XLA collectives around the codec's kernels. :mod:`jax_cgx.nccl.lowering` registers
the CUDA rule that may pick the nccl backend instead.

``compressed_allreduce_residual_p`` runs the same program and also returns each rank's
share of the compression error, for error feedback (docs/algorithm.md, "Error feedback").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_cgx import _compat
from jax_cgx.codec import batch_rows
from jax_cgx.collectives import agreement, wire
from jax_cgx.collectives.chunks import chunk_length
from jax_cgx.collectives.ring import ring_rows
from jax_cgx.collectives.sra import sra_rows
from jax_cgx.config import CompressionConfig

__all__ = ["compressed_allreduce_p", "compressed_allreduce_residual_p", "compressed_sum", "lower_xla",
           "lower_residual_xla", "xla_rows", "RESIDUAL_BACKEND_ERROR"]


def compressed_sum(values, axes, world, config: CompressionConfig, key, impl, residual=False, valid=None):
    """``values[n]`` summed over ``axes`` (``world`` ranks) by the compressed all-reduce primitive.

    ``valid`` (int32 scalar, default ``n``): how many of ``values`` are real; the rest is
    padding, which never enters a bucket's range. With ``residual``: ``(sum, residual)``
    from the primitive with error feedback.
    """
    if key is None:
        seeds = jnp.zeros((1, world + 1, 2), jnp.uint32)
    else:
        seeds = jax.random.bits(key, (1, world + 1, 2), jnp.uint32)
    chunk = chunk_length(values.size, world, config.bucket_size, config.skip_incomplete_buckets)
    prim = compressed_allreduce_residual_p if residual else compressed_allreduce_p
    valid = jnp.full((1,), values.size, jnp.int32) if valid is None else jnp.reshape(valid, (1,))
    reduced = prim.bind(
        values[None],
        seeds,
        valid.astype(jnp.int32),
        axes=axes,
        world=world,
        chunk=chunk,
        bits=config.bits,
        bucket_size=config.bucket_size,
        stochastic=config.stochastic,
        impl=impl,
        algorithm=config.algorithm,
        backend=config.backend,
        segments=config.pipeline_segments,
    )
    if residual:
        return reduced[0][0], reduced[1][0]
    return reduced[0]


compressed_allreduce_p = Primitive("jax_cgx_compressed_allreduce")


def _abstract_eval(x, seeds, valid, *, axes, **params):
    del seeds, valid, params
    _compat.check_axis_names(axes, "compressed_psum")
    out = x
    if _compat.check_vma_enabled():
        out = _compat.remove_varying(x, axes)
    return out, {_compat.NamedAxisEffect(a) for a in axes}


def xla_rows(x, seeds, valid, *, algorithm, backend, **params):
    """The xla backend: the chosen algorithm written with XLA collectives.

    ``residual=True`` (in ``params``) also returns this rank's compression error;
    ``segments`` and ``message_cap`` say how messages are cut (:mod:`jax_cgx.collectives.wire`).
    """
    del backend
    if algorithm == "ring":
        return ring_rows(x, seeds, valid, **params)
    return sra_rows(x, seeds, valid, **params)


def lower_xla(ctx, x, seeds, valid, *, backend, residual=False, **params):
    """The xla backend's program for either primitive (``residual``: the error-feedback one)."""
    if backend in ("nccl", "tcp"):
        if residual:
            raise NotImplementedError(RESIDUAL_BACKEND_ERROR)
        platforms = ", ".join(ctx.module_context.platforms)
        where = "CUDA GPUs" if backend == "nccl" else "CPU devices"
        raise NotImplementedError(
            f"compressed_psum: backend={backend!r} runs on {where} only, but this computation is "
            f"lowered for {platforms}. Use backend='auto' ({backend} where set up, else xla) or "
            "backend='xla'."
        )
    extra = dict(residual=True) if residual else {}
    agreement.check(ctx, "compressed_psum", "xla", **extra, **params)  # across processes, once per compile
    cap = wire.message_cap(ctx.module_context.platforms)
    fun = functools.partial(xla_rows, backend=backend, message_cap=cap, **extra, **params)
    return mlir.lower_fun(fun, multiple_results=residual)(ctx, x, seeds, valid)


compressed_allreduce_p.def_effectful_abstract_eval(_abstract_eval)
compressed_allreduce_p.def_impl(functools.partial(_compat.apply_primitive, compressed_allreduce_p))
# Every platform; jax_cgx.nccl.lowering registers the CUDA rule that may pick the nccl backend.
mlir.register_lowering(compressed_allreduce_p, lower_xla)


def _jvp(primals, tangents, **params):
    x, seeds, valid = primals
    tx = tangents[0]
    out = compressed_allreduce_p.bind(x, seeds, valid, **params)
    if type(tx) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, compressed_allreduce_p.bind(tx, seeds, valid, **params)


def _transpose(ct, x, seeds, valid, *, axes, **params):
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(seeds)
    if type(ct) is ad.Zero:
        return ad.Zero(x.aval), None, None
    if _compat.is_varying(x.aval, axes):
        # check_vma: the sum is invariant over `axes`; like psum, send the cotangent back as varying.
        return _compat.pvary(ct, axes), None, None
    return compressed_allreduce_p.bind(ct, seeds, valid, axes=axes, **params), None, None


ad.primitive_jvps[compressed_allreduce_p] = _jvp
ad.primitive_transposes[compressed_allreduce_p] = _transpose


def _batcher(prim):
    """vmap over a non-reduced axis folds into rows; over a reduced axis there is no wire."""

    def batch(axis_data, args, dims, *, axes, **params):
        if axis_data.name is not None and axis_data.name in axes:
            raise NotImplementedError(
                f"compressed_psum over the vmapped axis {axis_data.name!r} is not supported: vmap "
                "has no wire to compress. Reduce it with jax.lax.psum, or map that axis with "
                "jax.shard_map / jax.pmap."
            )
        return batch_rows(prim, args, dims, axes=axes, **params)

    return batch


batching.fancy_primitive_batchers[compressed_allreduce_p] = _batcher(compressed_allreduce_p)


# ------------------------------------------ the primitive with error feedback

# (x[R, n], seeds[R, W+1, 2]) -> (out[R, n], residual[R, n]), the same params as
# compressed_allreduce_p. `out` is bitwise what compressed_allreduce_p computes; `residual`
# is this rank's share of the compression error: summed over the ranks of the reduction,
# sum_r residual_r == sum_r x_r - out (up to float32 rounding). A separate primitive, so
# that the plain all-reduce's rules, lowerings and programs stay as they are.
compressed_allreduce_residual_p = Primitive("jax_cgx_compressed_allreduce_residual")
compressed_allreduce_residual_p.multiple_results = True

RESIDUAL_BACKEND_ERROR = (
    "compressed_psum(return_residual=True): error feedback residuals are computed by the xla "
    "backend only; use backend='auto' or 'xla'."
)


def _residual_abstract_eval(x, seeds, valid, *, axes, **params):
    out, effects = _abstract_eval(x, seeds, valid, axes=axes, **params)
    return (out, x), effects  # the residual differs per rank: x's (varying) type


def lower_residual_xla(ctx, x, seeds, valid, **params):
    return lower_xla(ctx, x, seeds, valid, residual=True, **params)


def _residual_jvp(primals, tangents, **params):
    del primals, tangents, params
    raise TypeError(
        "compressed_psum(return_residual=True) cannot be differentiated: the error-feedback "
        "residual is meant for gradient values (see jax_cgx.optax.compressed_mean). "
        "Differentiate compressed_psum without return_residual, or wrap the values in "
        "jax.lax.stop_gradient."
    )


compressed_allreduce_residual_p.def_effectful_abstract_eval(_residual_abstract_eval)
compressed_allreduce_residual_p.def_impl(functools.partial(_compat.apply_primitive, compressed_allreduce_residual_p))
# Every platform; jax_cgx.nccl.lowering registers the CUDA rule (xla, or a clear error for nccl).
mlir.register_lowering(compressed_allreduce_residual_p, lower_residual_xla)
ad.primitive_jvps[compressed_allreduce_residual_p] = _residual_jvp
batching.fancy_primitive_batchers[compressed_allreduce_residual_p] = _batcher(compressed_allreduce_residual_p)
