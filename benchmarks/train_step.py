"""Training-step time of examples/train_charlm.py with each gradient compressor, side by side.

    python -m jax_cgx.launch -n 2 benchmarks/train_step.py                      # 2 processes, local links
    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/train_step.py -- --steps 30

Every process (one device each) trains the character transformer of examples/train_charlm.py,
larger by default (d_model 256: 1.6 M parameters, 6.3 MiB of float32 gradients), once per
compressor in ``--compressors``, in the same processes, one step of each in turn: the step
times compare directly. A compressor is ``none`` (pmean), ``maxmin:BITS``, ``cast`` (bfloat16) or
``powersgd:RANK``. Each run takes ``--steps`` steps from the same initialization and batches;
the table gives the median step time without the first ``--warmup`` steps (compilation),
the speedup over ``none``, the bytes one device sends per step and the mean training loss of
the last 10 steps. With ``--output`` process 0 writes the rows as JSON (or CSV).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", nargs="+", default=["none", "maxmin:4", "maxmin:8", "cast", "powersgd:2"],
                   help="none, maxmin:BITS, cast, powersgd:RANK (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="steps per compressor (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--d-model", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--output", help="process 0 writes the rows to this .json or .csv file")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p.parse_args(argv)


def example_args(spec: str, args: argparse.Namespace, world: int) -> argparse.Namespace:
    """train_charlm's arguments for one compressor spec (``maxmin:4``, ``powersgd:2``, ...)."""
    import train_charlm

    name, _, value = spec.partition(":")
    argv = ["--compressor", name, "--steps", str(args.steps), "--batch", str(args.batch),
            "--context", str(args.context), "--d-model", str(args.d_model), "--layers", str(args.layers),
            "--devices", str(world), "--log-every", "0", "--no-progress"]
    if name == "maxmin":
        argv += ["--bits", value or "4"]
    elif name == "powersgd":
        argv += ["--rank", value or "1"]
    elif value or name not in ("none", "cast"):
        sys.exit(f"train_step: {spec!r} is not none, maxmin:BITS, cast or powersgd:RANK")
    return train_charlm.parse_args(argv)


class Trainer:
    """One compressor's data-parallel training of the char transformer, a step at a time."""

    def __init__(self, spec: str, args: argparse.Namespace, corpus):
        """``corpus``: ``train_charlm.load_corpus()``'s result, read once for every compressor."""
        import _common
        import jax
        import optax
        import train_charlm

        devices = jax.devices()
        if args.batch % len(devices):
            sys.exit(f"train_step: --batch {args.batch} must be a multiple of the {len(devices)} devices")
        self.spec, self.ex = spec, example_args(spec, args, len(devices))
        ex = self.ex
        self.train_ids, _, vocab = corpus

        def loss_fn(params, tokens):
            logits = train_charlm.logits_fn(params, tokens[:, :-1], ex.heads)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        compressor, optimizer = _common.make_optimizer(ex, optax.cosine_decay_schedule(ex.lr, ex.steps))
        self.dp = _common.DataParallel(loss_fn, compressor, optimizer, devices)
        params = train_charlm.init_params(jax.random.key(0), len(vocab), ex.d_model, ex.layers, ex.context)
        self.params, self.state = self.dp.init(params, (np.zeros((ex.batch, ex.context + 1), np.int32),))
        self.rng = np.random.default_rng(0)  # the same batches on every process and for every compressor
        self.times, self.losses = [], []

    def step(self) -> None:
        import jax

        ex, offsets = self.ex, np.arange(self.ex.context + 1)
        starts = self.rng.integers(0, len(self.train_ids) - ex.context - 1, ex.batch)
        batch = self.dp.shard(self.train_ids[starts[:, None] + offsets])
        t0 = time.perf_counter()
        self.params, self.state, loss = jax.block_until_ready(self.dp.step(self.params, self.state, batch))
        self.times.append(time.perf_counter() - t0)
        self.losses.append(float(loss))

    def record(self, warmup: int) -> dict:
        import _common
        import jax

        devices = jax.devices()
        timed = np.asarray(self.times[warmup:]) * 1e3
        return dict(compressor=self.spec, description=_common.describe(self.ex), devices=len(devices),
                    platform=devices[0].platform, parameters=int(sum(v.size for v in jax.tree.leaves(self.params))),
                    steps=self.ex.steps, batch=self.ex.batch, step_ms=float(np.median(timed)),
                    step_ms_p10=float(np.percentile(timed, 10)), step_ms_p90=float(np.percentile(timed, 90)),
                    first_step_s=self.times[0], wire_bytes=int(_common.wire_bytes(self.ex, self.params, self.dp.world)),
                    final_loss=float(np.mean(self.losses[-10:])))


def main(argv=None) -> list[dict]:
    import jax_cgx

    args = parse_args(argv)
    if args.steps <= args.warmup:
        sys.exit(f"train_step: --steps {args.steps} must exceed --warmup {args.warmup}")
    jax_cgx.distributed.initialize()
    import jax

    from jax_cgx.bench._table import print_table, save

    lead = jax.process_index() == 0
    import train_charlm

    corpus = train_charlm.load_corpus()
    trainers = [Trainer(spec, args, corpus) for spec in args.compressors]
    # Round robin, one step of each compressor in turn: every compressor sees the same load on the
    # machine and the link over the run, so the ratios are measured side by side.
    for i in range(args.steps):
        for t in trainers:
            t.step()
        if lead and args.progress:
            print(f"train_step: step {i + 1}/{args.steps}", file=sys.stderr, flush=True)
    records = [t.record(args.warmup) for t in trainers]
    base = next((r["step_ms"] for r in records if r["compressor"] == "none"), None)
    for r in records:
        r["speedup"] = base / r["step_ms"] if base else None
    if not lead:
        return records
    r0 = records[0]
    print_table(
        f"training step, char transformer ({r0['parameters']:,} parameters), {r0['devices']} x {r0['platform']}, "
        f"batch {r0['batch']}, median of {args.steps - args.warmup} steps",
        ["compressor", "step ms", "p10-p90 ms", "speedup", "wire per device per step", "loss (last 10)"],
        [[r["description"], f"{r['step_ms']:.1f}", f"{r['step_ms_p10']:.0f}-{r['step_ms_p90']:.0f}",
          "-" if r["speedup"] is None else f"{r['speedup']:.2f}",
          f"{r['wire_bytes'] / 2**20:.2f} MiB", f"{r['final_loss']:.4f}"] for r in records],
    )
    if args.output:
        save(records, args.output)
    return records


if __name__ == "__main__":
    main()
