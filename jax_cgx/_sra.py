"""SRA: the compressed all-reduce of one buffer, as a JAX primitive.

Scatter-reduce / all-gather with every value quantized exactly twice, whatever the
world size W (docs/algorithm.md):

1. pad the buffer and cut it into W chunks; chunk j is owned by rank j. Padding never
   enters a bucket's range: every quantization is told how many of its row's values are
   real (the codec's ``valid`` counts), so a bucket holding the buffer's last values
   and some padding is encoded exactly as an incomplete bucket of those values would be;
2. quantize every chunk (each with its own seed) and ``all_to_all`` the packed
   bytes, so rank j receives the W encodings of chunk j;
3. the owner decodes the W-1 chunks from its peers, adds its own chunk in full
   precision (its own encoding is ignored: its metadata is zeroed so it decodes
   to +0), accumulates in float32 and re-quantizes the sum, in one fused kernel;
4. ``all_gather`` the packed sums and decode them: every replica decodes the
   same bytes with the same kernel, so all replicas hold bitwise equal results.

The primitive works on rows ``x[R, n]`` (vmapped examples become rows) with
``seeds[R, W+1, 2]`` (one seed per chunk plus one for the re-quantization) and
``valid[R]`` int32: how many of each row's values are real (``n`` except for a
hierarchical shard, whose tail may be padding). Its JAX
rules make it behave like ``psum``: abstract evaluation drops the reduced axes from
the varying-axes type, differentiation is linear (transpose = ``pvary`` of the
cotangent under ``check_vma``, the same compressed sum without it), and vmap over
a non-reduced axis folds into rows.

``compressed_allreduce_residual_p`` runs the same program and also returns each rank's
share of the compression error, for error feedback (docs/algorithm.md, "Error feedback").
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_cgx import _compat, _ffi, _wire, codec
from jax_cgx.quantized import META_BYTES, num_buckets, payload_bytes

__all__ = ["chunk_length", "sra_rows", "xla_rows", "compressed_allreduce_p", "compressed_allreduce_residual_p"]

# Chunks of buffers at least this many buckets per rank are whole buckets long.
_WHOLE_BUCKETS_ABOVE = 64


def chunk_length(n: int, world: int, bucket_size: int, whole_buckets: bool) -> int:
    """Values per chunk when ``n`` values are split over ``world`` ranks.

    Chunks are bucket-aligned (no short bucket inside a chunk) when
    ``whole_buckets`` or when the buffer is large enough for the padding to be
    negligible (< 1/64 of the buffer); otherwise a multiple of 16 values, which keeps
    every chunk's start aligned for the kernels' vector loads.
    """
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


def gather_decode(wire, axes, k: int, p: int, nb: int, n: int, dtype, codec_args):
    """The last step of SRA and ring: all-gather every rank's final encoding ``wire[R, L]``
    of its chunk and decode them all, the first ``n`` values: ``[R, n]``, the same bits on
    every replica."""
    gathered = _wire.all_gather(wire, axes, k)
    r, w = gathered.shape[:2]
    payload, meta = _wire.from_wire(gathered, p, nb)
    out = codec.dequantize_rows(payload.reshape(r * w, p), meta.reshape(r * w, nb, 2), dtype=dtype, **codec_args)
    return out.reshape(r, -1)[:, :n]


def sra_rows(x, seeds, valid, *, axes, world, chunk, bits, bucket_size, stochastic, impl, residual=False,
             segments=1, message_cap=None):
    """The per-device program of the compressed all-reduce of rows ``x[R, n]``, of which the
    first ``valid[R]`` values are real (the rest is padding and never widens a bucket).

    Each collective moves its per-peer byte rows in ``_wire.choose(segments, ...,
    message_cap)`` messages (:mod:`jax_cgx._wire`; the bytes, and so the result, do not
    depend on it). With ``residual=True`` returns ``(out, residual)``: this rank's share of the
    compression error (:func:`_sra_residual`), in ``x.dtype``. The exchanged bytes and
    ``out`` are the same either way.
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
    payload, meta = codec.quantize_rows(
        chunks.reshape(r * w, c), seeds[:, :w].reshape(r * w, 2), stochastic=stochastic,
        valid=real.reshape(r * w), **codec_args
    )
    wire = _wire.to_wire(payload.reshape(r, w, p), meta.reshape(r, w, nb, 2))
    received = _wire.all_to_all(wire, axes, k)
    recv_payload, recv_meta = _wire.from_wire(received, p, nb)
    # Our own chunk enters in full precision; its received encoding must add exactly +0.
    recv_meta = lax.dynamic_update_index_in_dim(recv_meta, jnp.zeros((r, 1, nb, 2), jnp.float32), me, axis=1)
    own = lax.dynamic_index_in_dim(chunks, me, axis=1, keepdims=False)
    sum_payload, sum_meta, own_out = codec.dequantize_sum_requantize_rows(
        recv_payload, recv_meta, own, seeds[:, w], stochastic=stochastic, dtype=x.dtype,
        valid=lax.dynamic_index_in_dim(real, me, axis=1, keepdims=False), **codec_args
    )
    out = gather_decode(_wire.to_wire(sum_payload, sum_meta), axes, k, p, nb, n, x.dtype, codec_args)
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
    re-quantized sum every replica holds. Summed over the ranks, the residuals of chunk
    ``o`` telescope to ``sum_r x_r[o] - out[o]`` (docs/algorithm.md, "Error feedback").
    """
    r, w, c = chunks.shape
    f32 = jnp.float32
    sent = codec.dequantize_rows(payload, meta, dtype=f32, **codec_args).reshape(r, w, c)
    err = chunks.astype(f32) - sent
    summed = codec.dequantize_sum_rows(recv_payload, recv_meta, own, dtype=f32, **codec_args)
    own_err = summed - own_out.astype(f32)
    return lax.dynamic_update_index_in_dim(err, own_err, me, axis=1)


def wire_bytes_per_rank(n: int, world: int, bits: int, bucket_size: int, whole_buckets: bool) -> int:
    """Bytes one rank sends for a buffer of ``n`` values (all_to_all plus all_gather)."""
    if world == 1 or n == 0:
        return 0
    c = chunk_length(n, world, bucket_size, whole_buckets)
    per_chunk = payload_bytes(c, bucket_size, bits) + num_buckets(c, bucket_size) * META_BYTES
    return 2 * (world - 1) * per_chunk


# -------------------------------------------------------------- primitive

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
    ``segments`` and ``message_cap`` say how messages are cut (:mod:`jax_cgx._wire`).
    """
    del backend
    if algorithm == "ring":
        from jax_cgx._ring import ring_rows

        return ring_rows(x, seeds, valid, **params)
    return sra_rows(x, seeds, valid, **params)


def _lower_xla(ctx, x, seeds, valid, *, backend, residual=False, **params):
    """The xla backend's program for either primitive (``residual``: the error-feedback one)."""
    if backend == "nccl":
        if residual:
            raise NotImplementedError(RESIDUAL_BACKEND_ERROR)
        platforms = ", ".join(ctx.module_context.platforms)
        raise NotImplementedError(
            f"compressed_psum: backend='nccl' runs on CUDA GPUs only, but this computation is "
            f"lowered for {platforms}. Use backend='auto' (nccl where available, else xla) or "
            "backend='xla'."
        )
    cap = _wire.message_cap(ctx.module_context.platforms)
    extra = dict(residual=True) if residual else {}
    fun = functools.partial(xla_rows, backend=backend, message_cap=cap, **extra, **params)
    return mlir.lower_fun(fun, multiple_results=residual)(ctx, x, seeds, valid)


compressed_allreduce_p.def_effectful_abstract_eval(_abstract_eval)
compressed_allreduce_p.def_impl(functools.partial(_compat.apply_primitive, compressed_allreduce_p))
# Every platform; jax_cgx._nccl_lowering registers the CUDA rule that may pick the nccl backend.
mlir.register_lowering(compressed_allreduce_p, _lower_xla)


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
        return _ffi.batch_rows(prim, args, dims, axes=axes, **params)

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


def _lower_residual_xla(ctx, x, seeds, valid, **params):
    return _lower_xla(ctx, x, seeds, valid, residual=True, **params)


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
# Every platform; jax_cgx._nccl_lowering registers the CUDA rule (xla, or a clear error for nccl).
mlir.register_lowering(compressed_allreduce_residual_p, _lower_residual_xla)
ad.primitive_jvps[compressed_allreduce_residual_p] = _residual_jvp
batching.fancy_primitive_batchers[compressed_allreduce_residual_p] = _batcher(compressed_allreduce_residual_p)


# ------------------------------------------------------- the test oracle


def simulate(xs, seeds, *, chunk, bits, bucket_size, stochastic, impl="reference"):
    """SRA over W simulated ranks in one program: what every rank ends up holding.

    ``xs[W, n]`` are the ranks' buffers and ``seeds[W, W+1, 2]`` their seed rows (as
    :func:`sra_rows` receives them). Returns ``(out[n], scales)`` where ``scales``
    holds, for the error bound, ``quantized[o][r]``: the per-bucket scales of chunk
    ``o`` as rank ``r`` quantized it, and ``summed[o]``: those of the re-quantized sum.
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
