"""A cost model of compressed_psum and psum on a bandwidth-limited link.

Predicts the time of one all-reduce of ``n`` values per rank over ``W`` ranks, each rank's
link limited to ``B`` bytes/s in each direction, from measured codec throughput. Used by
``policy="auto"`` (:mod:`jax_cgx._src.policy.pricing`) to decide, fusion buffer by fusion
buffer, whether compressing pays, and by ``python -m jax_cgx.bench model`` to compare
predictions with measurements. ``S`` below is the buffer's bytes in its own dtype, ``F =
4n`` its bytes as float32 (the codec's throughput is measured in float32 bytes):

* psum (a bandwidth-optimal ring, as gloo's and NCCL's): every rank sends and receives
  ``2(W-1)/W * S`` and adds ``(W-1)/W * S`` bytes::

      t_psum = 2(W-1)/W * S / B  +  (W-1)/W * S / copy_rate  +  2(W-1) * latency

* compressed SRA (docs/algorithm.md): a rank quantizes its ``W`` chunks, sends ``W-1``
  encoded chunks in the all_to_all and ``W-1`` in the all_gather (``E = n/W * bits/8 +
  8 * ceil(n/W / bucket_size)`` bytes each), decodes ``W`` encodings of its chunk and
  re-quantizes their sum, and decodes the ``W`` gathered chunks::

      t_sra = F/quantize_rate                       (quantize)
            + (W-1) * E / B + k * latency           (all_to_all)
            + F/reduce_rate                         (fused dequantize-sum-requantize)
            + (W-1) * E / B + k * (W-1) * latency   (all_gather: gloo's ring, W-1 steps)
            + F/dequantize_rate                     (decode)
            + (9 * W * E + S/W) / copy_rate         (copies around the kernels)

  ``k`` is the number of messages each collective is cut into (:mod:`jax_cgx._src.exchange.wire`:
  by default on multi-process CPU, enough for messages of at most 256 KiB); every message
  pays the fixed ``latency`` once per step. The copies are those of the xla backend's
  optimized HLO on CPU: the wire layout (payload || meta), XLA's per-destination slices,
  the segments' reassembly and the unpacking, about nine passes over the ``W`` encoded
  chunks in all; and the rank's own chunk, which the fused kernel takes as a separate
  operand.

* compressed ring (``algorithm="ring"``): the same bytes and about the same codec work, in
  ``2(W-1)`` steps of ``k`` messages each (``W-1`` ppermutes, then gloo's ring all-gather), each
  step paying the latency; over nodes of consecutive ranks only one rank per node sends across
  at each step, so its wire is priced as if every rank had the node's link (:func:`predict_nodes`).

Nothing overlaps on the xla backend's CPU path, so the terms add. ``host_cores`` models
several ranks sharing one machine, as ``benchmarks/netem`` runs them: with ``W`` processes
on ``host_cores`` cores every compute term takes ``max(1, W / host_cores)`` times longer
(each kernel runs on one thread). The model assumes the links, not the switch, are the
bottleneck. Measured against it (docs/results.md, "Cost model"): every median within 25%.
"""

from __future__ import annotations

import dataclasses
import json

from jax_cgx._src.config import ALGORITHMS
from jax_cgx._src.exchange import wire as _wire

__all__ = ["CodecRates", "LinkModel", "encoded_chunk_bytes", "inside_seconds", "predict", "predict_nodes", "OPS",
           "WIRE_COPIES"]


@dataclasses.dataclass(frozen=True)
class CodecRates:
    """Measured throughput, bytes of float32 input per second.

    Args:
      quantize: the codec's quantization rate.
      dequantize: its decoding rate.
      add: memory bandwidth: psum's float32 sums and the copies around the kernels (default 4e9).
      reduce: the fused dequantize-sum-requantize step's rate; None (the default): priced as a decode
        plus ``1/W`` of a quantization.
    """

    quantize: float
    dequantize: float
    add: float = 4e9  # memory bandwidth: psum's float32 sums, the copies around the kernels
    reduce: float | None = None  # the fused step; None: a decode plus 1/W of a quantize

    @classmethod
    def from_codec_json(cls, path: str, bits: int, size_mib: float | None = None) -> CodecRates:
        """Rates of ``bits`` from a ``python -m jax_cgx.bench codec --output`` file (largest size by default)."""
        with open(path) as f:
            rows = [r for r in json.load(f) if r["bits"] == bits]
        if not rows:
            raise ValueError(f"{path} has no rows for bits={bits}")
        row = max(rows, key=lambda r: r["size_mib"]) if size_mib is None else min(
            rows, key=lambda r: abs(r["size_mib"] - size_mib))
        reduce = row.get("reduce_gbps")
        return cls(quantize=row["quantize_gbps"] * 1e9, dequantize=row["dequantize_gbps"] * 1e9,
                   add=row["copy_gbps"] * 1e9, reduce=None if reduce is None else reduce * 1e9)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Per-rank link: bandwidth in bytes/s each way (``inf``: unlimited), and a fixed cost per message.

    Args:
      bandwidth: bytes/s each way (``inf``: unlimited); 1 Gbit/s is ``1e9 / 8``.
      latency: seconds per message (default 2e-4).
    """

    bandwidth: float
    latency: float = 2e-4


def encoded_chunk_bytes(size_bytes: float, world: int, bits: int, bucket_size: int) -> float:
    """Bytes of one rank's encoded chunk of a ``size_bytes`` float32 buffer cut into ``world`` chunks."""
    values = size_bytes / 4 / world
    return values * bits / 8 + -(-values // bucket_size) * 8


# Passes over the W encoded chunks that the xla backend's program makes besides the
# kernels and the transport (counted in its optimized HLO on XLA:CPU); the sharded
# collectives, one collective each, are priced at half.
WIRE_COPIES = 9

# What predict() prices: the all-reduce, and the two collectives of sharded training (one
# collective each: the reduce-scatter is SRA's first half, quantizing the W - 1 blocks it
# sends and decoding W encodings onto its own block; the all-gather quantizes the rank's
# shard once and decodes all W, ``E`` then being one shard's encoding).
OPS = ("psum", "psum_scatter", "all_gather")


def predict(size_bytes: float, world: int, bits: int, bucket_size: int, link: LinkModel,
            rates: CodecRates, host_cores: int | None = None, segments: int = 0, *,
            itemsize: int = 4, message_cap: int | None = _wire.CPU_MESSAGE_BYTES,
            share: float | None = None, op: str = "psum", algorithm: str = "sra") -> dict[str, float]:
    """Predicted seconds: ``psum`` (the uncompressed collective), ``compressed`` and the
    compressed time's parts.

    Args:
      size_bytes: the buffer's bytes per rank, of ``itemsize``-byte values: for ``op="psum"`` the
        buffer per rank, for "psum_scatter" each rank's input (``W`` blocks), for "all_gather" each
        rank's shard.
      world: the number of ranks ``W``.
      bits: bits per quantized value, 1..8.
      bucket_size: values per bucket.
      link: each rank's link.
      rates: the codec's throughput.
      host_cores: all ``world`` ranks share one machine with this many cores (compute
        slows by ``max(1, world / host_cores)``); None: every rank has a core of its own.
      segments: messages per collective, as ``CompressionConfig.pipeline_segments``
        (0: by size, each message at most ``message_cap`` bytes).
      itemsize: bytes per value of the buffer (4, the default: float32).
      message_cap: the most bytes per message where ``segments`` is 0 (default 256 KiB, the xla
        backend's on multi-process CPU); None: one message.
      share: how many ranks share each core, given directly (overrides ``host_cores``).
      op: "psum" (the all-reduce above), "psum_scatter" or "all_gather"; the comment above
        ``OPS`` in jax_cgx/_src/policy/cost_model.py says what the two sharded ones do.
      algorithm: "sra" or "ring" (the all-reduce's steps; the sharded ops are SRA's halves).

    Returns:
      A ``dict``: ``"psum"`` and ``"compressed"`` (seconds), the compressed time's parts
      ``"wire"``, ``"codec"`` and ``"copies"`` (seconds, adding up to ``"compressed"``),
      ``"messages"`` (per collective) and ``"speedup"`` (``psum / compressed``); all 0 (speedup 1.0)
      for ``world < 2``.

    Raises:
      ValueError: an unknown ``op`` or ``algorithm``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}, got {op!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if world < 2:
        return dict(psum=0.0, compressed=0.0, wire=0.0, codec=0.0, copies=0.0, messages=0, speedup=1.0)
    s, w, b = float(size_bytes), world, link.bandwidth
    f = s / itemsize * 4  # the codec's work, in float32 bytes
    if share is None:
        share = 1.0 if host_cores is None else max(1.0, w / host_cores)
    reduce = rates.reduce or 1 / (1 / rates.dequantize + 1 / (w * rates.quantize))
    if op == "psum":
        collectives, lax_bytes, added = 2, 2 * (w - 1) / w * s, (w - 1) / w * s
        enc = encoded_chunk_bytes(f, w, bits, bucket_size)
        codec = f / rates.quantize + f / reduce + f / rates.dequantize
        copied = WIRE_COPIES * w * enc + s / w
    elif op == "psum_scatter":
        collectives, lax_bytes, added = 1, (w - 1) / w * s, (w - 1) / w * s
        enc = encoded_chunk_bytes(f, w, bits, bucket_size)
        codec = (w - 1) / w * f / rates.quantize + f / rates.dequantize  # the peers' blocks; W decoded onto ours
        copied = WIRE_COPIES / 2 * w * enc + s / w
    else:
        collectives, lax_bytes, added = 1, (w - 1) * s, (w - 1) * s  # lax copies the W - 1 received shards
        enc = encoded_chunk_bytes(f, 1, bits, bucket_size)
        codec = f / rates.quantize + w * f / rates.dequantize  # our shard; all W decoded
        copied = WIRE_COPIES / 2 * w * enc
    psum = lax_bytes / b + share * added / rates.add + collectives * (w - 1) * link.latency
    messages = _wire.count(segments, int(enc), message_cap)
    # Rounds of messages: SRA's all_to_all (1 step) and ring all_gather (W-1); the ring algorithm's
    # W-1 ppermutes and the same all_gather. The sharded ops: one collective of W/2 steps on average.
    steps = 2 * (w - 1) if algorithm == "ring" and op == "psum" else w * collectives / 2
    wire = collectives * (w - 1) * enc / b + messages * steps * link.latency
    codec = share * codec
    copies = share * copied / rates.add
    compressed = wire + codec + copies
    return dict(psum=psum, compressed=compressed, wire=wire, codec=codec, copies=copies, messages=messages,
                speedup=psum / compressed if compressed > 0 else float("inf"))


def inside_seconds(size_bytes: float, per_node: int, rates: CodecRates, share: float,
                   inner_bandwidth: float | None) -> float:
    """The hierarchical form's exact reduce-scatter and all-gather inside a node: ``2 (m-1)/m S``
    sent by each rank at ``inner_bandwidth`` bytes/s, measured as the job runs (every node at
    once, on cores shared as in the job: not scaled again); None: at memory speed
    (``rates.add``), slowed by ``share`` as the codec is."""
    sent = 2 * (per_node - 1) / per_node * float(size_bytes)
    return share * sent / rates.add if inner_bandwidth is None else sent / inner_bandwidth


def predict_nodes(size_bytes: float, nodes: int, per_node: int, bits: int, bucket_size: int, link: LinkModel,
                  rates: CodecRates, *, hierarchical: bool = False, host_cores: int | None = None,
                  segments: int = 0, itemsize: int = 4, message_cap: int | None = _wire.CPU_MESSAGE_BYTES,
                  share: float | None = None, inner_bandwidth: float | None = None,
                  cross_bandwidth: float | None = None, algorithm: str = "sra") -> dict[str, float]:
    """:func:`predict` for ``nodes`` nodes of ``per_node`` ranks each, every node on one link of
    ``link.bandwidth`` bytes/s each way (its ranks share it), ranks of one node exchanging at memory
    speed. A reduction over all ``nodes * per_node`` ranks:

    * flat SRA over every rank: the all_to_all sends each rank's ``W - m`` off-node chunks,
      ``m (W - m) E`` over each node's link; the all_gather is gloo's ring, which crosses each
      node's link once per step, ``(W - 1) E`` (``W = n m`` ranks, ``m = per_node``);
    * flat ring (``algorithm="ring"``): every step crosses each node's link once each way, so it is
      :func:`predict`'s with each rank on the node's link (the ring's neighbours are consecutive
      ranks, a node's ranks consecutive); psum is priced as such a ring too;
    * hierarchical: an exact reduce-scatter and all-gather inside the node, ``2 (m-1)/m S`` sent by
      each rank at ``inner_bandwidth`` bytes/s, then :func:`predict`'s compressed all-reduce of
      ``S / m`` over the ``n`` nodes, the ``m`` ranks' exchanges sharing each link (a link of
      ``bandwidth / m`` each). ``inner_bandwidth`` is the rate measured as the job runs: every
      node exchanging inside at once, on cores shared as in the job (NVLink's on GPUs; for CPU
      processes of one machine gloo over loopback TCP, ``policy="auto"``'s inside probe, or
      ``python -m jax_cgx.bench phases --two-level``), so ``share`` does not scale it again.
      None: memory speed (``rates.add``), slowed by ``share`` as the codec is; on the 2x2 CPU
      topology that put the prediction 95% under the measurement (docs/multinode.md).

    ``cross_bandwidth``: bytes/s each rank moves across nodes while every rank of its node does
    (measured by ``policy="auto"`` over the outer axis); None: ``bandwidth / m``, one shared link
    per node. Where each rank has a link of its own it equals ``bandwidth``.
    """
    world = nodes * per_node
    cross = link.bandwidth / per_node if cross_bandwidth is None else cross_bandwidth
    if per_node == 1 or world < 2:
        return predict(size_bytes, world, bits, bucket_size, link, rates, host_cores, segments, itemsize=itemsize,
                       message_cap=message_cap, share=share, algorithm=algorithm)
    if share is None:
        share = 1.0 if host_cores is None else max(1.0, world / host_cores)
    flat = predict(size_bytes, world, bits, bucket_size, link, rates, segments=segments, itemsize=itemsize,
                   message_cap=message_cap, share=share, algorithm=algorithm)
    if not hierarchical and algorithm == "ring":
        return flat
    if not hierarchical:
        f = float(size_bytes) / itemsize * 4
        enc = encoded_chunk_bytes(f, world, bits, bucket_size)
        per_rank_wire = 2 * (world - 1) * enc / link.bandwidth
        shared_wire = (world - per_node) * enc / cross + (world - 1) * enc / link.bandwidth
        wire = flat["wire"] - per_rank_wire + shared_wire
        compressed = wire + flat["codec"] + flat["copies"]
        return dict(flat, wire=wire, compressed=compressed,
                    speedup=flat["psum"] / compressed if compressed > 0 else float("inf"))
    inner = inside_seconds(size_bytes, per_node, rates, share, inner_bandwidth)
    cross = predict(float(size_bytes) / per_node, nodes, bits, bucket_size,
                    LinkModel(cross, link.latency), rates, segments=segments, itemsize=itemsize,
                    message_cap=message_cap, share=share, algorithm=algorithm)
    compressed = inner + cross["compressed"]
    return dict(psum=flat["psum"], compressed=compressed, wire=cross["wire"], codec=cross["codec"],
                copies=cross["copies"] + inner, messages=cross["messages"],
                speedup=flat["psum"] / compressed if compressed > 0 else float("inf"))
