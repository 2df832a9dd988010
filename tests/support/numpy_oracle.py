"""An oracle of the codec and the compressed collectives, written from the documents alone.

Plain NumPy, transcribed from docs/format.md (the codec: buckets, flushing, metadata with its
flags, levels, random bits, packing, decoding, sums) and docs/algorithm.md (SRA, the ring,
the hierarchical all-reduce, the reduce-scatter and all-gather, fusion buffers, seeds). It
imports nothing from ``jax_cgx``: a bug in the library's shared parts (its chunking, its row
dispatch, its seed derivation, its codec arithmetic) cannot move this oracle with it. The
only library it borrows is ``jax.random``, for the seed words, because docs/algorithm.md
defines seeds in its terms (``fold_in``, ``bits``); and ``ml_dtypes`` for the bfloat16 type.

Float32 arithmetic is done in ``np.float32`` (IEEE round-to-nearest, one rounding per
operation, no fused multiply-add), hashing in ``np.uint32`` (wrapping). Everything is
vectorized over buckets, rows, ranks and chunks.

Arrays of rows follow docs/format.md's "Kernels and rows": ``x[R, n]`` (each row its own
problem: buckets start at the row's start, element indices for the hash restart at 0),
``payload[R, P]`` uint8, ``meta[R, nb, 2]`` float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import ml_dtypes
import numpy as np

__all__ = [
    "flush", "mix32", "random_bits", "make_meta", "levels", "pack", "unpack", "decode_levels",
    "quantize_rows", "dequantize_rows", "dequantize_sum_rows", "dequantize_sum_requantize_rows",
    "quantize", "dequantize", "seed_words", "buffer_seeds", "chunk_length", "chunk_real",
    "sra", "ring", "hierarchical", "reduce_scatter", "all_gather", "psum_tree",
]

F32 = np.float32
U32 = np.uint32
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

MIN_NORMAL = F32(2.0**-126)
MAX_FINITE = F32(np.finfo(np.float32).max)
WIDE_LIMIT = F32(2.0**125)
WIDE_DOWN = F32(2.0**-4)
WIDE_UP = F32(16.0)
MIN_SCALE = F32(2.0**-100)
FIXED = F32(2.0**23)
FLAG_POS_INF, FLAG_NEG_INF, FLAG_WIDE = 1, 2, 4
CANONICAL_NAN = U32(0x7FC00000)


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(F32)


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, F32).view(U32)


def _float(u) -> np.ndarray:
    return np.ascontiguousarray(u, U32).view(F32)


def flush(x) -> np.ndarray:
    """``+0 if |x| < 2^-126 else x`` (subnormals and -0 become +0; NaN stays NaN)."""
    x = _f32(x)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) < MIN_NORMAL, F32(0), x).astype(F32)


def to_dtype(x, dtype) -> np.ndarray:
    """float32 to the output dtype, round to nearest even (float32: unchanged)."""
    with np.errstate(over="ignore"):
        return _f32(x).astype(np.dtype(dtype))


# ------------------------------------------------------------------ random bits


def mix32(h) -> np.ndarray:
    """The murmur3 finalizer on uint32 (wrapping multiplications)."""
    h = np.asarray(h, U32)
    h = h ^ (h >> U32(16))
    h = h * U32(0x85EBCA6B)
    h = h ^ (h >> U32(13))
    h = h * U32(0xC2B2AE35)
    return h ^ (h >> U32(16))


def random_bits(seed0, seed1, index) -> np.ndarray:
    """``r_i = mix32(mix32(i ^ seed0) ^ seed1) >> 9``: 23 uniform bits for element ``i`` of a row."""
    index = np.atleast_1d(np.asarray(index, U32))
    return mix32(mix32(index ^ np.asarray(seed0, U32)) ^ np.asarray(seed1, U32)) >> U32(9)


# ------------------------------------------------------------------ metadata and levels


def _round_up16(s) -> np.ndarray:
    return _float((_bits(s) + U32(0xFF)) & U32(0xFFFFFF00))


def make_meta(v, real, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(min, scale field)`` of buckets ``v[..., B]`` (float32, flushed) whose real values are
    where ``real`` is true (docs/format.md, "Metadata"). The scale field is returned as its
    uint32 bit pattern: ``bits(scale) | flags``, or the canonical NaN."""
    top = (1 << bits) - 1
    with np.errstate(invalid="ignore", over="ignore"):
        finite = real & (np.abs(v) <= MAX_FINITE)
        has_nan = np.any(real & np.isnan(v), axis=-1)
        pos_inf = np.any(real & (v == np.inf), axis=-1)
        neg_inf = np.any(real & (v == -np.inf), axis=-1)
        any_finite = np.any(finite, axis=-1)
        mn = np.min(np.where(finite, v, F32(np.inf)), axis=-1).astype(F32)
        mx = np.max(np.where(finite, v, F32(-np.inf)), axis=-1).astype(F32)
        span = top - pos_inf.astype(np.int64) - neg_inf.astype(np.int64)
        bad = has_nan | (any_finite & ((span < 0) | ((span == 0) & (mx > mn))))
        wide = any_finite & ((mn < -WIDE_LIMIT) | (mx > WIDE_LIMIT))
        mn = np.where(any_finite, np.where(wide, flush(mn * WIDE_DOWN), mn), F32(0)).astype(F32)
        mx = np.where(any_finite, np.where(wide, flush(mx * WIDE_DOWN), mx), F32(0)).astype(F32)
        # step = f32(1 / span): one correctly rounded division (the per-width constant for span = L).
        step = np.where(span > 0, F32(1) / np.maximum(span, 1).astype(F32), F32(0)).astype(F32)
        s = _round_up16((mx - mn) * step)
        s = np.where(s > MIN_SCALE, s, MIN_SCALE).astype(F32)
        scale = np.where(mx > mn, s, F32(0)).astype(F32)
    flags = (np.where(pos_inf, FLAG_POS_INF, 0) | np.where(neg_inf, FLAG_NEG_INF, 0)
             | np.where(wide, FLAG_WIDE, 0)).astype(U32)
    field = _bits(scale) | flags
    return (np.where(bad, F32(np.nan), mn).astype(F32), np.where(bad, CANONICAL_NAN, field).astype(U32))


def _split_field(field):
    field = np.asarray(field, U32)
    flags = field & U32(0xFF)
    scale = _float(field & U32(0xFFFFFF00))
    return flags, scale


def levels(x, mn, field, bits: int, rnd=None) -> np.ndarray:
    """The level of each value ``x[..., B]`` in its bucket ``(mn[...], field[...])`` (docs/format.md,
    "Levels"); nearest rounding, or stochastic with the 23-bit ``rnd[..., B]``."""
    top = (1 << bits) - 1
    flags, scale = _split_field(field)
    neg = (flags & U32(FLAG_NEG_INF)) != 0
    pos = (flags & U32(FLAG_POS_INF)) != 0
    wide = (flags & U32(FLAG_WIDE)) != 0
    span = top - neg.astype(np.int64) - pos.astype(np.int64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        inv = np.where(scale > 0, F32(1) / np.where(scale > 0, scale, F32(1)), F32(0)).astype(F32)
        clamp = np.maximum(span, 0).astype(F32)
        f = flush(x)
        g = np.where(wide[..., None], flush(f * WIDE_DOWN), f).astype(F32)
        t = ((flush(g) - mn[..., None]) * inv[..., None]).astype(F32)
        t = np.where(t > 0, t, F32(0)).astype(F32)
        t = np.where(t < clamp[..., None], t, clamp[..., None]).astype(F32)
        fixed = (t * FIXED).astype(np.int32).astype(U32)
    if rnd is None:
        level = (fixed + U32(1 << 22)) >> U32(23)
    else:
        level = (fixed >> U32(23)) + ((fixed & U32((1 << 23) - 1)) > rnd).astype(U32)
    level = level + neg[..., None].astype(U32)
    level = np.where(pos[..., None] & (f == np.inf), U32(top), level)
    level = np.where(neg[..., None] & (f == -np.inf), U32(0), level)
    return np.where(np.isnan(mn)[..., None], U32(0), level).astype(U32)


def decode_levels(level, mn, field, bits: int) -> np.ndarray:
    """float32 values of ``level[..., B]`` in buckets ``(mn[...], field[...])`` (docs/format.md, "Decoding")."""
    top = (1 << bits) - 1
    flags, scale = _split_field(field)
    neg = ((flags & U32(FLAG_NEG_INF)) != 0)[..., None]
    pos = ((flags & U32(FLAG_POS_INF)) != 0)[..., None]
    wide = ((flags & U32(FLAG_WIDE)) != 0)[..., None]
    level = np.asarray(level, U32)
    with np.errstate(invalid="ignore", over="ignore"):
        steps = (level.astype(np.int64) - neg).astype(F32)
        v = flush(mn[..., None] + steps * scale[..., None])
        v = np.where(wide, np.clip(v * WIDE_UP, -MAX_FINITE, MAX_FINITE), v).astype(F32)
    v = np.where(pos & (level == top), F32(np.inf), v)
    return np.where(neg & (level == 0), F32(-np.inf), v).astype(F32)


# ------------------------------------------------------------------ bit packing


def pack(level, bits: int) -> np.ndarray:
    """``level[..., c]`` -> ``uint8[..., ceil(c*bits/8)]``: value ``j`` at bits ``[j*bits, (j+1)*bits)``
    of the bucket's stream, least significant bit first, unused high bits zero."""
    level = np.asarray(level, U32)
    planes = ((level[..., None] >> np.arange(bits, dtype=U32)) & U32(1)).astype(np.uint8)
    stream = planes.reshape(*level.shape[:-1], level.shape[-1] * bits)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack(packed, count: int, bits: int) -> np.ndarray:
    """The inverse of :func:`pack`: ``uint8[..., ceil(count*bits/8)]`` -> ``uint32[..., count]``."""
    packed = np.asarray(packed, np.uint8)
    stream = np.unpackbits(packed, axis=-1, count=count * bits, bitorder="little")
    planes = stream.reshape(*packed.shape[:-1], count, bits).astype(U32)
    return np.sum(planes << np.arange(bits, dtype=U32), axis=-1, dtype=U32)


def _pieces(m: int, bucket: int):
    """A row of ``m`` values: ``floor(m/B)`` whole buckets, then one shorter bucket if ``m mod B``:
    ``[(first value, buckets, values per bucket)]``."""
    full, rest = divmod(m, bucket)
    out = [(0, full, bucket)] if full else []
    return out + ([(full * bucket, 1, rest)] if rest else [])


def payload_bytes(m: int, bucket: int, bits: int) -> int:
    full, rest = divmod(m, bucket)
    return full * (-(-bucket * bits // 8)) + (-(-rest * bits // 8))


# ------------------------------------------------------------------ the codec on rows


def quantize_rows(x, seeds, *, bits: int, bucket_size: int, stochastic: bool, m: int | None = None,
                  valid=None) -> tuple[np.ndarray, np.ndarray]:
    """Encode the first ``m`` values of each row ``x[R, n]`` (any float dtype): ``(payload[R, P],
    meta[R, nb, 2])``. ``seeds[R, 2]`` uint32; ``valid[R]``: only row ``r``'s first ``valid[r]``
    values are real (docs/format.md, "Padding"); the rest are encoded with the same formulas."""
    x = np.asarray(x)
    r = x.shape[0]
    m = x.shape[1] if m is None else m
    v = flush(x[:, :m].astype(F32))
    seeds = np.asarray(seeds, U32).reshape(r, 2)
    valid = np.full(r, m, np.int64) if valid is None else np.asarray(valid, np.int64).reshape(r)
    payloads, metas = [], []
    for start, k, length in _pieces(m, bucket_size):
        vals = v[:, start:start + k * length].reshape(r, k, length)
        index = (start + np.arange(k * length, dtype=np.int64)).reshape(k, length)
        real = index[None] < valid[:, None, None]
        mn, field = make_meta(vals, real, bits)
        rnd = None
        if stochastic:
            rnd = random_bits(seeds[:, 0, None, None], seeds[:, 1, None, None], index.astype(U32)[None])
        lv = levels(vals, mn, field, bits, rnd)
        payloads.append(pack(lv, bits).reshape(r, -1))
        metas.append(np.stack([mn, _float(field)], axis=-1))
    if not payloads:
        return np.zeros((r, 0), np.uint8), np.zeros((r, 0, 2), F32)
    return np.concatenate(payloads, axis=1), np.concatenate(metas, axis=1).astype(F32)


def dequantize_rows(payload, meta, *, bits: int, bucket_size: int, m: int) -> np.ndarray:
    """float32 ``[R, m]`` decoded from ``payload[R, P]``, ``meta[R, nb, 2]``."""
    payload, meta = np.asarray(payload, np.uint8), np.asarray(meta, F32)
    r = payload.shape[0]
    out, byte = [], 0
    for start, k, length in _pieces(m, bucket_size):
        nbytes = -(-length * bits // 8)
        packed = payload[:, byte:byte + k * nbytes].reshape(r, k, nbytes)
        byte += k * nbytes
        b0 = start // bucket_size
        mt = meta[:, b0:b0 + k]
        lv = unpack(packed, length, bits)
        out.append(decode_levels(lv, mt[..., 0], _bits(mt[..., 1]), bits).reshape(r, -1))
    return np.concatenate(out, axis=1) if out else np.zeros((r, 0), F32)


def dequantize_sum_rows(payload, meta, addend=None, *, bits: int, bucket_size: int, m: int) -> np.ndarray:
    """float32 ``acc[R, m]``: ``flush(addend)`` (or +0), then ``acc = flush(acc + decode(w))`` for the
    W encodings ``payload[R, W, P]``, ``meta[R, W, nb, 2]`` in order."""
    payload, meta = np.asarray(payload), np.asarray(meta)
    r, w = payload.shape[:2]
    acc = np.zeros((r, m), F32) if addend is None else flush(np.asarray(addend)[:, :m].astype(F32))
    with np.errstate(over="ignore", invalid="ignore"):  # sums past the largest float: inf; inf + -inf: NaN
        for i in range(w):
            acc = flush(acc + dequantize_rows(payload[:, i], meta[:, i], bits=bits, bucket_size=bucket_size, m=m))
    return acc


def dequantize_sum_requantize_rows(payload, meta, addend, seeds, *, bits: int, bucket_size: int,
                                   stochastic: bool, m: int, dtype, valid=None):
    """The fused step: the float32 sum re-quantized ``(payload, meta)``, and its decode in ``dtype``."""
    acc = dequantize_sum_rows(payload, meta, addend, bits=bits, bucket_size=bucket_size, m=m)
    p, mt = quantize_rows(acc, seeds, bits=bits, bucket_size=bucket_size, stochastic=stochastic, m=m, valid=valid)
    return p, mt, to_dtype(dequantize_rows(p, mt, bits=bits, bucket_size=bucket_size, m=m), dtype)


# ------------------------------------------------------------------ whole arrays (jax_cgx.quantize's fields)


def quantize(x, *, bits: int, bucket_size: int, stochastic: bool = False, seeds=(0, 0),
             skip_incomplete_buckets: bool = False) -> dict:
    """``x`` (any shape) flattened row-major: ``dict(payload, meta, tail)`` as docs/format.md lays them out."""
    flat = np.asarray(x).reshape(1, -1)
    n = flat.shape[1]
    m = (n // bucket_size) * bucket_size if skip_incomplete_buckets else n
    payload, meta = quantize_rows(flat, np.asarray(seeds, U32)[None], bits=bits, bucket_size=bucket_size,
                                  stochastic=stochastic, m=m)
    return dict(payload=payload[0], meta=meta[0], tail=flat[0, m:])


def dequantize(q: dict, shape, dtype, *, bits: int, bucket_size: int) -> np.ndarray:
    n = int(np.prod(shape))
    m = n - q["tail"].size
    out = to_dtype(dequantize_rows(q["payload"][None], q["meta"][None], bits=bits, bucket_size=bucket_size, m=m)[0],
                   dtype)
    return np.concatenate([out, np.asarray(q["tail"], dtype)]).reshape(shape)


def sum_tails(tails, addend_tail=None) -> np.ndarray:
    """Uncompressed tails summed in float32 with the same flush/add order."""
    tails = np.asarray(tails)
    acc = np.zeros(tails.shape[1:], F32) if addend_tail is None else flush(np.asarray(addend_tail).astype(F32))
    with np.errstate(over="ignore", invalid="ignore"):
        for t in tails:
            acc = flush(acc + flush(t.astype(F32)))
    return acc


# ------------------------------------------------------------------ seeds


def seed_words(key) -> np.ndarray:
    """``(seed0, seed1) = jax.random.bits(key, (2,), uint32)``: the seeds of ``jax_cgx.quantize(key=key)``."""
    import jax
    import jax.numpy as jnp

    return np.asarray(jax.random.bits(key, (2,), jnp.uint32))


def buffer_seeds(key, rank: int, buffer_index: int, count: int) -> np.ndarray:
    """``uint32[count, 2]``: ``jax.random.bits(fold_in(fold_in(key, rank), buffer_index), (count, 2))``,
    the seed pairs rank ``rank`` draws for fusion buffer ``buffer_index`` (docs/algorithm.md); zeros
    without a key (nearest rounding reads none)."""
    if key is None:
        return np.zeros((count, 2), U32)
    import jax
    import jax.numpy as jnp

    k = jax.random.fold_in(jax.random.fold_in(key, int(rank)), int(buffer_index))
    return np.asarray(jax.random.bits(k, (count, 2), jnp.uint32))


def rank_seeds(key, ranks: Sequence[int], buffer_index: int, count: int) -> np.ndarray:
    """``uint32[len(ranks), count, 2]``: :func:`buffer_seeds` of each rank."""
    return np.stack([buffer_seeds(key, r, buffer_index, count) for r in ranks])


# ------------------------------------------------------------------ the all-reduce of one buffer


def chunk_length(n: int, world: int, bucket_size: int, whole_buckets: bool) -> int:
    """Values per chunk (docs/algorithm.md, SRA step 1): ``ceil(n / W)`` rounded up to a multiple of
    ``bucket_size`` when buckets are skipped or ``ceil(n / W) >= 64 * bucket_size``, else of 16."""
    per_rank = -(-n // world)
    align = bucket_size if whole_buckets or per_rank >= 64 * bucket_size else 16
    return -(-per_rank // align) * align


def chunk_real(valid: int, world: int, chunk: int) -> np.ndarray:
    """Real values of each chunk: ``clip(valid - j * c, 0, c)``."""
    return np.clip(valid - np.arange(world, dtype=np.int64) * chunk, 0, chunk)


@dataclasses.dataclass
class Reduced:
    """A collective's result: ``out`` (what every replica holds), the chunk length, and the scale
    fields (float32 views, flags included) of every quantization, per bucket, for error bounds."""

    out: np.ndarray
    chunk: int
    scales: dict

    def __iter__(self):  # (out, scales, chunk), as the tests' helpers return it
        return iter((self.out, self.scales, self.chunk))


def _chunks(xs, world: int, chunk: int) -> np.ndarray:
    xs = np.asarray(xs)
    padded = np.zeros((xs.shape[0], world * chunk), xs.dtype)
    padded[:, :xs.shape[1]] = xs
    return padded.reshape(xs.shape[0], world, chunk)  # [rank, chunk, value]


def sra(xs, seeds, *, bits: int, bucket_size: int, stochastic: bool, skip_incomplete_buckets: bool = False,
        valid: int | None = None) -> Reduced:
    """SRA over W simulated ranks: ``xs[W, n]`` (rank ``r``'s buffer, its dtype), ``seeds[W, W+1, 2]``
    (rank ``r``'s seed pairs: row ``j`` for chunk ``j``, row ``W`` for the re-quantization).
    ``valid``: how many of the ``n`` values are real (a hierarchical shard's; default ``n``)."""
    xs = np.asarray(xs)
    w, n = xs.shape
    seeds = np.asarray(seeds, U32)
    c = chunk_length(n, w, bucket_size, skip_incomplete_buckets)
    chunks = _chunks(xs, w, c)
    real = chunk_real(n if valid is None else valid, w, c)
    codec = dict(bits=bits, bucket_size=bucket_size, m=c)
    # Rank r quantizes its chunk j with seed row j; its own chunk holds nothing real.
    sent_real = np.where(np.eye(w, dtype=bool), 0, real[None, :])
    payload, meta = quantize_rows(chunks.reshape(w * w, c), seeds[:, :w].reshape(w * w, 2),
                                  stochastic=stochastic, valid=sent_real.reshape(-1), **codec)
    payload, meta = payload.reshape(w, w, -1), meta.reshape(w, w, -1, 2)  # [rank, chunk, ...]
    # Owner o: its own chunk in full precision, then the W encodings of chunk o in rank order.
    own = chunks[np.arange(w), np.arange(w)]
    sum_p, sum_m, out = dequantize_sum_requantize_rows(
        payload.transpose(1, 0, 2), meta.transpose(1, 0, 2, 3), own, seeds[:, w], stochastic=stochastic,
        dtype=xs.dtype, valid=real, **codec)
    return Reduced(out.reshape(-1)[:n], c, dict(quantized=meta[..., 1].transpose(1, 0, 2), summed=sum_m[..., 1]))


def ring(xs, seeds, *, bits: int, bucket_size: int, stochastic: bool, skip_incomplete_buckets: bool = False,
         valid: int | None = None) -> Reduced:
    """The ring over W simulated ranks (docs/algorithm.md, "Ring"): chunk ``o`` is quantized by rank
    ``o+1`` with its seed row 0, then at step ``t`` rank ``o+t+2`` adds its chunk ``o`` and
    re-quantizes with its seed row ``t+1`` (``W`` at the last step, on the owner ``o``)."""
    xs = np.asarray(xs)
    w, n = xs.shape
    seeds = np.asarray(seeds, U32)
    c = chunk_length(n, w, bucket_size, skip_incomplete_buckets)
    chunks = _chunks(xs, w, c)
    real = chunk_real(n if valid is None else valid, w, c)
    codec = dict(bits=bits, bucket_size=bucket_size, m=c)
    owners = np.arange(w)
    first = (owners + 1) % w
    payload, meta = quantize_rows(chunks[first, owners], seeds[first, 0], stochastic=stochastic, valid=real, **codec)
    hops = [meta[..., 1]]
    for t in range(w - 1):
        rank = (owners + t + 2) % w
        row = w if t == w - 2 else t + 1
        payload, meta, _ = dequantize_sum_requantize_rows(
            payload[:, None], meta[:, None], chunks[rank, owners], seeds[rank, row], stochastic=stochastic,
            dtype=F32, valid=real, **codec)
        hops.append(meta[..., 1])
    out = to_dtype(dequantize_rows(payload, meta, **codec), xs.dtype).reshape(-1)[:n]
    return Reduced(out, c, dict(hops=np.stack(hops, axis=1)))


def allreduce(xs, seeds, *, algorithm: str = "sra", **kw) -> Reduced:
    return (ring if algorithm == "ring" else sra)(xs, seeds, **kw)


def _psum(xs) -> np.ndarray:
    """The exact lanes' ``lax.psum``, as a float32 sum in rank order (XLA's order is not specified:
    compare these values with a tolerance, not bitwise)."""
    xs = np.asarray(xs)
    if xs.dtype.kind in "iub":
        return xs.sum(0, dtype=xs.dtype)
    acc = xs[0].astype(F32)
    for x in xs[1:]:
        acc = acc + x.astype(F32)
    return acc.astype(xs.dtype)


def hierarchical(xs, key, buffer_index: int, *, bits: int, bucket_size: int, stochastic: bool,
                 algorithm: str = "sra", skip_incomplete_buckets: bool = False) -> Reduced:
    """The hierarchical all-reduce of one buffer head (docs/algorithm.md, "Hierarchical"):
    ``xs[W_outer, W_inner, n]`` (rank ``(i, j)``'s buffer; ranks numbered ``i * W_inner + j``).

    The intra-node sums are float32 sums in inner-rank order: XLA's reduce-scatter does not
    specify its order, so they are bitwise the collective's only for ``W_inner <= 2``.
    Returns the gathered result and, per shard ``j``, the outer reduction's scales."""
    xs = np.asarray(xs)
    outer, inner, n = xs.shape
    align = inner * (bucket_size if skip_incomplete_buckets else 1)
    shard = -(-n // align) * align // inner
    node = xs[:, 0].astype(F32)
    for j in range(1, inner):
        node = node + xs[:, j].astype(F32)
    padded = np.zeros((outer, inner * shard), xs.dtype)
    padded[:, :n] = node.astype(xs.dtype)
    outs, scales, chunk = [], [], None
    for j in range(inner):
        ranks = [i * inner + j for i in range(outer)]
        seeds = rank_seeds(key if stochastic else None, ranks, buffer_index, outer + 1)
        red = allreduce(padded[:, j * shard:(j + 1) * shard], seeds, algorithm=algorithm, bits=bits,
                        bucket_size=bucket_size, stochastic=stochastic,
                        skip_incomplete_buckets=skip_incomplete_buckets, valid=int(np.clip(n - j * shard, 0, shard)))
        outs.append(red.out)
        scales.append(red.scales)
        chunk = red.chunk
    return Reduced(np.concatenate(outs)[:n], chunk, dict(shards=scales, shard=shard))


def allreduce_buffer(xs, key, buffer_index: int, config, ranks: Sequence[int] | None = None) -> np.ndarray:
    """One fusion buffer ``xs[W, n]`` reduced as ``compressed_psum`` reduces it (flat, not hierarchical):
    W = 1 exact; with ``skip_incomplete_buckets`` the last ``n mod B`` values take the exact lane."""
    xs = np.asarray(xs)
    w, n = xs.shape
    if w == 1:
        return xs[0]
    head = (n // config.bucket_size) * config.bucket_size if config.skip_incomplete_buckets else n
    parts = []
    if head:
        ranks = range(w) if ranks is None else ranks
        seeds = rank_seeds(key if config.stochastic else None, ranks, buffer_index, w + 1)
        parts.append(allreduce(xs[:, :head], seeds, algorithm=config.algorithm, bits=config.bits,
                               bucket_size=config.bucket_size, stochastic=config.stochastic,
                               skip_incomplete_buckets=config.skip_incomplete_buckets).out)
    if head < n:
        parts.append(_psum(xs[:, head:]))
    return np.concatenate(parts)


# ------------------------------------------------------------------ pytrees: lanes and fusion buffers


def _lane(leaf: np.ndarray, config) -> str:
    """docs/algorithm.md, "Lanes" (leaf without the rank axis)."""
    if config is None or config.bits == 32 or leaf.dtype.kind in "iub" or leaf.size == 0 or leaf.size < config.min_size:
        return "exact"
    return "half" if config.bits == 16 else "quantized"


def capacity(config, dtype) -> int:
    """Values per fusion buffer: ``max(1, floor(fusion_buffer_mb * 2^20) // itemsize)``."""
    import fractions

    return max(1, int(fractions.Fraction(config.fusion_buffer_mb) * 2**20) // np.dtype(dtype).itemsize)


# docs/algorithm.md, "Lanes": on CPUs a leaf of at least a quarter of a buffer is a buffer (or
# buffers, cut at the capacity) of its own, first in its group.
ALONE_SHARE = 0.25


def buffer_spans(sizes: Sequence[int], cap: int, platform: str = "cpu") -> tuple[list[int], list[tuple[int, int]]]:
    """A group's member order (indices into ``sizes``, the leaves in tree order) and its buffers'
    ``(start, stop)`` over the members' concatenation in that order."""
    alone = -(-cap // round(1 / ALONE_SHARE)) if platform == "cpu" else math.inf  # ceil(cap / 4), exact
    order = [k for k, n in enumerate(sizes) if n >= alone] + [k for k, n in enumerate(sizes) if n < alone]
    spans, start = [], 0
    for k in order:
        if sizes[k] < alone:
            break
        spans += [(a, min(a + cap, start + sizes[k])) for a in range(start, start + sizes[k], cap)]
        start += sizes[k]
    total = sum(sizes)
    return order, spans + [(a, min(a + cap, total)) for a in range(start, total, cap)]


def _groups(leaves, configs) -> list[tuple[Any, list[int]]]:
    """Quantized leaves grouped by (dtype, config), groups in the order of their first leaf."""
    groups: dict = {}
    for i, (leaf, c) in enumerate(zip(leaves, configs)):
        if _lane(leaf[0], c) == "quantized":
            groups.setdefault((np.dtype(leaf.dtype), c), []).append(i)
    return list(groups.items())


def psum_tree(leaves: Sequence, configs, key=None) -> list[np.ndarray]:
    """``compressed_psum`` of a flattened pytree over W simulated ranks (one flat axis, ranks 0..W-1;
    ``policy="always"``): ``leaves[k]`` is ``[W, *shape]``, ``configs`` one config per leaf (or one
    for all; objects with CompressionConfig's fields). Returns each leaf's sum.

    Quantized leaves of one dtype and config are concatenated (those alone first,
    :func:`buffer_spans`; the CPU's rule) and cut into fusion buffers of :func:`capacity` values,
    numbered 0, 1, ... over all groups (groups in the order of their first leaf): buffer ``b``'s
    seeds are drawn from ``fold_in(fold_in(key, r), b)``.
    Exact and half lanes are rank-order float32 sums (not bitwise XLA's)."""
    leaves = [np.asarray(v) for v in leaves]
    configs = list(configs) if isinstance(configs, (list, tuple)) else [configs] * len(leaves)
    w = leaves[0].shape[0]
    out: list = [None] * len(leaves)
    for i, (leaf, c) in enumerate(zip(leaves, configs)):
        lane = _lane(leaf[0], c)
        if lane == "exact":
            out[i] = _psum(leaf)
        elif lane == "half":
            half = leaf.astype(BFLOAT16 if c.half_dtype == "bfloat16" else np.float16)
            out[i] = _psum(half).astype(leaf.dtype)
    buffer_index = 0
    for (dtype, c), members in _groups(leaves, configs):
        order, spans = buffer_spans([leaves[i][0].size for i in members], capacity(c, dtype))
        members = [members[k] for k in order]
        flat = np.concatenate([leaves[i].reshape(w, -1) for i in members], axis=1)
        reduced = []
        for start, stop in spans:
            buf = flat[:, start:stop]
            if c.hierarchical:
                raise NotImplementedError("psum_tree: hierarchical configs need a 2-D mesh; use hierarchical()")
            reduced.append(allreduce_buffer(buf, key, buffer_index, c))
            buffer_index += 1
        joined = np.concatenate(reduced)
        offset = 0
        for i in members:
            size = leaves[i][0].size
            out[i] = joined[offset:offset + size].reshape(leaves[i].shape[1:])
            offset += size
    return out


# ------------------------------------------------------------------ reduce-scatter and all-gather


def reduce_scatter(blocks, seeds, *, bits: int, bucket_size: int, stochastic: bool) -> np.ndarray:
    """One buffer of ``compressed_psum_scatter``: ``blocks[W, W, m]`` (rank ``r``'s block ``j``),
    ``seeds[W, W, 2]`` (rank ``r``'s pair ``j`` for its block ``j``). Returns ``[W, m]``: owner
    ``o``'s block, its own block in full precision plus the W encodings of block ``o`` decoded
    in rank order (its own quantized as holding nothing real), in float32, then cast."""
    blocks = np.asarray(blocks)
    w, _, m = blocks.shape
    seeds = np.asarray(seeds, U32)
    c = chunk_length(w * m, w, bucket_size, False)
    padded = np.zeros((w, w, c), blocks.dtype)
    padded[..., :m] = blocks
    sent_real = np.where(np.eye(w, dtype=bool), 0, m)
    payload, meta = quantize_rows(padded.reshape(w * w, c), seeds.reshape(w * w, 2), bits=bits,
                                  bucket_size=bucket_size, stochastic=stochastic, m=c, valid=sent_real.reshape(-1))
    payload, meta = payload.reshape(w, w, -1), meta.reshape(w, w, -1, 2)
    own = padded[np.arange(w), np.arange(w)]
    acc = dequantize_sum_rows(payload.transpose(1, 0, 2), meta.transpose(1, 0, 2, 3), own, bits=bits,
                              bucket_size=bucket_size, m=c)
    return to_dtype(acc[:, :m], blocks.dtype)


def all_gather(shards, seeds, *, bits: int, bucket_size: int, stochastic: bool) -> np.ndarray:
    """One buffer of ``compressed_all_gather``: ``shards[W, m]``, ``seeds[W, 2]`` (rank ``r``'s pair).
    Returns ``[W, m]``, what every replica holds: each shard quantized by its owner and decoded."""
    shards = np.asarray(shards)
    w, m = shards.shape
    p, mt = quantize_rows(shards, seeds, bits=bits, bucket_size=bucket_size, stochastic=stochastic, m=m)
    return to_dtype(dequantize_rows(p, mt, bits=bits, bucket_size=bucket_size, m=m), shards.dtype)


def fuse(sizes: Sequence[int], capacity_values: int) -> list[list[int]]:
    """Fusion buffers of whole leaves, as docs/algorithm.md ("Sharded training") states them: leaves
    of consecutive positions "join a buffer while their sizes per rank add up to at most" the
    capacity, and "a larger leaf is a buffer of its own". Each buffer starts at the first leaf not
    yet in one and takes the longest run of the leaves after it whose sum stays within the capacity."""
    buffers: list[list[int]] = []
    start = 0
    while start < len(sizes):
        end = start + 1  # every buffer holds its first leaf, however large
        while end < len(sizes) and sum(sizes[start:end + 1]) <= capacity_values:
            end += 1
        buffers.append(list(range(start, end)))
        start = end
    return buffers


def psum_scatter_tree(leaves: Sequence, config, key=None) -> list[np.ndarray]:
    """``compressed_psum_scatter(tiled=True, scatter_dimension=0)`` of quantized leaves over W simulated
    ranks (``policy="always"``; every leaf quantized, one config): ``leaves[k]`` is
    ``[W, W * b_k, ...]``; returns ``[W, b_k, ...]`` per leaf (rank ``o``'s result in row ``o``)."""
    leaves = [np.asarray(v) for v in leaves]
    w = leaves[0].shape[0]
    out: list = [None] * len(leaves)
    cap = capacity(config, leaves[0].dtype) // w
    for b, members in enumerate(fuse([leaves[i][0].size // w for i in range(len(leaves))], cap)):
        blocks = np.concatenate([leaves[i].reshape(w, w, -1) for i in members], axis=2)  # [rank, block, values]
        seeds = rank_seeds(key if config.stochastic else None, range(w), b, w)
        summed = reduce_scatter(blocks, seeds, bits=config.bits, bucket_size=config.bucket_size,
                                stochastic=config.stochastic)
        start = 0
        for i in members:
            size = leaves[i][0].size // w
            out[i] = summed[:, start:start + size].reshape(w, leaves[i].shape[1] // w, *leaves[i].shape[2:])
            start += size
    return out


def all_gather_tree(leaves: Sequence, config, key=None) -> list[np.ndarray]:
    """``compressed_all_gather(tiled=False, axis=0)`` of quantized leaves over W simulated ranks:
    ``leaves[k]`` is ``[W, *shape]`` (rank ``r``'s shard); returns ``[W, *shape]`` per leaf, what
    every replica holds (the same on all)."""
    leaves = [np.asarray(v) for v in leaves]
    w = leaves[0].shape[0]
    out: list = [None] * len(leaves)
    cap = capacity(config, leaves[0].dtype) // w
    for b, members in enumerate(fuse([leaves[i][0].size for i in range(len(leaves))], cap)):
        shards = np.concatenate([leaves[i].reshape(w, -1) for i in members], axis=1)
        seeds = rank_seeds(key if config.stochastic else None, range(w), b, 1)[:, 0]
        got = all_gather(shards, seeds, bits=config.bits, bucket_size=config.bucket_size, stochastic=config.stochastic)
        start = 0
        for i in members:
            size = leaves[i][0].size
            out[i] = got[:, start:start + size].reshape(leaves[i].shape)
            start += size
    return out
