"""Markdown table of `python -m jax_cgx.bench allreduce --output X.json` results, or of
`benchmarks/train_step.py --output X.json`'s.

    python tools/results_table.py results_w2.json results_w4.json > table.md

All-reduce results: one row per (op, ranks, size, bits): psum time, then each backend's time and its
speedup over psum measured in the same run. Training steps: one row per compressor.
"""

import json
import sys
from collections import defaultdict


def step_table(records: list[dict]) -> None:
    print("| compressor | step ms | p10-p90 ms | x none | wire MiB per device | loss (last 10) | platform |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in records:
        speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        print(f"| {r['description']} | {r['step_ms']:.1f} | {r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f} | "
              f"{speedup} | {r['wire_bytes'] / 2**20:.2f} | {r['final_loss']:.4f} | {r['platform']} |")


def main(paths: list[str]) -> None:
    rows = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            records = json.load(f)
        if records and "step_ms" in records[0]:
            step_table(records)
            continue
        for r in records:
            row = rows[(r.get("op", "psum"), r["devices"], r["size_mib"], r["bits"])]
            row["psum"] = r["psum_ms"]
            row[r["backend"]] = r["compressed_ms"]
    if not rows:
        return
    backends = sorted({b for row in rows.values() for b in row if b != "psum"})
    head = ["op", "ranks", "MiB", "bits", "psum ms"] + [f"{b} ms (x psum)" for b in backends]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (op, world, mib, bits), row in sorted(rows.items()):
        cells = [op, str(world), f"{mib:g}", str(bits), f"{row['psum']:.2f}"]
        cells += [f"{row[b]:.2f} ({row['psum'] / row[b]:.2f}x)" if b in row else "-" for b in backends]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
