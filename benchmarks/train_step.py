"""Training-step time with each gradient compressor, side by side, against pmean and the ideal.

    python -m jax_cgx.launch -n 2 benchmarks/train_step.py                      # 2 processes, local links
    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/train_step.py -- --link-gbps 1

Every process (one device each) trains one model once per compressor in ``--compressors``, in
the same processes, one step of each in turn, so the step times compare directly. Models:

- ``mlp`` (default): the communication-bound step of issue 20, an MLP 2048-2048x4-10 (16.8 M
  parameters, 67 MB of float32 gradients) on random data, 16 samples per device, Adam 1e-3: the
  size of the step PyTorch DDP's fp16 and PowerSGD hooks were measured on (docs/performance.md).
- ``charlm``: the character transformer of examples/train_charlm.py (d_model 256: 1.6 M parameters).

A compressor is ``none`` (pmean), ``maxmin:BITS``, ``cast`` (bfloat16) or ``powersgd:RANK``; the
yardstick, the same step in PyTorch DDP in the same processes, is ``ddp:none``, ``ddp:fp16``
or ``ddp:powersgd:RANK`` (benchmarks/torch_ddp.py; needs torch; on JAX's platform: gloo on the CPU,
NCCL on a GPU). Each
takes ``--steps`` steps from the same initialization and batches; the table gives the median step
time without the first ``--warmup`` steps (compilation), its spread (max / median), the speedup over
``none``, the bytes one device sends per step and the mean training loss of the last 10 steps.
The same step on one device alone, with no exchange, is timed too (``compute``): with
``--link-gbps`` the table adds each compressor's *ideal*, compute + bytes sent / link rate (codec
time counted as zero), and the step's share of it. With ``--output`` process 0 writes the rows as
JSON (or CSV), each with every step's time (``steps_ms``, compilation included).
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # torch_ddp, the PyTorch yardstick

import torch_ddp  # noqa: E402  (imports torch only when a ddp: compressor is asked for)

# Issue 20's comm-bound step: 16.8 M parameters, 67 MB of float32 gradients (four 2048 x 2048 layers).
MLP_SIZES = (2048, 2048, 2048, 2048, 2048, 10)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("mlp", "charlm"), default="mlp", help="(default: %(default)s)")
    p.add_argument("--compressors", nargs="+", default=["none", "maxmin:4", "maxmin:8", "cast", "powersgd:2"],
                   help="none, maxmin:BITS[+auto][+backward][+tcp], cast, powersgd:RANK (+auto: policy='auto'; "
                        "+backward: reduce_in_backward; +tcp: the tcp backend), onecall:BITS[+after][+hier][+ring][+auto] "
                        "(the README's plain jax.jit step with data_parallel_value_and_grad, in backward or +after "
                        "it; hierarchical=True, algorithm='ring', policy='auto'; onecall:32 is its psum), and "
                        "PyTorch DDP in the same "
                        "processes: ddp:none, ddp:fp16, ddp:powersgd:RANK "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="steps per compressor (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default: %(default)s)")
    p.add_argument("--batch-per-device", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--link-gbps", type=float, help="the link's rate, for the ideal column (e.g. 1 behind a 1gbit link)")
    p.add_argument("--context", type=int, default=64, help="charlm (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=256, help="charlm (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="charlm (default: %(default)s)")
    p.add_argument("--output", help="process 0 writes the rows to this .json or .csv file")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps, trace --profile-steps more of each "
                   "compressor with JAX's profiler into DIR/<compressor>-process<i> and add where the time went")
    p.add_argument("--profile-steps", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--per-node", type=int, default=1,
                   help="onecall: processes per node (benchmarks/netem/run.py --nodes N --per-node M): the mesh is "
                        "('node', 'local') of (world / M, M) and the gradient is reduced over both axes")
    p.add_argument("--share-gpu", action="store_true",
                   help="every process uses GPU 0 (a one-GPU machine: checks the GPU paths, measures no link)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.batch_per_device < 1:
        p.error(f"--batch-per-device must be at least 1, got {args.batch_per_device}")
    if args.link_gbps is not None and not args.link_gbps > 0:
        p.error(f"--link-gbps must be positive, got {args.link_gbps}")
    for spec in args.compressors:
        if spec.startswith("onecall") and not (re.fullmatch(r"onecall:\d+(\+(after|hier|ring|auto))*", spec)
                                               and len(set(spec.split("+"))) == len(spec.split("+"))):
            p.error(f"{spec!r} is not onecall:BITS[+after][+hier][+ring][+auto]")
    if args.per_node < 1:
        p.error(f"--per-node must be at least 1, got {args.per_node}")
    ddp = [spec for spec in args.compressors if spec.startswith("ddp:")]
    for spec in ddp:
        try:
            torch_ddp.parse_spec(spec)
        except ValueError as err:
            p.error(str(err))
    if ddp and args.profile:
        p.error("--profile traces JAX steps only; leave the ddp: compressors out")
    return args


def example_args(spec: str, args: argparse.Namespace, world: int) -> argparse.Namespace:
    """The example's arguments for one compressor spec (``maxmin:4``, ``powersgd:2``, ...)."""
    name, _, value = spec.partition(":")
    value, *options = value.split("+")
    argv = ["--compressor", name, "--steps", str(args.steps), "--batch", str(args.batch_per_device * world),
            "--devices", str(world), "--log-every", "0", "--no-progress"]
    if options and (name != "maxmin" or not set(options) <= {"auto", "backward", "tcp"}
                    or len(set(options)) < len(options)):
        sys.exit(f"train_step: {spec!r}: only maxmin takes +auto (policy='auto'), +backward "
                 "(reduce_in_backward) and +tcp (the tcp backend)")
    if name == "maxmin":
        argv += ["--bits", value or "4", "--policy", "auto" if "auto" in options else "always"]
        argv += ["--reduce-in-backward"] if "backward" in options else []
        argv += ["--backend", "tcp"] if "tcp" in options else []
    elif name == "powersgd":
        argv += ["--rank", value or "1"]
    elif value or name not in ("none", "cast"):
        sys.exit(f"train_step: {spec!r} is not none, maxmin:BITS[+auto][+backward][+tcp], cast or powersgd:RANK")
    if args.model == "mlp":
        import train_digits

        return train_digits.parse_args(argv + ["--optimizer", "adam", "--lr", "1e-3"])
    if "backward" in options:
        sys.exit(f"train_step: {spec!r}: +backward needs --model mlp (its layers are marked where they are used)")
    import train_charlm

    return train_charlm.parse_args(argv + ["--context", str(args.context), "--d-model", str(args.d_model),
                                           "--layers", str(args.layers)])


class Model:
    """What a model gives the benchmark: its parameters, its loss, and its batches (host arrays)."""

    def __init__(self, args: argparse.Namespace):
        import jax

        self.args = args
        if args.model == "mlp":
            import train_digits

            self.title = f"MLP {'-'.join(map(str, MLP_SIZES))}"
            self.init = lambda: train_digits.init_params(jax.random.key(0), MLP_SIZES)
            self.loss_fn = train_digits.loss_fn
        else:
            import optax
            import train_charlm

            self.title = "char transformer"
            self.train_ids, _, vocab = train_charlm.load_corpus()
            self.heads = heads = train_charlm.parse_args([]).heads

            def loss_fn(params, tokens):
                logits = train_charlm.logits_fn(params, tokens[:, :-1], heads)
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            self.init = lambda: train_charlm.init_params(jax.random.key(0), len(vocab), args.d_model, args.layers,
                                                         args.context)
            self.loss_fn = loss_fn

    def batch(self, rng: np.random.Generator, size: int) -> tuple:
        if self.args.model == "mlp":
            return (rng.standard_normal((size, MLP_SIZES[0]), dtype=np.float32),
                    rng.integers(0, MLP_SIZES[-1], size).astype(np.int32))
        context = self.args.context
        starts = rng.integers(0, len(self.train_ids) - context - 1, size)
        return (self.train_ids[starts[:, None] + np.arange(context + 1)],)


class Trainer:
    """One compressor's data-parallel training, a step at a time (``spec`` "compute": one device, no exchange)."""

    def __init__(self, spec: str, model: Model, args: argparse.Namespace):
        import _common
        import jax
        import optax

        devices = jax.devices() if spec != "compute" else jax.local_devices()[:1]
        self.spec, self.ex = spec, example_args("none" if spec == "compute" else spec, args, len(devices))
        self.model = model
        compressor, optimizer = _common.make_optimizer(self.ex, optax.cosine_decay_schedule(self.ex.lr, self.ex.steps))
        self.dp = _common.DataParallel(model.loss_fn, compressor, optimizer, devices,
                                       mark=_common.backward_marker(self.ex), backend=self.ex.backend)
        example = model.batch(np.random.default_rng(0), self.ex.batch)
        self.params, self.state = self.dp.init(model.init(), example)
        self.rng = np.random.default_rng(0)  # the same batches on every process and for every compressor
        self.times, self.losses = [], []

    def step(self) -> None:
        import jax

        batch = self.dp.shard(*self.model.batch(self.rng, self.ex.batch))
        t0 = time.perf_counter()
        self.params, self.state, loss = jax.block_until_ready(self.dp.step(self.params, self.state, batch))
        self.times.append(time.perf_counter() - t0)
        self.losses.append(float(loss))

    def profile(self, directory: str, steps: int) -> dict:
        """Milliseconds per step in each phase (jax_cgx/bench/profile.py), and ``host``: the rest of the step."""
        import jax

        from jax_cgx.bench.profile import summarize

        path = Path(directory) / f"{self.spec.replace(':', '_')}-process{jax.process_index()}"
        start = len(self.times)
        with jax.profiler.trace(str(path), create_perfetto_trace=True):
            for _ in range(steps):
                self.step()
        wall = 1e3 * sum(self.times[start:]) / steps
        del self.times[start:], self.losses[start:]
        phases = {k: v / steps for k, v in summarize(path).items()}
        phases["host"] = max(0.0, wall - phases["ops"])
        phases["wall"] = wall
        return phases

    def facts(self) -> dict:
        """What the record says of this trainer besides its step times (:func:`record`)."""
        import _common
        import jax

        wire = 0 if self.spec == "compute" else int(_common.wire_bytes(self.ex, self.params, self.dp.world))
        return dict(compressor=self.spec,
                    description="compute only (one device, no exchange)" if self.spec == "compute"
                    else _common.describe(self.ex),
                    devices=self.dp.world, platform=jax.devices()[0].platform,
                    parameters=int(sum(v.size for v in jax.tree.leaves(self.params))),
                    steps=self.ex.steps, batch=self.ex.batch, wire_bytes=wire)


class OneCallTrainer(Trainer):
    """``onecall:BITS[+after]``: the README's plain ``jax.jit`` step, as a user writes it:
    ``data_parallel_value_and_grad`` (its default: in backward; ``+after``: ``in_backward=False``)
    with ``CompressionConfig(bits=BITS)``, then Adam, on a mesh from ``jax.make_mesh``."""

    def __init__(self, spec: str, model: Model, args: argparse.Namespace):
        import jax
        import optax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import jax_cgx

        bits, *options = spec.partition(":")[2].split("+")  # checked by parse_args
        self.spec, self.model, self.in_backward = spec, model, "after" not in options
        self.ex = example_args("none", args, jax.device_count())  # the same steps, batch and schedule
        self.config = jax_cgx.CompressionConfig(bits=int(bits), hierarchical="hier" in options,
                                                algorithm="ring" if "ring" in options else "sra",
                                                policy="auto" if "auto" in options else "always")
        world, m = jax.device_count(), args.per_node
        self.per_node = m
        if world % m:
            sys.exit(f"train_step: --per-node {m} does not divide the {world} devices")
        # Over nodes: the batch split over both axes, the gradient reduced over both.
        mesh = jax.make_mesh((world // m, m), ("node", "local")) if m > 1 else jax.make_mesh((world,), ("data",))
        axes = mesh.axis_names if m > 1 else "data"
        optimizer = optax.adam(optax.cosine_decay_schedule(self.ex.lr, self.ex.steps))
        grad_fn = jax_cgx.data_parallel_value_and_grad(model.loss_fn, mesh=mesh, axis_name=axes, config=self.config,
                                                       in_backward=self.in_backward)

        @functools.partial(jax.jit, donate_argnums=(0, 1))  # as the README writes it
        def train_step(params, opt_state, *batch):
            loss, grads = grad_fn(params, *batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.params = jax.device_put(model.init(), NamedSharding(mesh, P()))
        self.state = optimizer.init(self.params)
        # What Trainer.step uses of a DataParallel: place a batch, take a step.
        self.dp = SimpleNamespace(
            world=jax.device_count(),
            shard=lambda *arrays: tuple(jax.device_put(np.asarray(a), NamedSharding(mesh, P(axes))) for a in arrays),
            step=lambda params, state, batch: train_step(params, state, *batch))
        self.rng = np.random.default_rng(0)
        self.times, self.losses = [], []

    def facts(self) -> dict:
        import jax

        import jax_cgx

        where = "in backward" if self.in_backward else "after backward"
        form = "".join(f", {o}" for o in self.spec.split("+")[1:] if o != "after")
        return dict(compressor=self.spec, description=f"data_parallel_value_and_grad {self.config.bits}-bit, {where}{form}",
                    devices=self.dp.world, platform=jax.devices()[0].platform,
                    parameters=int(sum(v.size for v in jax.tree.leaves(self.params))), steps=self.ex.steps,
                    batch=self.ex.batch, wire_bytes=int(jax_cgx.bytes_on_wire(
                        self.params, self.dp.world, self.config,
                        inner_world=self.per_node if self.config.hierarchical else None)))


def record(trainer, warmup: int) -> dict:
    """A trainer's row: its facts, the step times without the first ``warmup`` steps, every step's
    time (``steps_ms``) and the mean loss of the last 10 steps (JAX and PyTorch trainers alike)."""
    timed = np.asarray(trainer.times[warmup:]) * 1e3
    return dict(trainer.facts(), step_ms=float(np.median(timed)), step_ms_p10=float(np.percentile(timed, 10)),
                step_ms_p90=float(np.percentile(timed, 90)), step_ms_max=float(timed.max()),
                spread=float(timed.max() / np.median(timed)), first_step_s=trainer.times[0],
                steps_ms=[round(t * 1e3, 3) for t in trainer.times],
                final_loss=float(np.mean(trainer.losses[-10:])))


def add_ratios(records: list[dict], link_gbps: float | None) -> None:
    """speedup over ``none``; with a link rate, the ideal (compute + bytes / rate) and the share of it."""
    base = next((r["step_ms"] for r in records if r["compressor"] == "none"), None)
    compute = next((r["step_ms"] for r in records if r["compressor"] == "compute"), None)
    for r in records:
        r["speedup"] = base / r["step_ms"] if base and r["compressor"] != "compute" else None
        r["ideal_ms"] = (compute + r["wire_bytes"] * 8 / (link_gbps * 1e9) * 1e3
                         if link_gbps and compute is not None else None)
        r["of_ideal"] = r["ideal_ms"] / r["step_ms"] if r["ideal_ms"] else None
        r["link_gbps"] = link_gbps


def main(argv=None) -> list[dict]:
    import jax_cgx

    args = parse_args(argv)
    if args.share_gpu:  # every rank on GPU 0 (tools/gpu_check.sh): checks the GPU paths, not a link
        from jax_cgx.bench.allreduce import share_one_gpu

        info = jax_cgx.distributed.detect()
        share_one_gpu(info.process_index, info.process_count)
        jax_cgx.distributed.initialize(local_device_ids=[0])
    else:
        jax_cgx.distributed.initialize()
    import jax

    from jax_cgx.bench._table import print_table, save

    lead = jax.process_index() == 0
    if lead and any("auto" in spec.split("+")[1:] for spec in args.compressors):
        # policy="auto"'s calibration figures and each buffer's decision, as a user sees them with INFO logs.
        logging.basicConfig(format="%(message)s")
        logging.getLogger("jax_cgx").setLevel(logging.INFO)
    model = Model(args)
    lr = example_args("none", args, 1).lr
    kinds = {"ddp": lambda spec: torch_ddp.DdpTrainer(spec, model, args, lr),
             "onecall": lambda spec: OneCallTrainer(spec, model, args)}
    trainers = [kinds.get(spec.partition(":")[0], lambda spec: Trainer(spec, model, args))(spec)
                for spec in ["compute", *args.compressors]]
    # Round robin, one step of each compressor in turn: every compressor sees the same load on the
    # machine and the link over the run, so the ratios are measured side by side.
    for i in range(args.steps):
        for t in trainers:
            t.step()
        if lead and args.progress:
            print(f"train_step: step {i + 1}/{args.steps}", file=sys.stderr, flush=True)
    torch_ddp.close()  # PyTorch's process group, if a ddp: trainer made one (NCCL warns at exit otherwise)
    records = [record(t, args.warmup) for t in trainers]
    add_ratios(records, args.link_gbps)
    if args.profile:
        for t, r in zip(trainers, records):
            r["profile_ms"] = t.profile(args.profile, args.profile_steps)
    if not lead:
        return records
    r0 = records[0]
    link = f", {args.link_gbps:g} Gbit/s link" if args.link_gbps else ""
    print_table(
        f"training step, {model.title} ({r0['parameters']:,} parameters), {jax.device_count()} x {r0['platform']}, "
        f"{args.batch_per_device} samples per device{link}, median of {args.steps - args.warmup} steps",
        ["compressor", "step ms", "p10-p90 ms", "max/median", "speedup", "ideal ms", "of ideal",
         "wire per device per step", "loss (last 10)"],
        [[r["description"], f"{r['step_ms']:.1f}", f"{r['step_ms_p10']:.0f}-{r['step_ms_p90']:.0f}",
          f"{r['spread']:.2f}", "-" if r["speedup"] is None else f"{r['speedup']:.2f}",
          "-" if r["ideal_ms"] is None else f"{r['ideal_ms']:.1f}",
          "-" if r["of_ideal"] is None else f"{r['of_ideal']:.0%}",
          f"{r['wire_bytes'] / 2**20:.2f} MiB", f"{r['final_loss']:.4f}"] for r in records],
    )
    if args.profile:
        from jax_cgx.bench.profile import PHASES

        print_table(
            f"where the step's time goes (ms per step, {args.profile_steps} traced steps; traces in {args.profile})",
            ["compressor", *PHASES, "host", "traced step"],
            [[r["description"], *(f"{r['profile_ms'][k]:.1f}" for k in (*PHASES, "host", "wall"))] for r in records],
        )
    if args.output:
        save(records, args.output)
    return records


if __name__ == "__main__":
    main()
