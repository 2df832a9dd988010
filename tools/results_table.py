"""Markdown table of `python -m jax_cgx.bench allreduce --output X.json` results.

    python tools/results_table.py results_w2.json results_w4.json > table.md

One row per (ranks, size, bits): psum time, then each backend's time and its speedup
over psum measured in the same run.
"""

import json
import sys
from collections import defaultdict


def main(paths: list[str]) -> None:
    rows = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                row = rows[(r["devices"], r["size_mib"], r["bits"])]
                row["psum"] = r["psum_ms"]
                row[r["backend"]] = r["compressed_ms"]
    backends = sorted({b for row in rows.values() for b in row if b != "psum"})
    head = ["ranks", "MiB", "bits", "psum ms"] + [f"{b} ms | x psum" for b in backends]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (world, mib, bits), row in sorted(rows.items()):
        cells = [str(world), f"{mib:g}", str(bits), f"{row['psum']:.2f}"]
        cells += [f"{row[b]:.2f} ({row['psum'] / row[b]:.2f}x)" if b in row else "-" for b in backends]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
