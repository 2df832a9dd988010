"""What the training examples share: devices, the data-parallel step, compressors, bytes, timing, plots.

train_digits.py and train_charlm.py define a model, a loss and their data; everything else is here:

- ``add_args``: the command line every example takes (compressor and its settings, steps, batch, ...).
- ``request_cpu_devices``: simulated CPU devices; must run before jax starts its backends.
- ``make_optimizer`` / ``describe`` / ``wire_bytes``: the compressor chosen on the command line as an
  optax transformation chained with the optimizer, its name, and the bytes one device sends per step.
- ``DataParallel``: a jitted ``shard_map`` step over a 1-D "data" mesh, with the optimizer state kept
  per device (the residuals of error feedback, PowerSGD and top-k differ from rank to rank), and a
  sharded evaluation.
- ``train``: the loop: one step in flight at a time, step times, the loss every step, a log line
  every ``--log-every`` steps and a tqdm progress bar.
- ``save_plot``: the loss curve with matplotlib.
"""

import argparse
import copy
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import bytes_on_wire
from jax_cgx._src.compat import varying_axes  # JAX's varying-axes type, across jax versions

AXIS = "data"
COMPRESSORS = ("none", "maxmin", "cast", "powersgd", "topk")


def request_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` simulated CPU devices (ignored on GPU).

    Only takes effect before jax starts its backends (the first ``jax.devices()`` or computation);
    a device count already in ``XLA_FLAGS`` wins.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def add_args(p: argparse.ArgumentParser, *, steps: int, batch: int, lr: float, log_every: int) -> None:
    """The flags every example takes; ``steps``, ``batch``, ``lr`` and ``log_every`` are the defaults."""
    p.add_argument("--compressor", choices=COMPRESSORS, default="none",
                   help="how gradients are averaged: pmean, max-min quantization, a bfloat16 cast, "
                        "PowerSGD or top-k (default: %(default)s)")
    p.add_argument("--bits", type=int, default=4, help="maxmin: bits per value, 1..8 (default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size, help="maxmin: values per bucket (default: %(default)s)")
    p.add_argument("--min-size", type=int, default=jax_cgx.CompressionConfig.min_size,
                   help="maxmin: leaves with fewer values are averaged exactly, CompressionConfig.min_size "
                        "(default: %(default)s)")
    p.add_argument("--stochastic", action="store_true", help="maxmin: stochastic rounding")
    p.add_argument("--policy", choices=("always", "auto"), default="always",
                   help="maxmin: compress always, or only where jax_cgx's cost model predicts a gain on "
                        "this link (default: %(default)s)")
    p.add_argument("--backend", choices=("auto", "xla", "tcp"), default="auto",
                   help="maxmin: who runs the compressed exchange; tcp: jax_cgx's own TCP connections, the codec "
                        "pipelined with the wire (CPU; connected by jax_cgx.tcp.setup) (default: %(default)s)")
    p.add_argument("--reduce-in-backward", action="store_true",
                   help="maxmin: average each layer's gradient in the backward pass, as soon as it exists "
                        "(jax_cgx.reduce_in_backward), instead of all of them after it (train_digits.py only)")
    p.add_argument("--adaptive", type=float, metavar="BUDGET_BITS",
                   help="maxmin: bit widths per layer chosen by jax_cgx.adaptive within the bytes of a uniform "
                        "BUDGET_BITS (--bits is then the first plan's width), re-planned every --replan-every steps")
    p.add_argument("--adaptive-objective", choices=jax_cgx.adaptive.OBJECTIVES, default="squared",
                   help="--adaptive: minimize the squared error, each leaf's relative to its mean square, or each "
                        "value's relative to its own square (adam) (default: %(default)s)")
    p.add_argument("--adaptive-bucket-sizes", type=int, nargs="+", metavar="B",
                   help="--adaptive: also choose each leaf's bucket size among these (default: --bucket-size's)")
    p.add_argument("--adaptive-candidates", type=int, nargs="+", metavar="BITS",
                   default=list(jax_cgx.adaptive.CANDIDATES),
                   help="--adaptive: the widths a leaf may get (default: %(default)s)")
    p.add_argument("--replan-every", type=int, default=100,
                   help="--adaptive: steps between plans (default: %(default)s)")
    p.add_argument("--error-feedback", action="store_true",
                   help="maxmin: carry each rank's quantization error into its next step")
    p.add_argument("--layer-min-size", type=int, default=1024,
                   help="maxmin: torch_cgx's layer filter: leaves of ndim <= 1 or fewer values are averaged "
                        "exactly, 0: off (default: %(default)s)")
    p.add_argument("--rank", type=int, default=1, help="powersgd: rank of the approximation (default: %(default)s)")
    p.add_argument("--ratio", type=float, default=0.01,
                   help="topk: fraction of each leaf's values sent (default: %(default)s)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: SGD with --momentum (for topk, the momentum is applied inside topk_mean and "
                        "plain SGD follows); adam: Adam (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate, cosine decay (default: %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=batch, help="global batch, split over the devices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initialization, batches and compressors (default: %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=log_every, help="steps between log lines, 0: none (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar (default: when stderr is a terminal)")
    p.add_argument("--plot", metavar="PNG", help="write the loss curve to this file")


# --- compressors ----------------------------------------------------------------------------------

def pmean(axis_name: str) -> optax.GradientTransformation:
    """The uncompressed baseline: ``jax.lax.pmean`` as an optax transformation."""
    return optax.stateless(lambda updates, params=None: jax.lax.pmean(updates, axis_name))


def _maxmin_config(args) -> jax_cgx.CompressionConfig:
    return jax_cgx.CompressionConfig(bits=args.bits, bucket_size=args.bucket_size, min_size=args.min_size,
                                     stochastic=args.stochastic,
                                     policy=args.policy, backend=args.backend)


def make_compressor(args, axis_name: str = AXIS, configs=None) -> optax.GradientTransformation:
    """The gradient mean ``--compressor`` names, with its settings (maxmin: ``configs``, a config
    pytree such as jax_cgx.adaptive's plan, instead of ``--bits``)."""
    if args.compressor == "none":
        return pmean(axis_name)
    import jax_cgx.optax as cgx_optax  # needs optax, an optional dependency of jax_cgx

    seed = args.seed
    if args.compressor == "maxmin" and args.reduce_in_backward:
        return optax.identity()  # the gradients come out of jax.grad averaged (backward_marker)
    if args.compressor == "maxmin":
        config = _maxmin_config(args) if configs is None else configs
        return cgx_optax.compressed_mean(axis_name, config, layer_min_size=args.layer_min_size,
                                         error_feedback=args.error_feedback, seed=seed)
    if args.compressor == "cast":
        return cgx_optax.cast_mean(axis_name, jnp.bfloat16)
    if args.compressor == "powersgd":
        return cgx_optax.powersgd_mean(axis_name, args.rank, seed=seed)
    if args.compressor == "topk":
        momentum = args.momentum if args.optimizer == "sgd" else 0.0
        return cgx_optax.topk_mean(axis_name, args.ratio, momentum=momentum, seed=seed)
    raise ValueError(f"unknown compressor {args.compressor!r}")


def backward_marker(args, axis_name: str = AXIS):
    """``mark(i, layer)`` for a loss that marks each layer where it uses it, or None.

    With ``--reduce-in-backward`` each layer's gradient is averaged by ``compressed_pmean``
    in the backward pass, with the leaves ``compressed_mean``'s filter leaves exact (biases
    and other leaves of ndim <= 1, fewer than ``--layer-min-size`` values) averaged exactly.
    """
    if not args.reduce_in_backward:
        return None
    if args.compressor != "maxmin" or args.error_feedback:
        sys.exit("--reduce-in-backward: only with --compressor maxmin, without --error-feedback "
                 "(a transpose cannot carry a residual to the next step)")
    from jax_cgx.optax import layer_filter

    config = _maxmin_config(args)
    leaf_config = layer_filter(config, args.layer_min_size)

    def mark(i, layer):
        key = jax.random.fold_in(jax.random.key(args.seed), i) if config.stochastic else None
        return jax_cgx.reduce_in_backward(layer, axis_name, leaf_config, key=key)

    return mark


def make_optimizer(args, schedule, axis_name: str = AXIS):
    """(the compressor ``--compressor`` names, the optimizer that follows it)."""
    if args.optimizer == "adam":
        opt = optax.adam(schedule)
    elif args.compressor == "topk":
        opt = optax.sgd(schedule)  # topk_mean applies the momentum (DGC's momentum correction)
    else:
        opt = optax.sgd(schedule, momentum=args.momentum or None)
    return make_compressor(args, axis_name), opt


def describe(args) -> str:
    """A short name of the compressor and its settings."""
    if args.compressor == "maxmin":
        extra = ((", stochastic" if args.stochastic else "") + (", error feedback" if args.error_feedback else "")
                 + (", policy auto" if args.policy == "auto" else "")
                 + (f", {args.backend} backend" if args.backend != "auto" else "")
                 + (", in backward" if args.reduce_in_backward else ""))
        if getattr(args, "adaptive", None):
            buckets = args.adaptive_bucket_sizes
            where = f"buckets of {'/'.join(map(str, buckets))}" if buckets else f"bucket {args.bucket_size}"
            widths = getattr(args, "adaptive_candidates", None)
            if widths and set(widths) != set(jax_cgx.adaptive.CANDIDATES):
                where += f", widths {'/'.join(map(str, sorted(set(widths))))}"
            return f"maxmin adaptive within {args.adaptive:g}-bit bytes, {where}{extra}"
        return f"maxmin {args.bits}-bit, bucket {args.bucket_size}{extra}"
    if args.compressor == "cast":
        return "cast bfloat16"
    if args.compressor == "powersgd":
        return f"powersgd rank {args.rank}"
    if args.compressor == "topk":
        return f"topk {args.ratio:.2%}"
    return "none (pmean, float32)"


def wire_bytes(args, params, world: int) -> int:
    """Bytes one device sends per step to average gradients shaped like ``params``."""
    if args.compressor == "none":
        return bytes_on_wire(params, world, jax_cgx.CompressionConfig(bits=32))
    if args.compressor == "cast":  # every float leaf summed in bfloat16
        ring = 2 * (world - 1) / world
        return int(round(ring * sum(v.size * (2 if jnp.issubdtype(v.dtype, jnp.floating) else v.dtype.itemsize)
                                    for v in jax.tree.leaves(params))))
    if args.compressor == "maxmin":  # compressed_mean's layer filter: biases, norms, small leaves exact
        from jax_cgx.optax import layer_filter

        config = _maxmin_config(args)
        if getattr(args, "adaptive", None):  # the plans stay within a uniform width's bytes: those, rounded up
            config = config.replace(bits=min(8, math.ceil(args.adaptive)))
        return bytes_on_wire(params, world, layer_filter(config, args.layer_min_size))
    if args.compressor == "powersgd":
        from jax_cgx.optax import powersgd_bytes

        return powersgd_bytes(params, world, rank=args.rank)
    if args.compressor == "topk":
        from jax_cgx.optax import topk_bytes

        return topk_bytes(params, world, ratio=args.ratio)
    raise ValueError(f"unknown compressor {args.compressor!r}")


# --- data parallelism -----------------------------------------------------------------------------

def mesh_devices(n: int) -> list:
    devices = jax.devices()
    if devices[0].platform == "cpu":
        if len(devices) < n:
            sys.exit(f"asked for {n} devices, jax has {len(devices)}: set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts")
        return devices[:n]
    return devices  # GPUs: all of them


class DataParallel:
    """Data-parallel training over a 1-D mesh: replicated parameters, sharded batches.

    ``loss_fn(params, *batch) -> scalar`` is the loss of one device's shard of the batch. Each device
    differentiates it with respect to its own (varying) copy of the parameters, so the gradients stay
    local until ``compressor`` averages them: a gradient taken with respect to the replicated
    parameters themselves would come out already summed over the devices, by an uncompressed psum
    that JAX inserts (the transpose of the implicit broadcast).

    The compressor's state may differ from device to device (the residuals of error feedback,
    PowerSGD and top-k). ``init`` finds out which of its leaves do, from the types ``shard_map``
    gives them (``check_vma``: a value JAX types as invariant is the same on every device), and
    carries those per device, with a leading axis of length ``world`` sharded over the mesh; the
    others, and the state of the optimizer that follows the compressor, are replicated. The same
    check verifies that the compressor's mean is the same on every device.
    """

    def __init__(self, loss_fn, compressor: optax.GradientTransformation, optimizer: optax.GradientTransformation,
                 devices, mark=None, backend: str = "auto", errors_fn=None):
        self.world = len(devices)
        self.mesh = jax.make_mesh((self.world,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                                  devices=devices)
        if backend == "tcp" and self.world > 1:
            jax_cgx.tcp.setup(self.mesh)  # the one line a user adds for the tcp backend
        self.replicated = NamedSharding(self.mesh, P())
        self.sharded = NamedSharding(self.mesh, P(AXIS))
        self.loss_fn, self.compressor, self.optimizer = loss_fn, compressor, optimizer
        self.mark = mark  # backward_marker's: loss_fn(params, *batch, mark=mark) averages in backward
        # errors_fn(local_grads) -> a small replicated array (jax_cgx.adaptive's leaf_errors of each
        # device's own gradient, averaged: what the planner chooses from), computed by `errors`
        self.errors_fn = errors_fn
        self._errors = None
        self.per_device = None  # compressor state: a pytree of bools, True where the leaf is per device
        self._evals = {}

    def _local_loss_and_grads(self, params, batch):
        """Inside shard_map: this device's loss and gradient on its rows of ``batch``."""
        if self.mark is not None:  # reduce_in_backward types the parameters as varying itself
            return jax.value_and_grad(lambda p: self.loss_fn(p, *batch, mark=self.mark))(params)
        return jax.value_and_grad(self.loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), *batch)

    def _compress(self, params, state, batch, per_device):
        """Inside shard_map: the local loss, the compressed mean of the local gradients and the
        compressor's state."""
        state = jax.tree.map(lambda s, d: s[0] if d else s, state, per_device)
        loss, grads = self._local_loss_and_grads(params, batch)
        return loss, *self.compressor.update(grads, state, params)

    def _find_per_device(self, params, batch) -> None:
        """Which leaves of the compressor's state vary over the devices: grow the set to a fixed point."""
        varies = {}

        def varying(state):
            return jax.tree.map(lambda s: AXIS in varying_axes(jax.typeof(s)), state)

        def probe_init(params):
            state = self.compressor.init(params)
            varies["state"] = varying(state)
            return jax.tree.map(lambda s: s[None], state)

        stacked = jax.eval_shape(jax.shard_map(probe_init, mesh=self.mesh, in_specs=P(), out_specs=P(AXIS)), params)
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stacked)
        per_device = varies["state"]
        while True:

            def probe(params, state, batch):
                _, _, state = self._compress(params, state, batch, per_device)
                varies["state"] = varying(state)
                return jax.tree.map(lambda s: s[None], state)

            def abstract(s, d):
                shape = (self.world, *s.shape) if d else s.shape
                return jax.ShapeDtypeStruct(shape, s.dtype, sharding=self.sharded if d else self.replicated)

            specs = jax.tree.map(lambda d: P(AXIS) if d else P(), per_device)
            jax.eval_shape(jax.shard_map(probe, mesh=self.mesh, in_specs=(P(), specs, P(AXIS)), out_specs=P(AXIS)),
                           params, jax.tree.map(abstract, shapes, per_device), batch)
            grown = jax.tree.map(lambda a, b: a or b, per_device, varies["state"])
            if grown == per_device:
                break
            per_device = grown
        self.per_device = per_device

    def init(self, params, batch):
        """Replicated parameters and the state: (the compressor's, the optimizer's).

        ``batch`` is an example global batch (host arrays): the shapes the step will see.
        """
        params = self.replicate(params)
        batch = self.shard(*batch)
        self._find_per_device(params, batch)
        specs = self._specs()

        def init(params):
            per_device = self.per_device
            state = jax.tree.map(lambda s, d: s[None] if d else s, self.compressor.init(params), per_device)
            return state, self.optimizer.init(params)

        self._build()
        state = jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=P(), out_specs=specs))(params)
        return params, state

    def _specs(self):
        return (jax.tree.map(lambda d: P(AXIS) if d else P(), self.per_device), P())

    def _build(self) -> None:
        """The jitted step for this compressor (``init`` found which of its state is per device)."""
        per_device, specs = self.per_device, self._specs()

        def step(params, state, batch):
            per_device_state, shared = state
            loss, mean, per_device_state = self._compress(params, per_device_state, batch, per_device)
            updates, shared = self.optimizer.update(mean, shared, params)
            params = optax.apply_updates(params, updates)
            per_device_state = jax.tree.map(lambda s, d: s[None] if d else s, per_device_state, per_device)
            return params, (per_device_state, shared), jax.lax.pmean(loss, AXIS)

        self._step = jax.jit(jax.shard_map(step, mesh=self.mesh, in_specs=(P(), specs, P(AXIS)),
                                           out_specs=(P(), specs, P())), donate_argnums=(0, 1))

    def errors(self, params, batch):
        """``errors_fn`` of the devices' own gradients of the loss at ``params`` on ``batch`` (what the
        step at ``params`` on ``batch`` reduces). Its own compiled function, the same for every plan:
        inside each plan's step it would compile with each plan again (measured, word transformer,
        2 CPU devices: the step alone 3.7-6.6 s, with the errors 21-22 s)."""
        if self._errors is None:
            def local_errors(params, batch):
                return self.errors_fn(self._local_loss_and_grads(params, batch)[1])

            self._errors = jax.jit(jax.shard_map(local_errors, mesh=self.mesh, in_specs=(P(), P(AXIS)), out_specs=P()))
        return self._errors(params, batch)

    def with_compressor(self, compressor: optax.GradientTransformation) -> "DataParallel":
        """The same data parallelism with another compressor whose state is shaped like this one's
        (e.g. compressed_mean with another plan of bit widths): its own compiled step, the same state."""
        other = copy.copy(self)
        other.compressor, other._evals = compressor, {}
        other._build()
        return other

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)

    def shard(self, *arrays):
        return tuple(jax.device_put(np.asarray(a), self.sharded) for a in arrays)

    def step(self, params, state, batch):
        """One step on a global batch: a tuple of arrays sharded over the devices (``shard``)."""
        return self._step(params, state, batch)

    def evaluate(self, fn, params, *arrays) -> float:
        """The mean of ``fn(params, *rows) -> one value per row`` over all rows of ``arrays``, sharded."""
        key = (fn, len(arrays))
        if key not in self._evals:
            def local(params, mask, *rows):
                total = jax.lax.psum(jnp.sum(fn(params, *rows) * mask), AXIS)
                return total / jax.lax.psum(jnp.sum(mask), AXIS)

            in_specs = (P(), P(AXIS)) + (P(AXIS),) * len(arrays)
            self._evals[key] = jax.jit(jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=P()))
        n = len(arrays[0])
        pad = -n % self.world  # pad to a multiple of the devices; the mask leaves the padding out
        mask = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
        padded = [np.concatenate([a, np.repeat(a[-1:], pad, axis=0)]) for a in map(np.asarray, arrays)]
        return float(self._evals[key](params, *self.shard(mask, *padded)))


# --- the loop -------------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def train(args, dp: DataParallel, params, state, next_batch, *, wire: int, planner=None):
    """Run ``args.steps`` steps; ``next_batch(step)`` gives the global batch as host arrays.

    Blocks on every step (many steps in flight on simulated CPU devices can deadlock XLA's
    rendezvous), which also makes the step times honest. Returns the parameters, the state, the loss
    of every step and the time of every step (the first includes compilation). With a
    ``jax_cgx.adaptive.Planner`` (``dp`` built with its ``errors_fn``), each step runs the plan's
    compiled step and the planner sees the errors of the devices' own gradients (``dp.errors``).
    """
    from tqdm.auto import tqdm

    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = tqdm(total=args.steps, disable=not progress, unit="step", leave=False, dynamic_ncols=True)
    losses, times = [], []
    step = planned_step(args, dp, planner)
    for i in range(args.steps):
        batch = dp.shard(*next_batch(i))
        t0 = time.perf_counter()
        params, state, loss = step(i, params, state, batch)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        bar.update()
        if args.log_every and ((i + 1) % args.log_every == 0 or i == 0 or i + 1 == args.steps):
            window = times[max(1, i + 1 - args.log_every):] or times
            tqdm.write(f"step {i + 1:>6}  loss {losses[-1]:.4f}  step {np.median(window) * 1e3:7.2f} ms  "
                       f"{human_bytes(wire)} on the wire per device per step")
        if not np.isfinite(losses[-1]):
            tqdm.write(f"step {i + 1}: loss is {losses[-1]}, stopping")
            break
    bar.close()
    return params, state, losses, times


def planned_step(args, dp: DataParallel, planner=None):
    """``step(i, params, state, batch) -> (params, state, loss)``, finished: ``dp``'s step, or with a
    ``jax_cgx.adaptive.Planner`` the current plan's (one DataParallel, one compiled step, per plan, the
    state shared), the planner observing the devices' own gradients (``dp.errors``, one compiled
    function for every plan, run before the step on the step's batch) on its
    planning steps and choosing the plan of the steps that follow."""
    if planner is None:
        return lambda i, params, state, batch: jax.block_until_ready(dp.step(params, state, batch))

    def for_plan(configs):  # one function for every plan: the planner keys its compiled steps on it
        return dp.with_compressor(make_compressor(args, AXIS, configs))

    def step(i, params, state, batch):
        errors = dp.errors(params, batch) if i % planner.every == 0 else None  # before the step donates params
        out = jax.block_until_ready(planner.compiled(for_plan).step(params, state, batch))
        if errors is not None:
            planner.observe(i, out[0], errors=errors)
        return out

    return step


def training_seconds(times) -> float:
    """Seconds of training in ``times`` (one per step), the first (compiling) step counted as the
    median of the others: what the time-to-target benchmarks put on their clocks."""
    if len(times) < 2:
        return 0.0 if not times else float("nan")
    return float(np.median(times[1:]) + np.sum(times[1:]))


def adaptive_planner(args, params):
    """``--adaptive``'s jax_cgx.adaptive.Planner over the leaves compressed_mean compresses (the
    others, under ``--layer-min-size``, are outside the budget), or None. Give DataParallel
    ``errors_fn=lambda g: planner.leaf_errors(g, AXIS)``."""
    if not getattr(args, "adaptive", None):
        return None
    if args.compressor != "maxmin" or args.reduce_in_backward:
        sys.exit("--adaptive: only with --compressor maxmin, without --reduce-in-backward")
    base = _maxmin_config(args).replace(min_size=max(args.layer_min_size, 1))
    try:
        return jax_cgx.adaptive.Planner(params, budget_bits=args.adaptive, config=base, every=args.replan_every,
                                        objective=args.adaptive_objective, bucket_sizes=args.adaptive_bucket_sizes,
                                        candidates=args.adaptive_candidates)
    except ValueError as err:
        sys.exit(f"--adaptive: {err}")


def median_step_time(times) -> float:
    """Median step time in seconds, without the first step (compilation)."""
    return float(np.median(times[1:] if len(times) > 1 else times))


def header(name: str, args, params, world: int, wire: int) -> str:
    n = sum(v.size for v in jax.tree.leaves(params))
    full = bytes_on_wire(params, world, jax_cgx.CompressionConfig(bits=32))
    return (f"{name}: {world} x {jax.devices()[0].platform} devices, {n:,} parameters, {describe(args)}: "
            f"{human_bytes(wire)} on the wire per device per step ({full / max(wire, 1):.2f}x less than "
            f"float32's {human_bytes(full)}); batch {args.batch}, {args.steps} steps, {args.optimizer} lr {args.lr:g}")


def save_plot(path: str, losses, title: str, ylabel: str = "training loss") -> None:
    """The loss of every step and its moving average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = np.asarray(losses, dtype=float)
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, alpha=0.3, lw=0.8, label="every step")
    ax.plot(np.arange(window, len(losses) + 1), smooth, lw=1.5, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
