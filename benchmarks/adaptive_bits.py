"""Uniform against adaptive bit widths on the char (or, with ``-- --words V``, word) transformer:
validation loss after the same steps.

Runs ``examples/train_charlm.py`` once per spec and seed, each in its own process, and prints the
median validation loss per spec with the plan changes and compiled steps of the adaptive runs::

    python benchmarks/adaptive_bits.py --specs none maxmin:4 adaptive:4 adaptive:3 maxmin:8 --seeds 0 1 2 \\
        --output benchmarks/results/adaptive_bits.json

Specs: ``none`` (pmean), ``maxmin:BITS`` (uniform), ``adaptive:BUDGET`` (``--adaptive BUDGET``:
jax_cgx.adaptive.Planner within uniform BUDGET bits' bytes), ``relative:BUDGET`` (the same with
``--adaptive-objective relative``). Arguments after ``--`` go to every run (e.g. ``--words 4096
--adaptive-bucket-sizes 64 128 256 512 1024 4096``: the word-level model, each leaf's bucket size
planned too).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def spec_flags(spec: str) -> list[str]:
    name, _, value = spec.partition(":")
    if name == "none" and not value:
        return ["--compressor", "none"]
    if name == "maxmin" and value.isdigit():
        return ["--compressor", "maxmin", "--bits", value]
    if name in ("adaptive", "relative") and re.fullmatch(r"\d+(\.\d+)?", value):
        return ["--compressor", "maxmin", "--adaptive", value] + (["--adaptive-objective", "relative"]
                                                                    if name == "relative" else [])
    raise ValueError(f"{spec!r} is not none, maxmin:BITS, adaptive:BUDGET or relative:BUDGET")


def run_one(spec: str, seed: int, extra: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "examples" / "train_charlm.py"), *spec_flags(spec), "--seed", str(seed),
           "--no-progress", "--log-every", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"adaptive_bits: {spec} seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    final = re.search(r"validation loss ([\d.]+) nats/(?:char|word).*step ([\d.]+) ms", proc.stdout)
    wire = re.search(r"([\d.]+ \w+) on the wire per device per step \(", proc.stdout)
    plan = re.search(r"adaptive: (\d+) plan changes, (\d+) compiled steps", proc.stdout)
    return dict(spec=spec, seed=seed, val_loss=float(final.group(1)), step_ms=float(final.group(2)),
                wire=wire.group(1) if wire else None, plan_changes=int(plan.group(1)) if plan else None,
                compiled_steps=int(plan.group(2)) if plan else None, command=" ".join(cmd[1:]))


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", nargs="+", default=["none", "maxmin:4", "adaptive:4", "adaptive:3", "maxmin:8"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--output", help="the runs as JSON")
    args = p.parse_args(argv)
    for spec in args.specs:
        try:
            spec_flags(spec)
        except ValueError as err:
            p.error(str(err))
    runs = []
    for seed in args.seeds:  # seed by seed: every spec sees the same load on the machine
        for spec in args.specs:
            runs.append(run_one(spec, seed, extra))
            r = runs[-1]
            print(f"{spec:>12} seed {seed}: validation loss {r['val_loss']:.4f}, step {r['step_ms']:.1f} ms"
                  + (f", {r['plan_changes']} plan changes, {r['compiled_steps']} compiled steps"
                     if r["plan_changes"] is not None else ""), flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps(runs, indent=1))
    base = [r["val_loss"] for r in runs if r["spec"] == "none"]
    print(f"\n{'spec':>12} {'median val loss':>16} {'vs none':>8} {'runs':>6}")
    for spec in args.specs:
        losses = [r["val_loss"] for r in runs if r["spec"] == spec]
        rel = f"{np.median(losses) / np.median(base) - 1:+.2%}" if base else "-"
        print(f"{spec:>12} {np.median(losses):>16.4f} {rel:>8} {len(losses):>6}")
    return runs


if __name__ == "__main__":
    main()
