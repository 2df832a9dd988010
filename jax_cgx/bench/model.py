"""``python -m jax_cgx.bench model``: the all-reduce cost model's predictions, against measurements.

The model itself, its formula and its assumptions are in :mod:`jax_cgx._src.policy.cost_model`
(``policy="auto"`` decides with it). Rates are bytes per second of the float32 buffer,
from ``python -m jax_cgx.bench codec`` (``quantize_gbps``, ``dequantize_gbps``,
``reduce_gbps``, ``copy_gbps``). ``--host-cores`` models several ranks sharing one
machine, as ``benchmarks/netem`` runs them.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from jax_cgx._src.arguments import integer, number
from jax_cgx._src.config import ALGORITHMS, CompressionConfig
from jax_cgx._src.config.limits import QUANTIZED_BITS
from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, encoded_chunk_bytes, predict, predict_nodes
from jax_cgx.bench.rates import tc_rate_bits

__all__ = ["CodecRates", "LinkModel", "encoded_chunk_bytes", "predict", "parse_rate"]

def parse_rate(text: str) -> float:
    """A tc rate ('1gbit', '10gbit', '100mbit', 'unlimited': :func:`~jax_cgx.bench.rates.tc_rate_bits`)
    in bytes per second; ``inf`` for no limit."""
    bits = tc_rate_bits(text)
    return float("inf") if bits is None else bits / 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec-json", required=True, help="output of `python -m jax_cgx.bench codec --output`")
    p.add_argument("--link", type=parse_rate, default=parse_rate("1gbit"), help="per-rank rate, e.g. 1gbit")
    p.add_argument("--latency-ms", type=number(0), default=0.2, help="fixed cost per message and collective step")
    p.add_argument("--segments", type=integer(0), default=0,
                   help="messages per collective (pipeline_segments; 0: the xla backend's CPU default)")
    p.add_argument("--world", type=integer(1), nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=number(0, above=True), nargs="+", default=[64])
    p.add_argument("--bits", type=int, choices=QUANTIZED_BITS, nargs="+", default=[4, 8], metavar="BITS")
    p.add_argument("--bucket-size", type=integer(1), default=CompressionConfig.bucket_size)
    p.add_argument("--host-cores", type=int, default=None,
                   help="all ranks share one machine with this many cores (as benchmarks/netem runs "
                        "them); default: a core per rank")
    p.add_argument("--per-node", type=integer(1), default=1,
                   help="ranks per node, sharing its link (benchmarks/netem/run.py --nodes N --per-node M); "
                        "--world is then the ranks in all")
    p.add_argument("--hierarchical", action="store_true",
                   help="with --per-node: the hierarchical all-reduce (exact inside a node) instead of flat")
    p.add_argument("--inner-gbps", type=number(0, above=True), default=None,
                   help="with --hierarchical: what each rank sends inside its node per second, GB/s, with every "
                        "node at once on cores shared as in the job (what policy='auto' measures; CPU processes: "
                        "`bench phases --two-level` prints it); default: memory speed")
    p.add_argument("--algorithm", choices=ALGORITHMS, nargs="+", default=list(ALGORITHMS),
                   help="the compressed forms to predict, a row each (default: %(default)s)")
    p.add_argument("--measured", nargs="*", default=[],
                   help="`bench allreduce --output` JSON files to compare with (rows matched on world/size/bits)")


def main(args: argparse.Namespace) -> None:
    from jax_cgx.bench._table import print_table

    measured: dict[tuple, list[dict]] = {}
    for path in args.measured:
        with open(path) as f:
            for r in json.load(f):
                # "sra", "ring", "hierarchical sra", "hierarchical ring"; auto's rows aside
                form = str(r.get("algorithm", "sra")).split()
                form += ["sra"] if form == ["hierarchical"] else []  # older files: "hierarchical" was SRA
                if form[-1] not in ALGORITHMS or (form[0] == "hierarchical") != args.hierarchical:
                    continue
                if args.per_node > 1 and r.get("mesh") != f"{r['devices'] // args.per_node}x{args.per_node}":
                    continue
                measured.setdefault((r["devices"], round(r["size_mib"], 3), r["bits"], form[-1]), []).append(r)
    link = LinkModel(args.link, args.latency_ms / 1e3)

    def versus(values: list[float], predicted_ms: float) -> str:
        """Every run's time, and how far their median is from the prediction."""
        median = float(np.median(values))
        runs = " / ".join(f"{v:.1f}" for v in values)
        return f"{runs} ({median / predicted_ms - 1:+.0%})" if len(values) == 1 else \
            f"{runs} (median {median:.1f}, {median / predicted_ms - 1:+.0%})"

    rows = []
    for world, mib, bits, algorithm in itertools.product(args.world, args.sizes_mib, args.bits, args.algorithm):
        rates = CodecRates.from_codec_json(args.codec_json, bits)
        if args.per_node > 1:
            p = predict_nodes(mib * 2**20, world // args.per_node, args.per_node, bits, args.bucket_size,
                              link, rates, hierarchical=args.hierarchical, host_cores=args.host_cores,
                              segments=args.segments, algorithm=algorithm,
                              inner_bandwidth=None if args.inner_gbps is None else args.inner_gbps * 1e9)
        else:
            p = predict(mib * 2**20, world, bits, args.bucket_size, link, rates, args.host_cores,
                        args.segments, algorithm=algorithm)
        runs = measured.get((world, round(mib, 3), bits, algorithm), [])
        row = [str(world), f"{mib:g}", str(bits), algorithm, f"{p['psum'] * 1e3:.1f}",
               f"{p['compressed'] * 1e3:.1f}", f"{p['speedup']:.2f}"]
        if runs:
            row += [versus([r["psum_ms"] for r in runs], p["psum"] * 1e3),
                    versus([r["compressed_ms"] for r in runs], p["compressed"] * 1e3),
                    " / ".join(f"{r['speedup']:.2f}" for r in runs)]
        else:
            row += ["-", "-", "-"]
        rows.append(row)
    print_table(f"cost model: link {args.link * 8 / 1e9:g} Gbit/s per rank, bucket {args.bucket_size}",
                ["ranks", "MiB", "bits", "algorithm", "psum ms", "cgx ms", "speedup", "measured psum (vs model)",
                 "measured cgx (vs model)", "measured speedup"], rows)
