"""Single-program oracles of the compressed all-reduce, for tests (ours and users').

:func:`simulate` and :func:`simulate_ring` run SRA and the ring over ``W`` simulated ranks
in one program, with the same codec calls in the same order as the collective, so the
collective's result must equal theirs bit for bit (tests/collectives). They also return
the per-bucket scales each quantization used, for docs/algorithm.md's error bounds.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_cgx._src import codec
from jax_cgx._src.exchange.chunks import chunk_valid

__all__ = ["simulate", "simulate_ring"]


def simulate(xs, seeds, *, chunk, bits, bucket_size, stochastic, impl="reference"):
    """SRA over W simulated ranks in one program: what every rank ends up holding.

    ``xs[W, n]`` are the ranks' buffers and ``seeds[W, W+1, 2]`` their seed rows (as
    ``jax_cgx._src.exchange.sra.sra_rows`` receives them). Returns ``(out[n], scales)`` where ``scales``
    holds, for the error bound, ``quantized[o][r]``: the per-bucket scales of chunk
    ``o`` as rank ``r`` quantized it, and ``summed[o]``: those of the re-quantized sum.

    Args:
      xs: ``[W, n]``, the ranks' buffers (float32, bfloat16 or float16).
      seeds: ``[W, W+1, 2]`` uint32, each rank's seed rows.
      chunk: values per chunk, with ``W * chunk >= n``: what the collective cuts ``n`` values into
        (``jax_cgx._src.exchange.chunks.chunk_length``).
      bits: bits per value, 1..8.
      bucket_size: values per bucket.
      stochastic: stochastic rounding (driven by ``seeds``) instead of round-to-nearest.
      impl: the codec implementation: ``"reference"`` (the default), ``"kernel"`` or ``"auto"``.

    Returns:
      ``(out, scales)``: ``out``, shape ``[n]`` in ``xs``'s dtype, the sum every rank decodes;
      ``scales``, a dict of float32 arrays: ``"quantized"`` of shape ``[W, W, buckets]`` (chunk,
      rank, bucket) and ``"summed"`` of shape ``[W, buckets]`` (chunk, bucket).
    """
    w, n = xs.shape
    c = chunk
    chunks = jnp.pad(xs, ((0, 0), (0, w * c - n))).reshape(w, w, c)  # [rank, chunk, value]
    args = dict(bits=bits, bucket_size=bucket_size, m=c, impl=impl)
    real = chunk_valid(jnp.full((1,), n, jnp.int32), w, c)[0]  # [chunk]
    payload, meta = codec.quantize_rows(
        chunks.reshape(w * w, c), seeds[:, :w].reshape(w * w, 2), stochastic=stochastic,
        valid=jnp.tile(real, w), **args
    )
    payload = payload.reshape(w, w, -1)
    meta = meta.reshape(w, w, -1, 2)
    outs, summed_scales = [], []
    for owner in range(w):
        recv_payload = payload[:, owner][None]  # [1, W, P]: chunk `owner` from every rank
        recv_meta = meta[:, owner].at[owner].set(0)[None]
        sum_payload, sum_meta, _ = codec.dequantize_sum_requantize_rows(
            recv_payload, recv_meta, chunks[owner, owner][None], seeds[owner, w][None],
            stochastic=stochastic, dtype=xs.dtype, valid=real[owner][None], **args,
        )
        outs.append(codec.dequantize_rows(sum_payload, sum_meta, dtype=xs.dtype, **args)[0])
        summed_scales.append(sum_meta[0, :, 1])
    out = jnp.concatenate(outs)[:n]
    return out, dict(quantized=meta[..., 1].transpose(1, 0, 2), summed=jnp.stack(summed_scales))


def simulate_ring(xs, seeds, *, chunk, bits, bucket_size, stochastic, impl="reference"):
    """The ring over W simulated ranks in one program: what every rank ends up holding.

    ``xs[W, n]`` are the ranks' buffers and ``seeds[W, W+1, 2]`` their seed rows (as
    ``jax_cgx._src.exchange.ring.ring_rows`` receives them). Chunk ``o`` is quantized by rank ``o+1``, then
    re-quantized by ranks ``o+2, ..., o+W`` (all mod W; the last is its owner ``o``)
    after each adds its own chunk ``o``. Returns ``(out[n], scales)`` where
    ``scales["hops"][o, h]`` holds the per-bucket scales of the ``h``-th of the W
    quantizations chunk ``o`` went through (``h = 0``: the first, ``h = W-1``: the
    final encoding every replica decodes), for the error bound.

    Args:
      xs: ``[W, n]``, the ranks' buffers (float32, bfloat16 or float16).
      seeds: ``[W, W+1, 2]`` uint32, each rank's seed rows.
      chunk: values per chunk, with ``W * chunk >= n``: what the collective cuts ``n`` values into
        (``jax_cgx._src.exchange.chunks.chunk_length``).
      bits: bits per value, 1..8.
      bucket_size: values per bucket.
      stochastic: stochastic rounding (driven by ``seeds``) instead of round-to-nearest.
      impl: the codec implementation: ``"reference"`` (the default), ``"kernel"`` or ``"auto"``.

    Returns:
      ``(out, scales)``: ``out``, shape ``[n]`` in ``xs``'s dtype, the sum every rank decodes;
      ``scales``, a dict holding ``"hops"``, a float32 array of shape ``[W, W, buckets]`` (chunk,
      quantization, bucket).
    """
    w, n = xs.shape
    c = chunk
    chunks = jnp.pad(xs, ((0, 0), (0, w * c - n))).reshape(w, w, c)  # [rank, chunk, value]
    args = dict(bits=bits, bucket_size=bucket_size, m=c, impl=impl)
    owners = jnp.arange(w)
    real = chunk_valid(jnp.full((1,), n, jnp.int32), w, c)[0]  # row o: chunk o's real values
    # All W chunks travel at once: row o follows chunk o around the ring.
    first = (owners + 1) % w
    payload, meta = codec.quantize_rows(
        chunks[first, owners], seeds[first, 0], stochastic=stochastic, valid=real, **args
    )
    hops = [meta[..., 1]]
    for t in range(w - 1):
        rank = (owners + t + 2) % w
        row = w if t == w - 2 else t + 1
        payload, meta, _ = codec.dequantize_sum_requantize_rows(
            payload[:, None], meta[:, None], chunks[rank, owners], seeds[rank, row],
            stochastic=stochastic, dtype=xs.dtype, valid=real, **args,
        )
        hops.append(meta[..., 1])
    out = codec.dequantize_rows(payload, meta, dtype=xs.dtype, **args).reshape(w * c)[:n]
    return out, dict(hops=jnp.stack(hops, axis=1))
