"""How SRA and the ring cut a buffer: chunk lengths, real counts, the shared last step.

Both algorithms pad a buffer of ``n`` values to ``W`` chunks of ``c`` values (rank ``j``
owns chunk ``j``), tell every quantization how many of its chunk's values are real (so
padding never widens a bucket), and end the same way: all-gather the final encodings
and decode them (:func:`gather_decode`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_cgx._src import backends, codec
from jax_cgx._src.codec.quantized import META_BYTES, num_buckets, payload_bytes
from jax_cgx._src.exchange import wire as _wire

__all__ = ["chunk_length", "chunk_valid", "row_plan", "gather_decode", "gather_decode_chunks", "wire_bytes_per_rank"]

# Chunks of buffers at least this many buckets per rank are whole buckets long.
_WHOLE_BUCKETS_ABOVE = 64


# Counts of real values reach the kernels as int32: a buffer holds fewer than 2^31 values per rank.
MAX_BUFFER_VALUES = 2**31 - 1


def check_buffer_values(n: int) -> None:
    """A clear error for a buffer whose value counts would wrap in int32 (and decode to zeros)."""
    if n > MAX_BUFFER_VALUES:
        raise ValueError(
            f"jax_cgx: a compressed buffer of {n} values per rank is more than the kernels can count "
            f"({MAX_BUFFER_VALUES}, int32). Split the leaf into smaller leaves, lower fusion_buffer_mb, "
            "or give the leaf config=None (reduced exactly)")


def chunk_length(n: int, world: int, bucket_size: int, whole_buckets: bool) -> int:
    """Values per chunk when ``n`` values are split over ``world`` ranks (at most
    :data:`MAX_BUFFER_VALUES`).

    Chunks are bucket-aligned (no short bucket inside a chunk) when
    ``whole_buckets`` or when the buffer is large enough for the padding to be
    negligible (< 1/64 of the buffer); otherwise a multiple of 16 values, which keeps
    every chunk's start aligned for the kernels' vector loads.
    """
    check_buffer_values(n)
    per_rank = -(-n // world)
    if whole_buckets or per_rank >= _WHOLE_BUCKETS_ABOVE * bucket_size:
        align = bucket_size
    else:
        align = 16
    return -(-per_rank // align) * align


def row_plan(chunk: int, bits: int, bucket_size: int, impl: str, segments: int, message_cap: int | None):
    """What SRA and ring share for a chunk of ``chunk`` values: ``(payload bytes, buckets,
    codec keyword arguments, messages per collective)``."""
    p, nb = payload_bytes(chunk, bucket_size, bits), num_buckets(chunk, bucket_size)
    codec_args = dict(bits=bits, bucket_size=bucket_size, m=chunk, impl=impl)
    return p, nb, codec_args, _wire.choose(segments, p + nb * META_BYTES, message_cap)


def chunk_valid(valid, world: int, chunk: int):
    """``[R, W]`` int32: how many real values chunk ``j`` of each row holds, given
    ``valid[R]`` real values per row (the rest, and the padding up to ``W * chunk``, is
    padding that must not enter a bucket's range)."""
    starts = jnp.arange(world, dtype=jnp.int32) * chunk
    return jnp.clip(valid[:, None].astype(jnp.int32) - starts, 0, chunk)


def gather_decode(wire, axes, k: int, p: int, nb: int, n: int, dtype, codec_args, divisor: int = 1):
    """The last step of SRA and ring: all-gather every rank's final encoding ``wire[R, L]``
    of its chunk and decode them all, the first ``n`` values: ``[R, n]``, the same bits on
    every replica; divided by ``divisor`` in the decode (:func:`~jax_cgx._src.backends.mean_scale`), not in a pass
    over the result of its own."""
    chunks = gather_decode_chunks(wire, axes, k, p, nb, dtype, codec_args, divisor)
    return chunks.reshape(chunks.shape[0], -1)[:, :n]


def gather_decode_chunks(wire, axes, k: int, p: int, nb: int, dtype, codec_args, divisor: int = 1):
    """All-gather every rank's encoding ``wire[R, L]`` of one chunk and decode them:
    ``[R, W, c]``, rank ``j``'s chunk at ``[:, j]``, the same bits on every replica."""
    gathered = _wire.all_gather(wire, axes, k)
    r, w = gathered.shape[:2]
    payload, meta = _wire.from_wire(gathered, p, nb)
    out = codec.dequantize_rows(payload.reshape(r * w, p), meta.reshape(r * w, nb, 2), dtype=dtype,
                                scale=backends.mean_scale(divisor), **codec_args)
    return out.reshape(r, w, -1)


def wire_bytes_per_rank(n: int, world: int, bits: int, bucket_size: int, whole_buckets: bool) -> int:
    """Bytes one rank sends for a buffer of ``n`` values (all_to_all plus all_gather)."""
    if world == 1 or n == 0:
        return 0
    c = chunk_length(n, world, bucket_size, whole_buckets)
    per_chunk = payload_bytes(c, bucket_size, bits) + num_buckets(c, bucket_size) * META_BYTES
    return 2 * (world - 1) * per_chunk
