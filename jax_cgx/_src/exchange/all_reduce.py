"""The compressed all-reduce of one buffer as a JAX primitive: its rules and lowering.

``compressed_allreduce_p`` takes rows ``x[R, n]`` (vmapped examples become rows),
``seeds[R, W+1, 2]`` (one seed per chunk plus one for the re-quantization) and
``valid[R]`` int32: how many of each row's values are real (``n`` except for a
hierarchical shard, whose tail may be padding). Its ``divisor`` parameter (1, or ``W`` for
``compressed_pmean``) divides the sum where it is decoded, so a mean costs no pass over the
result of its own. Its JAX rules make it behave like ``psum`` (``pmean`` with a divisor): abstract evaluation drops the reduced axes from the varying-axes type,
differentiation is linear (transpose = ``pvary`` of the cotangent under ``check_vma``,
the same compressed sum without it), and vmap over a non-reduced axis folds into rows.

Its ``backend`` parameter is the backend chosen for it while tracing
(:func:`jax_cgx._src.backends.choose_in_trace`); its one lowering rule hands it to that backend
(:func:`jax_cgx._src.backends.register_lowering`). The xla backend runs :func:`allreduce_rows`: the
algorithm its ``algorithm`` parameter names (:data:`ALGORITHM_ROWS`: SRA, the ring), written with
XLA collectives around the codec's kernels.

The module reads like its siblings (:mod:`~jax_cgx._src.exchange.reduce_scatter`,
:mod:`~jax_cgx._src.exchange.all_gather`): the per-device program, the primitive and its rules,
:func:`compressed_sum`, which binds it; then the error-feedback twin.

``compressed_allreduce_residual_p`` runs the same program and also returns each rank's
share of the compression error, for error feedback (docs/algorithm.md, "Error feedback").
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad

from jax_cgx._src import backends, codec, compat
from jax_cgx._src.config import CompressionConfig, given_link_gbps
from jax_cgx._src.exchange.chunks import chunk_length
from jax_cgx._src.exchange.primitives import register
from jax_cgx._src.exchange.ring import ring_rows
from jax_cgx._src.exchange.sra import sra_rows

__all__ = ["ALGORITHM_ROWS", "allreduce_rows", "compressed_allreduce_p", "compressed_allreduce_residual_p",
           "compressed_sum", "reduction"]

API = "compressed_psum"


# ------------------------------------------------------------------ the per-device program

#: The all-reduce's algorithms by name (``CompressionConfig.algorithm``): each the per-device program on rows.
ALGORITHM_ROWS = {"sra": sra_rows, "ring": ring_rows}


def allreduce_rows(x, seeds, valid, *, algorithm, **params):
    """``algorithm``'s program on rows ``x[R, n]``: what the xla backend runs. ``residual=True`` (in
    ``params``) also returns this rank's compression error; ``segments`` and ``message_cap`` say
    how messages are cut (:mod:`jax_cgx._src.exchange.wire`)."""
    return ALGORITHM_ROWS[algorithm](x, seeds, valid, **params)


def reduction(axes: tuple, world: int, config: CompressionConfig, impl: str = "auto",
              residual: bool = False) -> backends.Reduction:
    """The all-reduce of ``config`` over ``axes`` as the backends see it."""
    return backends.Reduction(API, "psum", tuple(axes), world, config.algorithm, impl, residual)


def compressed_sum(values, axes, world, config: CompressionConfig, key, impl, residual=False, valid=None, *,
                   backend: str, divisor: int = 1):
    """``values[n]`` summed over ``axes`` (``world`` ranks) by the compressed all-reduce primitive.

    ``valid`` (int32 scalar, default ``n``): how many of ``values`` are real; the rest is
    padding, which never enters a bucket's range. With ``residual``: ``(sum, residual)``
    from the primitive with error feedback (the residual is the sum's, whatever the divisor).
    ``backend``: the one chosen for it (:func:`jax_cgx._src.backends.choose_in_trace` of
    :func:`reduction`). ``divisor``: the sum divided by it, bitwise ``sum / divisor`` as XLA
    computes it in float32 (:func:`~jax_cgx._src.backends.mean_scale`).
    """
    seeds = codec.rounding_seeds(key, (1, world + 1, 2), config.stochastic)
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
        backend=backend,
        segments=config.pipeline_segments,
        link_gbps=given_link_gbps(config),
        divisor=int(divisor),
    )
    if residual:
        return reduced[0][0], reduced[1][0]
    return reduced[0]


compressed_allreduce_p = Primitive("jax_cgx_compressed_allreduce")


def _abstract_eval(x, seeds, valid, *, axes, **params):
    del seeds, valid, params
    compat.check_axis_names(axes, "compressed_psum")
    out = x
    if compat.check_vma_enabled():
        out = compat.remove_varying(x, axes)
    return out, {compat.NamedAxisEffect(a) for a in axes}



def _jvp(primals, tangents, **params):
    x, seeds, valid = primals
    tx = tangents[0]
    out = compressed_allreduce_p.bind(x, seeds, valid, **params)
    if type(tx) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, compressed_allreduce_p.bind(tx, seeds, valid, **params)


def _transpose(ct, x, seeds, valid, *, axes, divisor, **params):
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(seeds)
    if type(ct) is ad.Zero:
        return ad.Zero(x.aval), None, None
    if compat.is_varying(x.aval, axes):
        # check_vma: the sum is invariant over `axes`; like psum (pmean), send the cotangent back
        # as varying (divided by the divisor).
        back = compat.pvary(ct, axes)
        return (back if divisor == 1 else back / divisor), None, None
    return compressed_allreduce_p.bind(ct, seeds, valid, axes=axes, divisor=divisor, **params), None, None


register(compressed_allreduce_p, abstract_eval=_abstract_eval, program=allreduce_rows, jvp=_jvp, api=API, op="psum",
         lax_name="psum")
ad.primitive_transposes[compressed_allreduce_p] = _transpose  # linear: differentiation is psum's


# ------------------------------------------ the primitive with error feedback

# (x[R, n], seeds[R, W+1, 2]) -> (out[R, n], residual[R, n]), the same params as
# compressed_allreduce_p. `out` is bitwise what compressed_allreduce_p computes; `residual`
# is this rank's share of the compression error: summed over the ranks of the reduction,
# sum_r residual_r == sum_r x_r - divisor * out (up to float32 rounding). A separate primitive, so
# that the plain all-reduce's rules, lowerings and programs stay as they are.
compressed_allreduce_residual_p = Primitive("jax_cgx_compressed_allreduce_residual")
compressed_allreduce_residual_p.multiple_results = True

def _residual_abstract_eval(x, seeds, valid, *, axes, **params):
    out, effects = _abstract_eval(x, seeds, valid, axes=axes, **params)
    return (out, x), effects  # the residual differs per rank: x's (varying) type


def _residual_jvp(primals, tangents, **params):
    del primals, tangents, params
    raise TypeError(
        "compressed_psum(return_residual=True) cannot be differentiated: the error-feedback "
        "residual is meant for gradient values (see jax_cgx.optax.compressed_mean). "
        "Differentiate compressed_psum without return_residual, or wrap the values in "
        "jax.lax.stop_gradient."
    )


register(compressed_allreduce_residual_p, abstract_eval=_residual_abstract_eval,
         program=functools.partial(allreduce_rows, residual=True), jvp=_residual_jvp, api=API, op="psum",
         lax_name="psum")
