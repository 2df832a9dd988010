"""The char transformer of train_charlm.py, trained ZeRO-style
===========================================================

The optimizer's state sharded over the devices, the gradients reduce-scattered and the parameters
all-gathered, both compressed.

    python examples/train_sharded.py                                  # 4-bit gradients, 8-bit parameters
    python examples/train_sharded.py --grad-bits 32 --param-bits 32   # sharded, exact
    python examples/train_sharded.py --replicated                     # plain data parallel, pmean

``jax_cgx.optax.sharded(optax.adam(...), "data", grad_config=..., param_config=...)`` wraps Adam:
device ``j`` keeps block ``j`` of every parameter in full precision (the master shard) and Adam's
moments for it, 1/W of the replicated optimizer's memory. Each step reduce-scatters the gradients
with ``compressed_psum_scatter`` (each contribution quantized once), updates the master shard, and
all-gathers the parameters with ``compressed_all_gather`` (quantized for the forward pass only, as
DeepSpeed ZeRO++'s qwZ: the master stays exact). It prints the loss, the step time, the bytes each
device sends per step, and the validation loss (nats per character) to compare with ``--replicated``.
"""

import argparse
import functools
import sys
import time

import _common
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_charlm import init_params, load_corpus, sequence_loss, validation_windows

import jax_cgx
import jax_cgx.optax as cgx_optax

AXIS = "data"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grad-bits", type=int, default=4, help="the gradients' reduce-scatter: 1..8, 16 or 32 "
                                                            "(default: %(default)s)")
    p.add_argument("--param-bits", type=int, default=8, help="the parameters' all-gather: 1..8, 16 or 32 "
                                                             "(default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--replicated", action="store_true", help="plain data parallel instead: pmean and a "
                                                             "replicated Adam, for comparison")
    p.add_argument("--steps", type=int, default=1200, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="global batch of sequences (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.003, help="Adam's peak rate, cosine decay (default: %(default)s)")
    p.add_argument("--context", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--d-model", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--log-every", type=int, default=200, help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    return args


def config(bits: int, bucket_size: int) -> jax_cgx.CompressionConfig:
    # min_size: the small leaves (biases, LayerNorm) exact, as compressed_mean's layer filter does.
    return jax_cgx.CompressionConfig(bits=bits, bucket_size=bucket_size, min_size=1024)


def run(args) -> dict:
    """Train as ``args`` says; returns final_val_loss (nats/char), losses, bytes_per_step, step_time (s)."""
    train_ids, val_ids, vocab = load_corpus()
    T = args.context
    mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=_common.mesh_devices(args.devices))

    per_sequence = functools.partial(sequence_loss, heads=args.heads)

    def loss_fn(params, tokens):
        return per_sequence(params, tokens).mean()

    params = jax.device_put(init_params(jax.random.key(args.seed), len(vocab), args.d_model, args.layers, T),
                            NamedSharding(mesh, P()))
    adam = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps))
    w = args.devices
    if args.replicated:
        state, specs = adam.init(params), P()
        wire = jax_cgx.bytes_on_wire(params, w, jax_cgx.CompressionConfig(bits=32))

        def update(grads, state, params):
            updates, state = adam.update(jax.lax.pmean(grads, AXIS), state, params)
            return optax.apply_updates(params, updates), state
    else:
        opt = cgx_optax.sharded(adam, AXIS, grad_config=config(args.grad_bits, args.bucket_size),
                                param_config=config(args.param_bits, args.bucket_size))
        specs = opt.state_specs(params, mesh)
        state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
        flat = jax.tree.map(lambda p: jax.ShapeDtypeStruct((-(-p.size // w) * w,), p.dtype), params)
        shards = jax.tree.map(lambda p: jax.ShapeDtypeStruct((p.shape[0] // w,), p.dtype), flat)
        wire = (jax_cgx.bytes_on_wire(flat, w, config(args.grad_bits, args.bucket_size), op="psum_scatter")
                + jax_cgx.bytes_on_wire(shards, w, config(args.param_bits, args.bucket_size), op="all_gather"))

        def update(grads, state, params):
            del params
            return opt.update(grads, state)

    def local(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), tokens)
        params, state = update(grads, state, params)
        return params, state, jax.lax.pmean(loss, AXIS)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs, P())),
                   donate_argnums=(0, 1))
    how = ("replicated Adam, pmean" if args.replicated else
           f"sharded Adam, {args.grad_bits}-bit gradient reduce-scatter, {args.param_bits}-bit parameter all-gather")
    print(f"char transformer, {sum(v.size for v in jax.tree.leaves(params)):,} parameters, {w} devices, {how}: "
          f"{_common.human_bytes(wire)} on the wire per device per step", flush=True)

    rng = np.random.default_rng(args.seed)
    offsets = np.arange(T + 1)
    sharded = NamedSharding(mesh, P(AXIS))
    losses, times = [], []
    for i in range(args.steps):
        starts = rng.integers(0, len(train_ids) - T - 1, args.batch)
        tokens = jax.device_put(train_ids[starts[:, None] + offsets], sharded)
        t0 = time.perf_counter()
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        if args.log_every and (i + 1) % args.log_every == 0:
            print(f"step {i + 1:5d}  loss {losses[-1]:.4f}  {np.median(times[-args.log_every:]) * 1e3:.1f} ms",
                  flush=True)

    windows = validation_windows(val_ids, T)
    val_loss = float(jax.jit(lambda p, t: per_sequence(p, t).mean())(jax.device_get(params), windows))
    step_time = _common.median_step_time(times)
    print(f"final: validation loss {val_loss:.4f} nats/char, training loss {np.mean(losses[-20:]):.4f} "
          f"(last 20 steps), step {step_time * 1e3:.1f} ms (median)", flush=True)
    return dict(final_val_loss=val_loss, losses=losses, bytes_per_step=wire, step_time=step_time)


if __name__ == "__main__":
    ARGS = parse_args()
    _common.request_cpu_devices(ARGS.devices)
    run(ARGS)
    sys.exit(0)
