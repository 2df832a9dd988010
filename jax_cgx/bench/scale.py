"""``python -m jax_cgx.bench scale``: the all-reduce predicted past this machine, from the cost model.

For a gradient of ``--params`` float32 values on nodes of ``--per-node`` GPUs, each node on one
link of each ``--gbps`` to the others: the time of an exact psum two ways (a ring over every GPU,
NCCL's ring algorithm, which crosses each node's link with ``2 (W-1)/W`` of the buffer; and a
hierarchical exact one, reduce-scatter over NVLink, ring across the nodes, all-gather, which sends
``2 (n-1)/n`` of it), and of jax_cgx's compressed all-reduce, flat (SRA over every GPU, whose
all_to_all sends ``m`` GPUs' off-node chunks over each node's link), the flat ring (every step
crosses each node's link once, as psum's ring; but it re-quantizes each value at every one of its
``W`` hops, so its error grows with the GPUs: docs/algorithm.md) and hierarchical (exact inside
the node, compressed across the nodes), at each width; the speedups are over the faster of the
two exact ones. The codec's rates are the H100's measured through JAX (docs/gpu-results.md; 2-bit
taken as 4-bit's, not measured). The model and its assumptions:
:func:`jax_cgx._src.policy.cost_model.predict_nodes`; where it would fail: docs/multinode.md.
"""

from __future__ import annotations

import argparse

from jax_cgx._src.arguments import integer, number
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, predict_nodes

# Float32 input bytes per second on one H100, 256 MiB, bucket 512 (docs/gpu-results.md): quantize,
# dequantize and a device copy from the bare launchers of the default (pipelined) build, 2026-11-27;
# the fused W=4 dequantize-sum-requantize as measured through JAX (2026-11-25).
H100_RATES = {
    4: CodecRates(quantize=2**28 / 0.273e-3, dequantize=2**28 / 0.135e-3, add=2**28 / 0.180e-3, reduce=742e9),
    8: CodecRates(quantize=2**28 / 0.289e-3, dequantize=2**28 / 0.141e-3, add=2**28 / 0.180e-3, reduce=742e9),
}
H100_RATES[2] = H100_RATES[4]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=number(1), default=1e9, help="float32 values in the gradient (default 1e9)")
    p.add_argument("--per-node", type=integer(1), default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=integer(1), nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--gbps", type=number(0, above=True), nargs="+", default=[10, 25, 100, 400],
                   help="each node's link to the others, Gbit/s each way")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8], choices=sorted(H100_RATES))
    p.add_argument("--bucket-size", type=integer(1), default=CompressionConfig.bucket_size)
    p.add_argument("--nvlink-gbs", type=number(0, above=True), default=300.0,
                   help="each GPU's exact exchange inside its node, GB/s (default 300: NVLink, NCCL's bus bandwidth)")
    p.add_argument("--latency-us", type=number(0), default=20.0, help="fixed cost per message across nodes (µs)")
    p.add_argument("--output", help="also write the rows to this .json or .csv file")
    p.add_argument("--plot", help="write the speedup over the faster exact psum against GPUs to this PNG, one "
                                  "panel per link rate (needs matplotlib)")


def rows(args: argparse.Namespace) -> list[dict]:
    out = []
    size = args.params * 4
    for gbps in args.gbps:
        link = LinkModel(gbps * 1e9 / 8, args.latency_us * 1e-6)
        for nodes in args.nodes:
            for bits in args.bits:
                rates = H100_RATES[bits]
                kw = dict(segments=1, message_cap=None, share=1.0, inner_bandwidth=args.nvlink_gbs * 1e9)
                flat = predict_nodes(size, nodes, args.per_node, bits, args.bucket_size, link, rates, **kw)
                ring = predict_nodes(size, nodes, args.per_node, bits, args.bucket_size, link, rates,
                                     algorithm="ring", **kw)
                hier = predict_nodes(size, nodes, args.per_node, bits, args.bucket_size, link, rates,
                                     hierarchical=True, **kw)
                m = args.per_node
                exact_hier = (2 * (m - 1) / m * size / (args.nvlink_gbs * 1e9) + 2 * (nodes - 1) / nodes * size
                              / link.bandwidth + 2 * (nodes - 1) * link.latency)
                best = min(flat["psum"], exact_hier)
                out.append(dict(gbps=gbps, nodes=nodes, gpus=nodes * m, bits=bits, psum_ring_s=flat["psum"],
                                psum_hierarchical_s=exact_hier, flat_s=flat["compressed"],
                                ring_s=ring["compressed"], hierarchical_s=hier["compressed"],
                                flat_speedup=best / flat["compressed"], ring_speedup=best / ring["compressed"],
                                hierarchical_speedup=best / hier["compressed"]))
    return out


def main(args: argparse.Namespace) -> None:
    from jax_cgx.bench._table import print_table, save

    records = rows(args)
    print_table(f"predicted all-reduce of {args.params:g} float32 values, nodes of {args.per_node} GPUs "
                f"(cost model; H100 codec rates)",
                ["Gbit/s", "nodes", "GPUs", "bits", "psum ring s", "psum hier. s", "flat s", "ring s", "hier. s",
                 "flat x", "ring x", "hier. x"],
                [[f"{r['gbps']:g}", str(r["nodes"]), str(r["gpus"]), str(r["bits"]), f"{r['psum_ring_s']:.3g}",
                  f"{r['psum_hierarchical_s']:.3g}", f"{r['flat_s']:.3g}", f"{r['ring_s']:.3g}",
                  f"{r['hierarchical_s']:.3g}", f"{r['flat_speedup']:.2f}", f"{r['ring_speedup']:.2f}",
                  f"{r['hierarchical_speedup']:.2f}"] for r in records])
    if args.output:
        save(records, args.output)
    if args.plot:
        plot(records, args.plot)


def plot(records: list[dict], path: str) -> None:
    """Speedup over the faster exact psum against GPUs, flat SRA, flat ring and hierarchical at each width; one
    panel per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["gbps"] for r in records})
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.6), sharey=True, squeeze=False)
    for ax, gbps in zip(axes[0], rates):
        for bits in sorted({r["bits"] for r in records}):
            rs = [r for r in records if r["gbps"] == gbps and r["bits"] == bits]
            gpus = [r["gpus"] for r in rs]
            (line,) = ax.plot(gpus, [r["hierarchical_speedup"] for r in rs], marker="o", label=f"{bits}-bit hierarchical")
            ax.plot(gpus, [r["flat_speedup"] for r in rs], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{bits}-bit flat SRA")
            ax.plot(gpus, [r["ring_speedup"] for r in rs], marker="+", linestyle=":", color=line.get_color(),
                    label=f"{bits}-bit flat ring")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{gbps:g} Gbit/s between nodes")
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("x faster than exact psum")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("predicted all-reduce of a 1B-parameter float32 gradient (cost model, H100 codec rates)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
