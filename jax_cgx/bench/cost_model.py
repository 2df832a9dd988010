"""A cost model of compressed_psum and psum on a bandwidth-limited link.

Predicts the time of one all-reduce of ``S`` bytes of float32 per rank over ``W`` ranks,
each rank's link limited to ``B`` bytes/s in each direction (what
``benchmarks/netem`` emulates with tc tbf), from measured codec throughput:

* psum (a bandwidth-optimal ring, as gloo's and NCCL's): every rank sends and receives
  ``2(W-1)/W * S`` and adds ``(W-1)/W * S`` bytes::

      t_psum = 2(W-1)/W * S / B  +  (W-1)/W * S / copy_rate  +  2(W-1) * latency

* compressed SRA (docs/algorithm.md): a rank quantizes its ``W`` chunks (``S`` bytes of
  input), sends ``W-1`` encoded chunks in the all_to_all and ``W-1`` in the all_gather
  (``E = (S/4)/W * (bits/8 + 8/bucket_size)`` bytes each), decodes ``W`` encodings of its
  chunk and re-quantizes their sum, and decodes the ``W`` gathered chunks::

      t_sra = S/quantize_rate                       (quantize)
            + (W-1) * E / B + k * latency           (all_to_all)
            + S/reduce_rate                         (fused dequantize-sum-requantize)
            + (W-1) * E / B + k * (W-1) * latency   (all_gather: gloo's ring, W-1 steps)
            + S/dequantize_rate                     (decode)
            + (9 * W * E + S/W) / copy_rate         (copies around the kernels)

  ``k`` is the number of messages each collective is cut into (jax_cgx.collectives.wire: by
  default on multi-process CPU, enough for messages of at most 256 KiB); every message
  pays the fixed ``latency`` once per step. The copies are those of the xla backend's
  optimized HLO on CPU: the wire layout (payload || meta), XLA's per-destination slices,
  the segments' reassembly and the unpacking, about nine passes over the ``W`` encoded
  chunks in all; and the rank's own chunk, which the fused kernel takes as a separate
  operand.

Rates are bytes per second of the float32 buffer, from ``python -m jax_cgx.bench codec``
(``quantize_gbps``, ``dequantize_gbps``, ``reduce_gbps``, ``copy_gbps``). Nothing
overlaps on the xla backend's CPU path, so the terms add. ``host_cores`` models several
ranks sharing one machine, as ``benchmarks/netem`` runs them: with ``W`` processes on
``host_cores`` cores every compute term takes ``max(1, W / host_cores)`` times longer
(each kernel runs on one thread). The model assumes the links, not the switch, are the
bottleneck. ``python -m jax_cgx.bench model`` prints predictions and compares them
with measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import numpy as np

from jax_cgx.collectives import wire as _wire

__all__ = ["CodecRates", "LinkModel", "predict", "parse_rate"]

_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A tc-style rate ('1gbit', '10gbit', '100mbit', 'unlimited') in bytes per second."""
    t = text.strip().lower()
    if t in ("unlimited", "inf", "none"):
        return float("inf")
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps|b)?", t)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (e.g. 1gbit, 10gbit, 125MB, unlimited)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    # tc's units: "bit" or a bare number are bits per second; "bps" and "b" bytes per second.
    return value / 8 if m.group(3) in ("bit", None) else value


@dataclasses.dataclass(frozen=True)
class CodecRates:
    """Measured throughput, bytes of float32 input per second."""

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
    """Per-rank link: bandwidth in bytes/s each way, and a fixed cost per collective step."""

    bandwidth: float
    latency: float = 2e-4


def encoded_chunk_bytes(size_bytes: float, world: int, bits: int, bucket_size: int) -> float:
    values = size_bytes / 4 / world
    return values * bits / 8 + -(-values // bucket_size) * 8


# Passes over the W encoded chunks that the xla backend's program makes besides the
# kernels and the transport (counted in its optimized HLO on XLA:CPU).
WIRE_COPIES = 9


def predict(size_bytes: float, world: int, bits: int, bucket_size: int, link: LinkModel,
            rates: CodecRates, host_cores: int | None = None, segments: int = 0) -> dict[str, float]:
    """Predicted seconds: ``psum``, ``compressed`` and the compressed time's parts.

    ``host_cores``: all ``world`` ranks share one machine with this many cores (compute
    slows by ``max(1, world / host_cores)``); None: every rank has a core of its own.
    ``segments``: messages per collective, as ``CompressionConfig.pipeline_segments``
    (0: the xla backend's default on multi-process CPU).
    """
    if world < 2:
        return dict(psum=0.0, compressed=0.0, wire=0.0, codec=0.0, copies=0.0, messages=0, speedup=1.0)
    s, w, b = float(size_bytes), world, link.bandwidth
    share = 1.0 if host_cores is None else max(1.0, w / host_cores)
    psum = 2 * (w - 1) / w * s / b + share * (w - 1) / w * s / rates.add + 2 * (w - 1) * link.latency
    enc = encoded_chunk_bytes(s, w, bits, bucket_size)
    messages = _wire.count(segments, int(enc), _wire.CPU_MESSAGE_BYTES)
    wire = 2 * (w - 1) * enc / b + messages * w * link.latency
    reduce = rates.reduce or 1 / (1 / rates.dequantize + 1 / (w * rates.quantize))
    codec = share * (s / rates.quantize + s / reduce + s / rates.dequantize)
    copies = share * (WIRE_COPIES * w * enc + s / w) / rates.add
    compressed = wire + codec + copies
    return dict(psum=psum, compressed=compressed, wire=wire, codec=codec, copies=copies, messages=messages,
                speedup=psum / compressed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec-json", required=True, help="output of `python -m jax_cgx.bench codec --output`")
    p.add_argument("--link", type=parse_rate, default=parse_rate("1gbit"), help="per-rank rate, e.g. 1gbit")
    p.add_argument("--latency-ms", type=float, default=0.2, help="fixed cost per message and collective step")
    p.add_argument("--segments", type=int, default=0,
                   help="messages per collective (pipeline_segments; 0: the xla backend's CPU default)")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--host-cores", type=int, default=None,
                   help="all ranks share one machine with this many cores (as benchmarks/netem runs "
                        "them); default: a core per rank")
    p.add_argument("--measured", nargs="*", default=[],
                   help="`bench allreduce --output` JSON files to compare with (rows matched on world/size/bits)")


def main(args: argparse.Namespace) -> None:
    from jax_cgx.bench._table import print_table

    measured: dict[tuple, list[dict]] = {}
    for path in args.measured:
        with open(path) as f:
            for r in json.load(f):
                measured.setdefault((r["devices"], round(r["size_mib"], 3), r["bits"]), []).append(r)
    link = LinkModel(args.link, args.latency_ms / 1e3)

    def versus(values: list[float], predicted_ms: float) -> str:
        """Every run's time, and how far their median is from the prediction."""
        median = float(np.median(values))
        runs = " / ".join(f"{v:.1f}" for v in values)
        return f"{runs} ({median / predicted_ms - 1:+.0%})" if len(values) == 1 else \
            f"{runs} (median {median:.1f}, {median / predicted_ms - 1:+.0%})"

    rows = []
    for world in args.world:
        for mib in args.sizes_mib:
            for bits in args.bits:
                rates = CodecRates.from_codec_json(args.codec_json, bits)
                p = predict(mib * 2**20, world, bits, args.bucket_size, link, rates, args.host_cores, args.segments)
                runs = measured.get((world, round(mib, 3), bits), [])
                row = [str(world), f"{mib:g}", str(bits), f"{p['psum'] * 1e3:.1f}", f"{p['compressed'] * 1e3:.1f}",
                       f"{p['speedup']:.2f}"]
                if runs:
                    row += [versus([r["psum_ms"] for r in runs], p["psum"] * 1e3),
                            versus([r["compressed_ms"] for r in runs], p["compressed"] * 1e3),
                            " / ".join(f"{r['speedup']:.2f}" for r in runs)]
                else:
                    row += ["-", "-", "-"]
                rows.append(row)
    print_table(f"cost model: link {args.link * 8 / 1e9:g} Gbit/s per rank, bucket {args.bucket_size}",
                ["ranks", "MiB", "bits", "psum ms", "cgx ms", "speedup", "measured psum (vs model)",
                 "measured cgx (vs model)", "measured speedup"], rows)
