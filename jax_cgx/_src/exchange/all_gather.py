"""The compressed all-gather of one buffer as a JAX primitive: its program, rules and binding.

``compressed_all_gather_p``: every rank quantizes its shard (the kernels' ``valid`` counts keep
the alignment padding out of every bucket), the encodings are all-gathered, and every rank
decodes all ``W`` of them with the same kernel, its own included, so every replica holds bitwise
the same result.

Differentiation is ``lax.all_gather``'s (``jax.grad`` gives lax's gradient, a ``psum_scatter``).
Read as its siblings are (:mod:`jax_cgx._src.exchange`): program, primitive and rules,
:func:`compressed_gather`. Its pytree API is :mod:`jax_cgx._src.collectives.all_gather`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad

from jax_cgx._src import codec, compat
from jax_cgx._src.config import CompressionConfig, given_link_gbps
from jax_cgx._src.exchange import wire
from jax_cgx._src.exchange.chunks import chunk_length, gather_decode_chunks, row_plan
from jax_cgx._src.exchange.primitives import register

__all__ = ["compressed_all_gather_p", "compressed_gather", "gather_rows", "lax_all_gather"]

API = "compressed_all_gather"


# ------------------------------------------------------------------ the per-device program

def gather_rows(x, seeds, *, axes, world, bits, bucket_size, stochastic, impl, segments, message_cap=None):
    """``x[R, m]`` (this rank's shard), ``seeds[R, 2]`` -> ``[R, W, m]``: every rank's shard,
    decoded, the same bits on every replica."""
    r, m = x.shape
    c = chunk_length(m, 1, bucket_size, False)  # m, aligned for the kernels' vector loads
    padded = x if c == m else lax.dynamic_update_slice(jnp.zeros((r, c), x.dtype), x, (0, 0))
    p, nb, codec_args, k = row_plan(c, bits, bucket_size, impl, segments, message_cap)
    payload, meta = codec.quantize_rows(padded, seeds, stochastic=stochastic, valid=jnp.full((r,), m, jnp.int32),
                                        **codec_args)
    return gather_decode_chunks(wire.to_wire(payload, meta), axes, k, p, nb, x.dtype, codec_args)[:, :, :m]


# ------------------------------------------------------------------ the primitive and its rules

compressed_all_gather_p = Primitive("jax_cgx_compressed_all_gather")


def _abstract_eval(x, seeds, *, axes, world, invariant, **params):
    del seeds, params
    compat.check_axis_names(axes, API)
    # Typed as lax.all_gather's result: varying over the axes, or invariant with to="invarying".
    out = x.update(shape=(x.shape[0], world, x.shape[1]))
    if invariant and compat.check_vma_enabled():
        out = compat.remove_varying(out, axes)
    return out, {compat.NamedAxisEffect(a) for a in axes}


def _jvp(primals, tangents, *, axes, invariant, **params):
    x, seeds = primals
    out = compressed_all_gather_p.bind(x, seeds, axes=axes, invariant=invariant, **params)
    tx = tangents[0]
    if type(tx) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    # Quantization is the identity to differentiation: lax's exact, linear all_gather.
    return out, lax_all_gather(tx, axes, 1, False, invariant)


def lax_all_gather(x, axes, axis: int, tiled: bool, invariant: bool):
    """``lax.all_gather``, typed invariant over ``axes`` with ``invariant`` (under ``check_vma``)."""
    if invariant and compat.check_vma_enabled():
        return compat.all_gather_invariant(x, axes, axis=axis, tiled=tiled)
    return lax.all_gather(x, axes, axis=axis, tiled=tiled)


register(compressed_all_gather_p, abstract_eval=_abstract_eval, program=gather_rows, jvp=_jvp, api=API,
         op="all_gather", lax_name="all_gather", typing_only=("invariant",))


# ------------------------------------------------------------------ binding

def compressed_gather(shard, seeds, axes: tuple, world: int, config: CompressionConfig, *, impl: str, backend: str,
                      invariant: bool):
    """``shard[m]`` -> ``[W, m]``: every rank's shard of ``axes`` (``world`` ranks), by the
    compressed all-gather primitive, seeds ``[1, 2]``; ``invariant``: typed the same on every rank
    (``to="invarying"``). ``backend``: the one chosen for it while tracing."""
    return compressed_all_gather_p.bind(
        shard[None], seeds, axes=axes, world=world, bits=config.bits, bucket_size=config.bucket_size,
        stochastic=config.stochastic, impl=impl, segments=config.pipeline_segments, invariant=invariant,
        backend=backend, link_gbps=given_link_gbps(config))[0]
