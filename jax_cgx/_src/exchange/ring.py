"""Ring: the compressed all-reduce as a ring reduce-scatter plus an all-gather.

The ``algorithm="ring"`` variant of the compressed all-reduce primitive
(:mod:`jax_cgx._src.exchange.all_reduce`), written with XLA collectives. For one buffer of rows
``x[R, n]`` over W ranks (docs/algorithm.md, section "Ring"):

1. pad with zeros to ``W * c`` values and cut into W chunks exactly as SRA does;
   rank ``r`` ends up owning chunk ``r``. As in SRA, every quantization is told how
   many of its chunk's values are real, so padding never widens a bucket;
2. step 0: rank ``r`` quantizes its chunk ``(r-1) mod W`` with seed row 0 and sends
   the encoding to rank ``(r+1) mod W``;
3. steps ``t = 0 .. W-2``: rank ``r`` receives from ``(r-1) mod W`` the running
   encoding of chunk ``k = (r-t-2) mod W``, decodes it, adds its own chunk ``k`` in
   full precision (float32 accumulation) and re-quantizes the sum with seed row
   ``t+1`` (``W`` at the last step, where ``k == r``): one fused
   ``dequantize_sum_requantize`` per hop. The re-quantized sum travels on at the
   next step; after the last step it is the final encoding of chunk ``r``;
4. ``all_gather`` the final encodings and decode all W chunks: every replica decodes
   the same bytes, so all replicas are bitwise equal.

Each value passes through W quantizations (the partial sum of chunk ``k`` is
re-quantized at every hop), against two for SRA, but every step only talks to the
ring neighbours and a rank sends the same number of bytes as with SRA. Seed row
``W-1`` is unused. A CUDA/NCCL implementation mirrors this schedule byte for byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cgx._src import codec
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.exchange.chunks import chunk_valid, gather_decode, row_plan

__all__ = ["ring_rows"]


def ring_rows(x, seeds, valid, *, axes, world, chunk, bits, bucket_size, stochastic, impl, residual=False,
              segments=1, message_cap=None, divisor=1):
    """The per-device program of the ring compressed all-reduce of rows ``x[R, n]``, of which
    the first ``valid[R]`` values are real (the rest is padding and never widens a bucket).

    ``seeds[R, W+1, 2]``: row 0 for the first quantization, row ``t+1`` for the
    re-quantization at step ``t < W-2``, row ``W`` for the final one.

    With ``residual=True`` returns ``(out, residual)``: this rank handles every chunk
    exactly once (its first quantization of chunk ``r-1``, then one re-quantization per
    hop, of chunk ``(r-t-2) mod W``, the last being chunk ``r``), and ``residual[chunk k]``
    is the float32 input of that quantization minus its decoded result, in ``x.dtype``.
    The exchanged bytes and ``out`` are the same either way, as they are for any cut of the
    messages (``segments``, ``message_cap``: :mod:`jax_cgx._src.exchange.wire`). ``divisor``:
    as for :func:`~jax_cgx._src.exchange.sra.sra_rows`.
    """
    r, n = x.shape
    if n == 0:
        return (x, x) if residual else x
    w, c = world, chunk
    p, nb, codec_args, k_msg = row_plan(chunk, bits, bucket_size, impl, segments, message_cap)
    me = lax.axis_index(axes)
    to_next = _ring_perm(axes, w)
    f32 = jnp.float32

    padded = x if w * c == n else lax.dynamic_update_slice(jnp.zeros((r, w * c), x.dtype), x, (0, 0))
    chunks = padded.reshape(r, w, c)
    real = chunk_valid(valid, w, c)

    def own_chunk(k):
        return lax.dynamic_index_in_dim(chunks, k, axis=1, keepdims=False)

    def real_of(k):
        return lax.dynamic_index_in_dim(real, k, axis=1, keepdims=False)

    # Step 0: our chunk (r-1) mod W starts its trip around the ring.
    first = (me + w - 1) % w
    payload, meta = codec.quantize_rows(
        own_chunk(first), seeds[:, 0], stochastic=stochastic, valid=real_of(first), **codec_args
    )
    wire = _wire.to_wire(payload, meta)
    if residual:
        lost = own_chunk(first).astype(f32) - codec.dequantize_rows(payload, meta, dtype=f32, **codec_args)
        res = lax.dynamic_update_index_in_dim(jnp.zeros((r, w, c), f32), lost, first, axis=1)

    def step(t, carry):
        wire = carry[0] if residual else carry
        received = _wire.ppermute(wire, axes, to_next, k_msg)
        recv_payload, recv_meta = _wire.from_wire(received, p, nb)
        k = (me + 2 * w - t - 2) % w
        row = jnp.where(t == w - 2, w, t + 1)
        # With residuals, decode in float32: the next hop adds exactly these float32 values.
        sum_payload, sum_meta, decoded = codec.dequantize_sum_requantize_rows(
            recv_payload[:, None],
            recv_meta[:, None],
            own_chunk(k),
            lax.dynamic_index_in_dim(seeds, row, axis=1, keepdims=False),
            stochastic=stochastic,
            dtype=f32 if residual else x.dtype,
            valid=real_of(k),
            **codec_args,
        )
        wire = _wire.to_wire(sum_payload, sum_meta)
        if not residual:
            return wire
        summed = codec.dequantize_sum_rows(
            recv_payload[:, None], recv_meta[:, None], own_chunk(k), dtype=f32, **codec_args
        )
        # The final encoding (k == r) is what every replica decodes, in x.dtype.
        decoded = jnp.where(t == w - 2, decoded.astype(x.dtype).astype(f32), decoded)
        return wire, lax.dynamic_update_index_in_dim(carry[1], summed - decoded, k, axis=1)

    # After the last step (t = W-2, k = r) `wire` is the final encoding of our chunk.
    carry = lax.fori_loop(0, w - 1, step, (wire, res) if residual else wire)
    wire = carry[0] if residual else carry
    out = gather_decode(wire, axes, k_msg, p, nb, n, x.dtype, codec_args, divisor)
    if not residual:
        return out
    return out, carry[1].reshape(r, w * c)[:, :n].astype(x.dtype)


def _ring_perm(axes, world: int) -> list[tuple[int, int]]:
    """``ppermute`` pairs sending rank ``i`` to rank ``(i+1) mod W``, ranks as ``axis_index(axes)`` numbers them.

    ``lax.axis_index(axes)`` numbers the ranks row-major over ``axes`` as listed, but
    ``lax.ppermute`` over several axes numbers them row-major in *mesh* order (its
    lowering sorts each device group; measured on jax 0.10.2). Translate when the two differ.
    """
    identity = [(i, (i + 1) % world) for i in range(world)]
    if len(axes) < 2:
        return identity
    mesh_names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if not all(a in mesh_names for a in axes):
        return identity  # no mesh (pmap): the axes nest in the order they are bound
    sizes = [lax.axis_size(a) for a in axes]
    coords = np.stack(np.unravel_index(np.arange(world), sizes), axis=1)  # listed rank -> coordinates
    order = sorted(range(len(axes)), key=lambda i: mesh_names.index(axes[i]))
    ppermute_index = np.ravel_multi_index(tuple(coords[:, order].T), [sizes[i] for i in order])
    return [(int(ppermute_index[i]), int(ppermute_index[(i + 1) % world])) for i in range(world)]
