"""The compressed reduce-scatter of one buffer as a JAX primitive: its program, rules and binding.

``compressed_reduce_scatter_p`` is SRA's first half (docs/algorithm.md):

1. every rank quantizes its ``W`` blocks (each with its own seed; the kernels' ``valid``
   counts keep the alignment padding out of every bucket, and mark its own block as
   holding nothing real: its encoding is zeros, metadata (0, 0), which the CPU kernel writes
   without reading the block) and
   ``all_to_all``\\ s the bytes, so rank ``j`` receives the ``W`` encodings of block ``j``;
2. the owner decodes the ``W - 1`` blocks from its peers and adds them to its own block in
   full precision (its own encoding decodes to +0), accumulating in float32, in one kernel.

Differentiation is ``lax.psum_scatter``'s (``jax.grad`` gives lax's gradient, an ``all_gather``).
Read as its siblings are (:mod:`jax_cgx._src.exchange`): program, primitive and rules,
:func:`compressed_scatter`. Its pytree API is :mod:`jax_cgx._src.collectives.reduce_scatter`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad

from jax_cgx._src import codec, compat
from jax_cgx._src.config import CompressionConfig, given_link_gbps
from jax_cgx._src.exchange import wire
from jax_cgx._src.exchange.chunks import chunk_length, row_plan
from jax_cgx._src.exchange.primitives import register

__all__ = ["compressed_reduce_scatter_p", "compressed_reduce_scatter_residual_p", "compressed_scatter", "scatter_rows"]

API = "compressed_psum_scatter"


# ------------------------------------------------------------------ the per-device program

def scatter_rows(x, seeds, *, axes, world, bits, bucket_size, stochastic, impl, segments, message_cap=None,
                 residual=False):
    """``x[R, W, m]`` (block ``j`` of each row goes to rank ``j``), ``seeds[R, W, 2]`` ->
    ``[R, m]``: this rank's block summed over the ranks, in ``x.dtype``.

    ``residual=True``: ``(out, residual[R, W, m])``, what quantizing each block sent to a peer
    lost (``x - decode(encode(x))``; zero for the rank's own block, which enters exactly). Summed
    over the ranks, the residuals of block ``o`` are ``sum_r x_r[o] - out_o`` (error feedback)."""
    r, w, m = x.shape
    c = chunk_length(w * m, w, bucket_size, False)  # m, aligned for the kernels' vector loads
    padded = x if c == m else lax.dynamic_update_slice(jnp.zeros((r, w, c), x.dtype), x, (0, 0, 0))
    p, nb, codec_args, k = row_plan(c, bits, bucket_size, impl, segments, message_cap)
    me = lax.axis_index(axes)
    # Our own block enters in full precision: encoded with nothing real, it adds exactly +0.
    real = jnp.tile(jnp.where(jnp.arange(w) == me, 0, m).astype(jnp.int32), r)
    payload, meta = codec.quantize_rows(padded.reshape(r * w, c), seeds.reshape(r * w, 2), stochastic=stochastic,
                                        valid=real, **codec_args)
    received = wire.all_to_all(wire.to_wire(payload.reshape(r, w, p), meta.reshape(r, w, nb, 2)), axes, k)
    recv_payload, recv_meta = wire.from_wire(received, p, nb)
    own = lax.dynamic_index_in_dim(padded, me, axis=1, keepdims=False)
    out = codec.dequantize_sum_rows(recv_payload, recv_meta, own, dtype=x.dtype, **codec_args)[:, :m]
    if not residual:
        return out
    sent = codec.dequantize_rows(payload, meta, dtype=jnp.float32, **codec_args).reshape(r, w, c)
    lost = padded.astype(jnp.float32) - sent
    lost = lax.dynamic_update_index_in_dim(lost, jnp.zeros((r, 1, c), jnp.float32), me, axis=1)
    return out, lost[:, :, :m].astype(x.dtype)


# ------------------------------------------------------------------ the primitive and its rules

compressed_reduce_scatter_p = Primitive("jax_cgx_compressed_reduce_scatter")


def _abstract_eval(x, seeds, *, axes, **params):
    del seeds, params
    compat.check_axis_names(axes, API)
    # Each rank holds a different block: the result stays varying over the axes, as lax's does.
    return x.update(shape=(x.shape[0], x.shape[2])), {compat.NamedAxisEffect(a) for a in axes}


def _jvp(primals, tangents, *, axes, **params):
    x, seeds = primals
    out = compressed_reduce_scatter_p.bind(x, seeds, axes=axes, **params)
    tx = tangents[0]
    if type(tx) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    # Quantization is the identity to differentiation: lax's exact, linear psum_scatter.
    return out, lax.psum_scatter(tx, axes, scatter_dimension=1, tiled=False)


register(compressed_reduce_scatter_p, abstract_eval=_abstract_eval, program=scatter_rows, jvp=_jvp, api=API,
         op="psum_scatter", lax_name="psum_scatter")

# (x[R, W, m], seeds) -> (out[R, m], residual[R, W, m]): the same program, with error feedback's residual.
compressed_reduce_scatter_residual_p = Primitive("jax_cgx_compressed_reduce_scatter_residual")
compressed_reduce_scatter_residual_p.multiple_results = True


def _residual_abstract_eval(x, seeds, **params):
    out, effects = _abstract_eval(x, seeds, **params)
    return (out, x), effects  # the residual differs per rank: x's (varying) type


def _residual_jvp(primals, tangents, **params):
    del primals, tangents, params
    raise TypeError(f"{API}(return_residual=True) cannot be differentiated: the residual is meant for gradient "
                    "values (error feedback); differentiate without return_residual, or use jax.lax.stop_gradient")


register(compressed_reduce_scatter_residual_p, abstract_eval=_residual_abstract_eval,
         program=functools.partial(scatter_rows, residual=True), jvp=_residual_jvp, api=API, op="psum_scatter",
         lax_name="psum_scatter")


# ------------------------------------------------------------------ binding

def compressed_scatter(blocks, seeds, axes: tuple, world: int, config: CompressionConfig, *, impl: str, backend: str,
                       residual: bool = False):
    """``blocks[W, m]`` (row ``j`` goes to rank ``j``) -> ``[m]``: this rank's block summed over
    ``axes`` (``world`` ranks) by the compressed reduce-scatter primitive, seeds ``[1, W, 2]``.
    With ``residual``: ``(sum, residual[W, m])``, what quantizing each block lost. ``backend``:
    the one chosen for it while tracing."""
    params = dict(axes=axes, world=world, bits=config.bits, bucket_size=config.bucket_size,
                  stochastic=config.stochastic, impl=impl, segments=config.pipeline_segments, backend=backend,
                  link_gbps=given_link_gbps(config))
    if residual:
        summed, lost = compressed_reduce_scatter_residual_p.bind(blocks[None], seeds, **params)
        return summed[0], lost[0]
    return compressed_reduce_scatter_p.bind(blocks[None], seeds, **params)[0]
