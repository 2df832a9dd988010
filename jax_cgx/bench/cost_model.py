"""A cost model of compressed_psum and psum on a bandwidth-limited link.

Predicts the time of one all-reduce of ``S`` bytes of float32 per rank over ``W`` ranks,
each rank's link limited to ``B`` bytes/s in each direction (what
``benchmarks/netem`` emulates with tc tbf), from measured codec throughput:

* psum (a bandwidth-optimal ring, as gloo's and NCCL's): every rank sends and receives
  ``2(W-1)/W * S`` and adds ``(W-1)/W * S`` bytes::

      t_psum = 2(W-1)/W * S / B  +  (W-1)/W * S / add_rate  +  2(W-1) * latency

* compressed SRA (docs/algorithm.md): a rank quantizes its ``W`` chunks (``S`` bytes of
  input), sends ``W-1`` encoded chunks in the all_to_all and ``W-1`` in the all_gather
  (``E = (S/4)/W * (bits/8 + 8/bucket_size)`` bytes each), decodes ``W`` encodings of its
  chunk and re-quantizes their sum, and decodes the ``W`` gathered chunks::

      t_sra = S/quantize_rate                       (quantize)
            + (W-1) * E / B + latency               (all_to_all)
            + S/dequantize_rate + S/W/quantize_rate (fused dequantize-sum-requantize)
            + (W-1) * E / B + latency               (all_gather)
            + S/dequantize_rate                     (decode)

Rates are in bytes of float32 input per second, from ``python -m jax_cgx.bench codec``
(``quantize_gbps``, ``dequantize_gbps``). The model ignores overlap (nothing overlaps on the
xla backend's CPU path) and assumes the link, not the switch, is the bottleneck.
``python -m jax_cgx.bench model`` prints predictions, and compares them with measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

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
    add: float = 4e9  # a float32 sum, for psum's reductions (memory bound)

    @classmethod
    def from_codec_json(cls, path: str, bits: int, size_mib: float | None = None) -> CodecRates:
        """Rates of ``bits`` from a ``python -m jax_cgx.bench codec --output`` file (largest size by default)."""
        with open(path) as f:
            rows = [r for r in json.load(f) if r["bits"] == bits]
        if not rows:
            raise ValueError(f"{path} has no rows for bits={bits}")
        row = max(rows, key=lambda r: r["size_mib"]) if size_mib is None else min(
            rows, key=lambda r: abs(r["size_mib"] - size_mib))
        return cls(quantize=row["quantize_gbps"] * 1e9, dequantize=row["dequantize_gbps"] * 1e9,
                   add=row["copy_gbps"] * 1e9)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Per-rank link: bandwidth in bytes/s each way, and a fixed cost per collective step."""

    bandwidth: float
    latency: float = 2e-4


def encoded_chunk_bytes(size_bytes: float, world: int, bits: int, bucket_size: int) -> float:
    values = size_bytes / 4 / world
    return values * bits / 8 + -(-values // bucket_size) * 8


def predict(size_bytes: float, world: int, bits: int, bucket_size: int, link: LinkModel,
            rates: CodecRates) -> dict[str, float]:
    """Predicted seconds: ``psum``, ``compressed`` and the compressed time's parts."""
    if world < 2:
        return dict(psum=0.0, compressed=0.0, wire=0.0, codec=0.0, speedup=1.0)
    s, w, b = float(size_bytes), world, link.bandwidth
    psum = 2 * (w - 1) / w * s / b + (w - 1) / w * s / rates.add + 2 * (w - 1) * link.latency
    enc = encoded_chunk_bytes(s, w, bits, bucket_size)
    wire = 2 * ((w - 1) * enc / b + link.latency)
    codec = s / rates.quantize + (s / rates.dequantize + s / w / rates.quantize) + s / rates.dequantize
    compressed = wire + codec
    return dict(psum=psum, compressed=compressed, wire=wire, codec=codec, speedup=psum / compressed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec-json", required=True, help="output of `python -m jax_cgx.bench codec --output`")
    p.add_argument("--link", type=parse_rate, default=parse_rate("1gbit"), help="per-rank rate, e.g. 1gbit")
    p.add_argument("--latency-ms", type=float, default=0.2, help="fixed cost per collective step")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--measured", nargs="*", default=[],
                   help="`bench allreduce --output` JSON files to compare with (rows matched on world/size/bits)")


def main(args: argparse.Namespace) -> None:
    from jax_cgx.bench._table import print_table

    measured = {}
    for path in args.measured:
        with open(path) as f:
            for r in json.load(f):
                measured[(r["devices"], round(r["size_mib"], 3), r["bits"])] = r
    link = LinkModel(args.link, args.latency_ms / 1e3)
    rows = []
    for world in args.world:
        for mib in args.sizes_mib:
            for bits in args.bits:
                rates = CodecRates.from_codec_json(args.codec_json, bits)
                p = predict(mib * 2**20, world, bits, args.bucket_size, link, rates)
                m = measured.get((world, round(mib, 3), bits))
                row = [str(world), f"{mib:g}", str(bits), f"{p['psum'] * 1e3:.1f}", f"{p['compressed'] * 1e3:.1f}",
                       f"{p['speedup']:.2f}"]
                if m:
                    row += [f"{m['psum_ms']:.1f} ({m['psum_ms'] / (p['psum'] * 1e3) - 1:+.0%})",
                            f"{m['compressed_ms']:.1f} ({m['compressed_ms'] / (p['compressed'] * 1e3) - 1:+.0%})",
                            f"{m['speedup']:.2f}"]
                else:
                    row += ["-", "-", "-"]
                rows.append(row)
    print_table(f"cost model: link {args.link * 8 / 1e9:g} Gbit/s per rank, bucket {args.bucket_size}",
                ["ranks", "MiB", "bits", "psum ms", "cgx ms", "speedup", "measured psum (vs model)",
                 "measured cgx (vs model)", "measured speedup"], rows)
