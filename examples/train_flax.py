"""A Flax NNX model on scikit-learn's digits, its gradients averaged by jax_cgx, two ways
======================================================================================


    pip install -e ".[flax]"
    python examples/train_flax.py                                   # a plain jax.jit step, 4-bit mean
    python examples/train_flax.py --way optax --error-feedback      # jax_cgx.optax in a shard_map step
    python examples/train_flax.py --bits 32                         # no compression, for comparison

``--way jit`` (default) is what most JAX training loops look like: one ``jax.jit`` step,
parameters replicated and the batch sharded over a ``"data"`` mesh axis.
``jax_cgx.data_parallel_value_and_grad`` takes the place of ``jax.value_and_grad`` and returns
the gradient averaged with ``compressed_pmean``, so any optax optimizer follows unchanged.

``--way optax`` uses the optax transformation ``jax_cgx.optax.compressed_mean``. With
``--error-feedback`` each device carries its own quantization residual from step to step: state
that differs between devices, which a replicated ``jax.jit`` state cannot hold. So this step is
written in ``jax.shard_map``, with the residual sharded over the devices
(``compressed_mean_state_specs``).

The model is an ``nnx.Module``. ``nnx.split`` turns it into a static graph definition and a
pytree of parameters, which is what jax_cgx and optax see; ``nnx.merge`` rebuilds the module
inside the loss. The data: the 8x8 digits bundled with scikit-learn (1,347 images to train,
450 to test), on 8 simulated CPU devices.
"""

import argparse
import sys
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_digits import load_data

import jax_cgx
import jax_cgx.optax as cgx_optax

AXIS = "data"


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(din, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--way", choices=("jit", "optax"), default="jit",
                   help="jit: data_parallel_value_and_grad in a jax.jit step; optax: "
                        "jax_cgx.optax.compressed_mean in a shard_map step (default: %(default)s)")
    p.add_argument("--bits", type=int, default=4, help="1..8, or 32 for an exact mean (default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=128, help="values per bucket (default: %(default)s)")
    p.add_argument("--error-feedback", action="store_true", help="--way optax: carry each device's residual")
    p.add_argument("--hidden", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=256, help="global batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's peak rate, cosine decay (default: %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50, help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.error_feedback and args.way != "optax":
        p.error("--error-feedback needs --way optax (the residual is state the optax transform carries)")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    return args


def jit_step(loss_fn, mesh, config, optimizer):
    """A plain jax.jit step: the gradient from data_parallel_value_and_grad, then any optimizer."""
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, axis_name=AXIS, config=config)

    def init(params):
        return optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return init, step


def optax_step(loss_fn, mesh, config, optimizer, error_feedback: bool, params):
    """A shard_map step with jax_cgx.optax.compressed_mean before the optimizer; its residuals per device."""
    tx = optax.chain(cgx_optax.compressed_mean(AXIS, config, error_feedback=error_feedback), optimizer)
    abstract = jax.eval_shape(tx.init, params)
    specs = (cgx_optax.compressed_mean_state_specs(abstract[0], AXIS), jax.tree.map(lambda _: P(), abstract[1]))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def local(params, opt_state, x, y):
        # This device's gradient: differentiate a copy of the parameters typed as varying over
        # the axis (the gradient of the replicated ones would come out already summed by JAX).
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(), specs, P())))
    return init, step


def run(args) -> dict:
    """Train as ``args`` says; returns final_accuracy (percent), losses and step_time (s)."""
    x_train, y_train, x_test, y_test = load_data()
    mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=_common.mesh_devices(args.devices))
    model = MLP(x_train.shape[1], args.hidden, 10, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # Biases and other small leaves exact, the weight matrices compressed.
    config = None if args.bits == 32 else cgx_optax.layer_filter(
        jax_cgx.CompressionConfig(bits=args.bits, bucket_size=args.bucket_size), 1024)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    if args.way == "jit":
        init, step = jit_step(loss_fn, mesh, config, optimizer)
    else:
        init, step = optax_step(loss_fn, mesh, config, optimizer, args.error_feedback, params)
    opt_state = init(params)

    rng = np.random.default_rng(args.seed)
    sharded = NamedSharding(mesh, P(AXIS))
    print(f"Flax NNX MLP, {sum(v.size for v in jax.tree.leaves(params)):,} parameters, {args.devices} devices, "
          f"--way {args.way}, {'exact mean' if args.bits == 32 else f'{args.bits}-bit mean'}"
          f"{', error feedback' if args.error_feedback else ''}", flush=True)
    losses, times = [], []
    for i in range(args.steps):
        idx = rng.choice(len(x_train), args.batch, replace=False)
        x, y = jax.device_put(x_train[idx], sharded), jax.device_put(y_train[idx], sharded)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        if args.log_every and (i + 1) % args.log_every == 0:
            print(f"step {i + 1:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:.1f} ms", flush=True)

    nnx.update(model, jax.device_get(params))  # the trained parameters back in the module
    accuracy = 100 * float(jnp.mean(jnp.argmax(model(jnp.asarray(x_test)), -1) == y_test))
    step_time = float(np.median(times[1:] if len(times) > 1 else times))
    print(f"final: test accuracy {accuracy:.2f}%, loss {losses[-1]:.4f}, step {step_time * 1e3:.2f} ms (median)",
          flush=True)
    return dict(final_accuracy=accuracy, losses=losses, step_time=step_time)


if __name__ == "__main__":
    ARGS = parse_args()
    _common.request_cpu_devices(ARGS.devices)
    run(ARGS)
    sys.exit(0)
