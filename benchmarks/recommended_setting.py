"""Which setting should be the default: every leaf at 4 bits in buckets of 512 (the earlier default),
small leaves exact and the rest at 4 bits in buckets of 128 (torch_cgx's layer filter,
``layer_filter(CompressionConfig(bits=4, bucket_size=128), 1024)``, or ``CompressionConfig()``'s own
``min_size=1024``, today's default), against the exact mean.

    python benchmarks/recommended_setting.py [--seeds 0 1 2] [--models digits cnn charlm] [--settings 0 1 2 3]
        [--json out.json]

Trains each example (8 simulated CPU devices, the examples' own defaults otherwise) with each
setting and seed, and prints one row per model and setting: the median final quality over the
seeds (the digits MLP's and the CNN's test accuracy, the character LM's validation loss) and the
bytes one device sends per step. docs/choosing-settings.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = {  # name -> (bits, bucket size, torch_cgx's layer filter: 0 = off, min_size)
    "exact": (32, 512, 0, 16),
    "4-bit/512, every leaf (the earlier default)": (4, 512, 0, 16),
    "4-bit/128, small leaves exact (layer_filter, 1024)": (4, 128, 1024, 1024),
    "CompressionConfig() (4-bit/128, leaves under 1024 values exact)": (4, 128, 0, 1024),
}
MODELS = {  # name -> (script, how its settings are passed, the final line's quality, its unit, higher is better)
    "digits": ("train_digits.py", "common", r"test accuracy ([\d.]+)%", "test accuracy %", True),
    "cnn": ("train_flax_cnn.py", "own", r"test accuracy ([\d.]+)%", "test accuracy %", True),
    "charlm": ("train_charlm.py", "common", r"validation loss ([\d.]+) nats", "validation nats/char", False),
}


def arguments(how: str, bits: int, bucket: int, layer_min_size: int, min_size: int) -> list[str]:
    own = ["--bits", str(bits), "--bucket-size", str(bucket), "--layer-min-size", str(layer_min_size),
           "--min-size", str(min_size)]
    if how == "own":
        return own
    return ["--compressor", "none"] if bits == 32 else ["--compressor", "maxmin", *own]


def run(model: str, setting: str, seed: int) -> tuple[float, float | None]:
    script, how, pattern, _, _ = MODELS[model]
    command = [sys.executable, str(ROOT / "examples" / script), *arguments(how, *SETTINGS[setting]), "--seed",
               str(seed)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    final = next(line for line in out.splitlines() if line.startswith("final:"))
    kib = re.search(r"([\d.]+) KiB on the wire", out)
    return float(re.search(pattern, final).group(1)), (float(kib.group(1)) if kib else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--settings", nargs="+", type=int, default=list(range(len(SETTINGS))),
                        help="which settings, by position: " + "; ".join(f"{i}: {name}" for i, name in enumerate(SETTINGS)))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    rows = []
    print("| model | setting | median final quality | each seed | KiB per device per step |")
    print("|---|---|---|---|---|")
    for model in args.models:
        for setting in [name for i, name in enumerate(SETTINGS) if i in args.settings]:
            results = [run(model, setting, seed) for seed in args.seeds]
            quality = [q for q, _ in results]
            kib = results[0][1]
            rows.append({"model": model, "setting": setting, "quality": quality, "kib": kib,
                         "unit": MODELS[model][3]})
            print(f"| {model} | {setting} | {statistics.median(quality):.4g} {MODELS[model][3]} | "
                  f"{', '.join(f'{q:.4g}' for q in quality)} | {'-' if kib is None else f'{kib:.1f}'} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
