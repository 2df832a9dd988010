"""SRA: the compressed all-reduce of one buffer, written with XLA collectives.

Scatter-reduce / all-gather with every value quantized exactly twice, whatever the
world size W (docs/algorithm.md):

1. pad the buffer and cut it into W chunks; chunk j is owned by rank j. Padding never
   enters a bucket's range: every quantization is told how many of its row's values are
   real (the codec's ``valid`` counts), so a bucket holding the buffer's last values
   and some padding is encoded exactly as an incomplete bucket of those values would be;
2. quantize every chunk (each with its own seed) and ``all_to_all`` the packed
   bytes, so rank j receives the W encodings of chunk j. A rank's own chunk is
   quantized as holding no real value: its encoding is zeros (the CPU kernel writes them without reading it)
   (metadata (0, 0), which decodes to +0), since the owner uses the chunk itself;
3. the owner decodes the W-1 chunks from its peers, adds its own chunk in full
   precision (its own encoding adds +0), accumulates in float32 and re-quantizes
   the sum, in one fused kernel;
4. ``all_gather`` the packed sums and decode them: every replica decodes the
   same bytes with the same kernel, so all replicas hold bitwise equal results.

Works on rows ``x[R, n]`` with ``seeds[R, W+1, 2]`` (one seed per chunk plus one for
the re-quantization) and ``valid[R]`` real values per row; the primitive that runs it
and its JAX rules are in :mod:`jax_cgx._src.exchange.all_reduce`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_cgx._src import codec
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.exchange.chunks import chunk_valid, gather_decode, row_plan

__all__ = ["sra_rows"]


def sra_rows(x, seeds, valid, *, axes, world, chunk, bits, bucket_size, stochastic, impl, residual=False,
             segments=1, message_cap=None, divisor=1):
    """The per-device program of the compressed all-reduce of rows ``x[R, n]``, of which the
    first ``valid[R]`` values are real (the rest is padding and never widens a bucket).

    Each collective moves its per-peer byte rows in ``_wire.choose(segments, ...,
    message_cap)`` messages (:mod:`jax_cgx._src.exchange.wire`; the bytes, and so the result, do not
    depend on it). With ``residual=True`` returns ``(out, residual)``: this rank's share of the
    compression error (:func:`_sra_residual`), in ``x.dtype``. The exchanged bytes and
    ``out`` are the same either way. ``divisor``: ``out`` is the sum divided by it, in the final
    decode (``compressed_pmean``: ``W``); the residual stays the sum's.
    """
    r, n = x.shape
    if n == 0:
        return (x, x) if residual else x
    w, c = world, chunk
    p, nb, codec_args, k = row_plan(chunk, bits, bucket_size, impl, segments, message_cap)
    me = lax.axis_index(axes)

    # Zero padding up to W chunks, written in place (cheaper on XLA:CPU than pad + reshape).
    # It never enters a bucket's range: each quantization gets its row's count of real values.
    padded = x if w * c == n else lax.dynamic_update_slice(jnp.zeros((r, w * c), x.dtype), x, (0, 0))
    chunks = padded.reshape(r, w, c)
    real = chunk_valid(valid, w, c)
    # Our own chunk enters the sum in full precision: encoded with nothing real, it adds exactly +0.
    sent_real = jnp.where(jnp.arange(w) == me, 0, real)
    payload, meta = codec.quantize_rows(
        chunks.reshape(r * w, c), seeds[:, :w].reshape(r * w, 2), stochastic=stochastic,
        valid=sent_real.reshape(r * w), **codec_args
    )
    wire = _wire.to_wire(payload.reshape(r, w, p), meta.reshape(r, w, nb, 2))
    received = _wire.all_to_all(wire, axes, k)
    recv_payload, recv_meta = _wire.from_wire(received, p, nb)
    own = lax.dynamic_index_in_dim(chunks, me, axis=1, keepdims=False)
    sum_payload, sum_meta, own_out = codec.dequantize_sum_requantize_rows(
        recv_payload, recv_meta, own, seeds[:, w], stochastic=stochastic, dtype=x.dtype,
        valid=lax.dynamic_index_in_dim(real, me, axis=1, keepdims=False), **codec_args
    )
    out = gather_decode(_wire.to_wire(sum_payload, sum_meta), axes, k, p, nb, n, x.dtype, codec_args, divisor)
    if not residual:
        return out
    res = _sra_residual(chunks, payload, meta, recv_payload, recv_meta, own, own_out, me, codec_args)
    return out, res.reshape(r, w * c)[:, :n].astype(x.dtype)


def _sra_residual(chunks, payload, meta, recv_payload, recv_meta, own, own_out, me, codec_args):
    """This rank's share of the SRA compression error, float32 ``[R, W, c]``.

    Chunk ``j != me``: what quantizing it lost, ``chunk_j - decode(quantize(chunk_j))``
    (the encodings sent in the all_to_all). Chunk ``me``: what re-quantizing the owner's
    sum lost, ``S_me - out_me``, with ``S_me`` the float32 sum the fused kernel
    re-quantized (recomputed by ``dequantize_sum`` from the same received encodings and
    own addend: the same kernel order, the same float32 sums) and ``out_me`` the decoded
    re-quantized sum (what every replica holds, before a mean's division). Summed over the
    ranks, the residuals of chunk ``o`` telescope to ``sum_r x_r[o] - out[o]`` (the sum's
    ``out``; docs/algorithm.md, "Error feedback").
    """
    r, w, c = chunks.shape
    f32 = jnp.float32
    sent = codec.dequantize_rows(payload, meta, dtype=f32, **codec_args).reshape(r, w, c)
    err = chunks.astype(f32) - sent
    summed = codec.dequantize_sum_rows(recv_payload, recv_meta, own, dtype=f32, **codec_args)
    own_err = summed - own_out.astype(f32)
    return lax.dynamic_update_index_in_dim(err, own_err, me, axis=1)
