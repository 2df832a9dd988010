"""The xla backend's wire: packed encodings as byte rows, and the collectives that move them.

An encoded chunk travels as one byte row, ``payload || meta`` (:func:`to_wire`).
The collectives here move such rows like ``lax.all_to_all``, ``lax.all_gather`` and
``lax.ppermute`` do, optionally cut into ``segments`` messages along the byte axis:
the bytes that arrive are the same whatever the cut, so segmenting never changes a
result, only how the transport sees the traffic.

Why segment: XLA:CPU's gloo transport moves one large message per peer at about half
the line rate of a bandwidth-limited link when both directions are busy, as they are
in every all_to_all and ring step (measured, 2 processes on a 1 Gbit/s tbf link, 4.3 MB
per peer: 69 ms all_to_all and 52 ms all_gather against 34 ms of wire; raw TCP sockets
between the same namespaces move it in 34 ms). Cut into messages of at most
256 KiB the same exchange takes 37 ms. docs/results.md has the measurements. So on CPU
with several processes the default (``segments=0``) cuts messages to at most
:data:`CPU_MESSAGE_BYTES`; elsewhere (GPU, where XLA's NCCL pipelines internally, and
virtual CPU devices, whose "transport" is a memcpy) the default is one message.

256 KiB is 2 ms of a 1 Gbit/s link. On a faster link such small messages cost more than they
save: every message is a collective of its own, a round the ranks take together, and at 10
Gbit/s with 4 processes on 2 cores each costs about 1 ms a ring step (2x2 nodes, 64 MiB at 4 bits:
9 messages 95 ms, 2 messages 77 ms, one 52 ms; at 1 Gbit/s, 2 processes: 16 messages 90 ms, 8
107 ms, one 143 ms; docs/multinode.md). So where the link's rate is given
(``CompressionConfig.link_gbps``, or ``JAX_CGX_LINK_GBPS``) the cap is :data:`MESSAGE_SECONDS`
of it (at least :data:`MIN_MESSAGE_BYTES`; unlimited: one message).
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_cgx._src.config import MAX_SEGMENTS  # the most messages one collective is cut into

__all__ = ["CPU_MESSAGE_BYTES", "MAX_SEGMENTS", "MESSAGE_SECONDS", "MIN_MESSAGE_BYTES", "to_wire", "from_wire", "message_cap", "count", "choose",
           "all_to_all", "all_gather", "ppermute"]

logger = logging.getLogger("jax_cgx")

# The largest message per peer that the default cuts to on multi-process CPU (gloo), the link unknown.
CPU_MESSAGE_BYTES = 256 * 1024
# With the link's rate given: messages of at most this long on it, and never below MIN_MESSAGE_BYTES.
MESSAGE_SECONDS = 2e-3
MIN_MESSAGE_BYTES = 64 * 1024


def to_wire(payload, meta):
    """Packed levels and their metadata as one byte array per chunk: payload || meta."""
    meta_bytes = lax.bitcast_convert_type(meta, jnp.uint8).reshape(*meta.shape[:-2], -1)
    return jnp.concatenate([payload, meta_bytes], axis=-1)


def from_wire(wire, p: int, nb: int):
    """The inverse of :func:`to_wire` for ``p`` payload bytes and ``nb`` buckets per chunk."""
    payload = wire[..., :p]
    meta = lax.bitcast_convert_type(wire[..., p:].reshape(*wire.shape[:-1], nb, 2, 4), jnp.float32)
    return payload, meta


def message_cap(platforms, link_gbps: float | None = None) -> int | None:
    """The default largest message for a computation lowered for ``platforms`` (None: no cap).

    Capped only on CPU with more than one process, where collectives go over gloo: to
    :data:`CPU_MESSAGE_BYTES`, or to :data:`MESSAGE_SECONDS` of a link of ``link_gbps``
    Gbit/s per rank where it is given (``inf``: no cap).
    """
    if any(p != "cpu" for p in platforms) or jax.process_count() == 1:
        return None
    if link_gbps is None:
        return CPU_MESSAGE_BYTES
    if math.isinf(link_gbps):
        return None
    return max(MIN_MESSAGE_BYTES, int(link_gbps * 1e9 / 8 * MESSAGE_SECONDS))


def count(segments: int, message_bytes: int, cap: int | None) -> int:
    """How many messages a ``message_bytes`` row is cut into.

    ``segments > 0`` asks for exactly that many (at most one per byte); ``0`` picks by
    size: enough to keep each message within ``cap`` (one when ``cap`` is None), at most
    :data:`MAX_SEGMENTS`.
    """
    if message_bytes <= 1:
        return 1
    if segments > 0:
        return min(segments, message_bytes)
    if cap is None:
        return 1
    return max(1, min(MAX_SEGMENTS, -(-message_bytes // cap)))


def choose(segments: int, message_bytes: int, cap: int | None) -> int:
    """:func:`count`, logged at debug level when a message is cut (once per traced all-reduce)."""
    k = count(segments, message_bytes, cap)
    if k > 1:
        logger.debug("jax_cgx: xla backend: %d-byte messages cut into %d per collective (pipeline_segments=%d%s)",
                     message_bytes, k, segments, f", at most {cap} bytes each" if segments == 0 else "")
    return k


def _cuts(length: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous near-equal ``[start, stop)`` ranges covering ``range(length)``."""
    bounds = [length * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _segmented(collective, wire, k: int):
    """``collective`` applied to ``k`` byte ranges of ``wire``'s last axis, reassembled."""
    if k == 1:
        return collective(wire)
    parts = [collective(wire[..., a:b]) for a, b in _cuts(wire.shape[-1], k)]
    return jnp.concatenate(parts, axis=-1)


def all_to_all(wire, axes, k: int):
    """``wire[R, W, L]``: row ``j`` goes to rank ``j``; returns the W rows received, by sender."""
    return _segmented(lambda w: lax.all_to_all(w, axes, split_axis=1, concat_axis=1, tiled=True), wire, k)


def all_gather(wire, axes, k: int):
    """``wire[R, L]`` from every rank: ``[R, W, L]`` by rank."""
    return _segmented(lambda w: lax.all_gather(w, axes, axis=1, tiled=False), wire, k)


def ppermute(wire, axes, perm, k: int):
    """``lax.ppermute`` of ``wire[..., L]`` along ``perm``."""
    return _segmented(lambda w: lax.ppermute(w, axes, perm), wire, k)
