"""Validation loss against wall-clock time on the word transformer: uniform and adaptive widths side by side.

    python benchmarks/time_to_loss.py --seed 0 --output benchmarks/results/time_to_loss_8dev_s0.json
    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/time_to_loss.py -- \\
        --seed 0 --output benchmarks/netem/results/time_to_loss_2p_1gbit_s0.json --plot loss.png

Every spec trains examples/train_charlm.py's transformer on the help topics read as words
(``--words``, 4096 by default: the model whose embedding tables hold most of the values and get
sparse, heavy-tailed gradients) from the same initialization on the same batches, with Adam and a
cosine-decaying rate. The trainers take one step each in turn (round robin: every spec sees the
same load on the machine and the link) and evaluate the validation loss every ``--eval-every``
steps, outside the clock. One process alone uses its simulated CPU devices (8 by default); under
``jax_cgx.launch`` or ``netem/run.py`` each process is one device.

Specs: ``none`` (pmean), ``maxmin:BITS`` (uniform widths in buckets of ``--bucket-size``),
``adaptive:BUDGET`` (``jax_cgx.adaptive.Planner`` within uniform BUDGET bits' bytes: each leaf's width
and bucket size among ``--bucket-sizes``, the relative objective (``--objective``), re-planned every ``--replan-every``
steps from the devices' own gradients), ``widths:BUDGET`` (the same, widths only). ``SPEC@STEPS`` trains
that spec for STEPS steps, its rate decaying over them, instead of ``--steps`` (a compressed run given
more, cheaper steps to reach the uncompressed run's final loss: time to accuracy, each run on its own
schedule).

The clock counts training steps (re-planning and the compilation of every new plan included; the
first step, which compiles for every spec, counts as the median step). The table gives each spec's
validation loss after the last step, the time (and step) at which it first reached ``--target``
(default: the ``none`` run's final validation loss), the step time, the bytes per step and, for
adaptive specs, plan changes and compiled steps; ``--plot`` draws validation loss against time.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

BUCKET_SIZES = (64, 128, 256, 512, 1024, 4096)


def parse_args(argv=None) -> argparse.Namespace:
    import jax_cgx.adaptive  # (jax's backends start later: main requests the CPU devices first)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", nargs="+", default=["none", "maxmin:4", "adaptive:4", "adaptive:3", "maxmin:8"],
                   help="none, maxmin:BITS, adaptive:BUDGET, widths:BUDGET, each optionally @STEPS "
                        "(default: %(default)s)")
    p.add_argument("--words", type=int, default=4096, help="vocabulary: the most frequent words (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1200, help="(default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="global batch of windows (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.003, help="Adam's peak rate, cosine decay (default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size, help="uniform widths' bucket (default: %(default)s)")
    p.add_argument("--bucket-sizes", type=int, nargs="+", default=list(BUCKET_SIZES),
                   help="adaptive: the bucket sizes a leaf may get (default: %(default)s)")
    p.add_argument("--replan-every", type=int, default=100, help="adaptive: (default: %(default)s)")
    p.add_argument("--candidates", type=int, nargs="+",
                   help="adaptive: the widths a leaf may get (default: jax_cgx.adaptive.CANDIDATES)")
    p.add_argument("--objective", choices=jax_cgx.adaptive.OBJECTIVES, default="relative",
                   help="adaptive: the planner's objective (default: %(default)s)")
    p.add_argument("--target", type=float, help="validation loss (default: the none run's final one)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices of one process (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--output", help="process 0 writes the rows (with every evaluation) to this .json or .csv file")
    p.add_argument("--plot", metavar="PNG", help="process 0 draws validation loss against training time")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress lines")
    args = p.parse_args(argv)
    for name in ("steps", "eval_every", "batch", "replan_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for spec in args.specs:
        try:
            example_argv(spec, args)
            spec_steps(spec, args)
        except ValueError as err:
            p.error(str(err))
    if len(set(args.specs)) != len(args.specs):
        p.error(f"--specs: each spec once, got {args.specs}")
    if args.target is None and "none" not in args.specs:
        p.error("give --target, or include the spec none (whose final validation loss is the default target)")
    return args


def spec_steps(spec: str, args: argparse.Namespace) -> int:
    """The steps ``spec`` trains for: its ``@STEPS``, or ``--steps``."""
    _, at, steps = spec.partition("@")
    if not at:
        return args.steps
    if not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"{spec!r}: @STEPS must be a positive number of steps, got {steps!r}")
    return int(steps)


def example_argv(spec: str, args: argparse.Namespace) -> list[str]:
    """examples/train_charlm.py's flags for ``spec`` (without its ``@STEPS``)."""
    name, _, value = spec.partition("@")[0].partition(":")
    bad = ValueError(f"{spec!r} is not none, maxmin:BITS, adaptive:BUDGET or widths:BUDGET")
    if name == "none" and "@" in spec:
        raise ValueError(f"{spec!r}: none is the baseline, trained for --steps; give --steps instead of @STEPS")
    if name == "none" and not value:
        return ["--compressor", "none"]
    try:
        number = float(value)
    except ValueError:
        raise bad from None
    if name == "maxmin" and number == int(number):
        return ["--compressor", "maxmin", "--bits", str(int(number))]
    if name in ("adaptive", "widths"):
        return (["--compressor", "maxmin", "--adaptive", value, "--adaptive-objective", args.objective,
                 "--replan-every", str(args.replan_every)]
                + (["--adaptive-candidates", *map(str, args.candidates)] if args.candidates else [])
                + (["--adaptive-bucket-sizes", *map(str, args.bucket_sizes)] if name == "adaptive" else []))
    raise bad


class Trainer:
    """One spec's training, a step at a time, with its clock and its evaluations."""

    def __init__(self, spec: str, args: argparse.Namespace, corpus, devices):
        import _common
        import jax
        import optax
        import train_charlm

        self.spec, self.steps = spec, spec_steps(spec, args)
        train_ids, val_ids, vocab = corpus
        self.ex = train_charlm.parse_args([*example_argv(spec, args), "--words", str(args.words), "--batch",
                                           str(args.batch), "--lr", str(args.lr), "--steps", str(self.steps),
                                           "--bucket-size", str(args.bucket_size), "--seed", str(args.seed),
                                           "--devices", str(len(devices))])
        T = self.ex.context
        self.sequence_loss = sequence_loss = functools.partial(train_charlm.sequence_loss, heads=self.ex.heads)
        compressor, optimizer = _common.make_optimizer(self.ex, optax.cosine_decay_schedule(args.lr, self.steps))
        params = train_charlm.init_params(jax.random.key(args.seed), len(vocab), self.ex.d_model, self.ex.layers, T)
        self.planner = _common.adaptive_planner(self.ex, params)
        errors_fn = None if self.planner is None else (lambda g: self.planner.leaf_errors(g, _common.AXIS))
        self.dp = _common.DataParallel(lambda p, t: sequence_loss(p, t).mean(), compressor, optimizer, devices,
                                       errors_fn=errors_fn)
        self.params, self.state = self.dp.init(params, (np.zeros((args.batch, T + 1), np.int32),))
        self.wire = int(_common.wire_bytes(self.ex, self.params, self.dp.world))
        self.train_ids, self.val = train_ids, train_charlm.validation_windows(val_ids, T)
        self._step = _common.planned_step(self.ex, self.dp, self.planner)  # re-planning on the clock
        self.rng = np.random.default_rng(args.seed)  # the same batches for every spec
        self.times: list[float] = []
        self.evaluations: list[dict] = []  # {"step", "seconds", "val_loss"}

    def step(self) -> None:
        T = self.ex.context
        starts = self.rng.integers(0, len(self.train_ids) - T - 1, self.ex.batch)
        batch = self.dp.shard(self.train_ids[starts[:, None] + np.arange(T + 1)])
        t0 = time.perf_counter()
        self.params, self.state, _ = self._step(len(self.times), self.params, self.state, batch)
        self.times.append(time.perf_counter() - t0)

    def evaluate(self) -> dict:
        import _common

        row = dict(step=len(self.times), seconds=_common.training_seconds(self.times),
                   val_loss=self.dp.evaluate(self.sequence_loss, self.params, self.val))
        self.evaluations.append(row)
        return row


def reached(evaluations: list[dict], target: float) -> dict | None:
    return next((e for e in evaluations if e["val_loss"] <= target), None)


def main(argv=None) -> list[dict]:
    import _common

    import jax_cgx

    args = parse_args(argv)
    single = jax_cgx.distributed.detect().process_count == 1
    if single:  # one process: its simulated devices (before jax starts its backends)
        _common.request_cpu_devices(args.devices)
    jax_cgx.distributed.initialize()
    import jax
    import train_charlm

    devices = _common.mesh_devices(args.devices) if single else jax.devices()
    from jax_cgx.bench._table import print_table, save

    lead = jax.process_index() == 0
    corpus = train_charlm.load_corpus(0.1, args.words)
    trainers = [Trainer(spec, args, corpus, devices) for spec in args.specs]
    for step in range(1, max(t.steps for t in trainers) + 1):
        for t in trainers:
            if step > t.steps:
                continue
            t.step()
            if step % args.eval_every == 0 or step == t.steps:
                row = t.evaluate()
                if lead and args.progress:
                    print(f"time_to_loss: {t.spec:>12} step {step:>5}  {row['seconds']:8.2f} s  "
                          f"validation loss {row['val_loss']:.4f}", file=sys.stderr, flush=True)
    final = {t.spec: t.evaluations[-1]["val_loss"] for t in trainers}
    target = args.target if args.target is not None else final["none"]
    base = reached(next((t.evaluations for t in trainers if t.spec == "none"), []), target)
    records = []
    for t in trainers:
        hit = reached(t.evaluations, target)
        records.append(dict(
            spec=t.spec, description=_common.describe(t.ex) + ("" if t.steps == args.steps else f", {t.steps} steps"),
            steps=t.steps, devices=t.dp.world, seed=args.seed, target=target,
            final_val_loss=final[t.spec], vs_none=final[t.spec] / final["none"] - 1 if "none" in final else None,
            steps_to_target=hit and hit["step"], seconds_to_target=hit and hit["seconds"],
            speedup=base["seconds"] / hit["seconds"] if base and hit else None,
            step_ms=float(np.median(t.times[1:] or t.times)) * 1e3, wire_bytes=t.wire,
            plan_changes=t.planner.changes if t.planner else None,
            compiled_steps=t.planner.compilations if t.planner else None,
            plan=[p._asdict() for p in t.planner.plans] if t.planner and t.planner.plans else None,
            evaluations=t.evaluations,
        ))
    if not lead:
        return records
    print_table(
        f"validation loss and time to {target:.4f}, word transformer ({args.words + 1} words), {records[0]['devices']} "
        f"{'processes' if jax.process_count() > 1 else 'devices'}, batch {args.batch}, {args.steps} steps, seed {args.seed}",
        ["spec", "val loss", "vs none", "steps", "seconds", "speedup", "step ms", "wire per step", "plans / compiled"],
        [[r["description"], f"{r['final_val_loss']:.4f}", "-" if r["vs_none"] is None else f"{r['vs_none']:+.2%}",
          "-" if r["steps_to_target"] is None else str(r["steps_to_target"]),
          "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}",
          "-" if r["speedup"] is None else f"{r['speedup']:.2f}", f"{r['step_ms']:.0f}",
          _common.human_bytes(r["wire_bytes"]),
          "-" if r["plan_changes"] is None else f"{r['plan_changes']} / {r['compiled_steps']}"] for r in records],
    )
    if args.output:
        save(records, args.output)
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    return records


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in records:
        ev = r["evaluations"]
        ax.plot([e["seconds"] for e in ev], [e["val_loss"] for e in ev], marker=".",
                label=f"{r['description']}: {r['final_val_loss']:.3f}")
    ax.axhline(records[0]["target"], color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("training time, s (evaluation excluded)")
    ax.set_ylabel("validation loss, nats/word")
    ax.set_title(f"word transformer, {records[0]['devices']} devices, seed {records[0]['seed']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
