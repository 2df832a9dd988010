"""A Flax NNX CNN with BatchNorm and Dropout, data-parallel with jax_cgx, on scikit-learn's digits
===============================================================================================


    pip install -e ".[flax]"
    python examples/train_flax_cnn.py                       # 4-bit gradients, BatchNorm per device
    python examples/train_flax_cnn.py --sync-batch-stats    # BatchNorm over the whole batch
    python examples/train_flax_cnn.py --bits 32             # the exact mean, for comparison

The recipe of docs/flax.md ("BatchNorm, Dropout, metrics, nnx.Optimizer"), which quotes this file;
tests/optax/test_flax_example.py runs it. A Flax user's step, as in Flax's MNIST example
(``nnx.jit``, ``nnx.Optimizer``, ``nnx.MultiMetric``), with ``jax_cgx.data_parallel_value_and_grad``
in place of ``nnx.value_and_grad``:

- the loss sees one device's shard of the batch; the BatchNorm statistics and the dropout key
  reach it as keyword arguments, the same on every device and not differentiated;
- BatchNorm normalizes each device's shard with that shard's statistics, unless
  ``--sync-batch-stats`` averages them over the devices;
- each device draws its own dropout mask (the key folded with the device's index);
- the updated BatchNorm statistics and the per-example logits come back through ``has_aux``.
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


class CNN(nnx.Module):
    """Flax's MNIST CNN, shrunk for 8x8 digits: conv, BatchNorm, pool, dense, BatchNorm, dropout, dense."""

    def __init__(self, *, dropout: float = 0.25, sync_batch_stats: bool = False, rngs: nnx.Rngs):
        # axis_name: BatchNorm's batch mean and variance are averaged over the devices (lax.pmean)
        # inside the step, so every device normalizes with the whole batch's statistics.
        axis_name = AXIS if sync_batch_stats else None
        self.conv = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
        self.linear = nnx.Linear(4 * 4 * 16, 64, rngs=rngs)
        self.bn2 = nnx.BatchNorm(64, axis_name=axis_name, rngs=rngs)
        self.dropout = nnx.Dropout(dropout)  # no Rngs of its own: the key comes with each call
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        x = nnx.relu(self.bn1(self.conv(x[..., None])))  # [batch, 8, 8] -> [batch, 8, 8, 16]
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.bn2(self.linear(x))), rngs=rngs)
        return self.out(x)


def make_loss_fn(graphdef):
    """One device's loss, ``loss_fn(params, x, y, *, batch_stats, dropout_key) -> (loss, (batch_stats, logits))``."""

    def loss_fn(params, x, y, *, batch_stats, dropout_key):
        model = nnx.merge(graphdef, params, batch_stats)
        # dropout_key is this device's own (device_keys below): each device draws its own mask.
        logits = model(x, rngs=dropout_key)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        # aux=("mean", "batch") below: the running statistics become their mean over the devices,
        # the logits the whole batch's rows.
        return loss, (nnx.state(model, nnx.BatchStat), logits)

    return loss_fn


def make_train_step(mesh, config):
    """``train_step(model, optimizer, metrics, x, y, dropout_key) -> loss``; ``x``, ``y`` split over AXIS."""

    @nnx.jit
    def train_step(model, optimizer, metrics, x, y, dropout_key):
        graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        grad_fn = jax_cgx.data_parallel_value_and_grad(make_loss_fn(graphdef), mesh=mesh, axis_name=AXIS,
                                                       config=config, has_aux=True, aux=("mean", "batch"),
                                                       device_keys=("dropout_key",))
        # x and y are split over the devices; keyword arguments reach loss_fn whole, undifferentiated.
        (loss, (batch_stats, logits)), grads = grad_fn(params, x, y, batch_stats=batch_stats,
                                                       dropout_key=dropout_key)
        nnx.update(model, batch_stats)
        optimizer.update(model, grads)  # grads: the compressed mean over the devices
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    return train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=4, help="1..8, or 32 for an exact mean (default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size,
                   help="values per bucket (default: %(default)s)")
    p.add_argument("--min-size", type=int, default=jax_cgx.CompressionConfig.min_size,
                   help="leaves with fewer values are averaged exactly (default: %(default)s)")
    p.add_argument("--layer-min-size", type=int, default=1024,
                   help="smaller leaves (and biases, BatchNorm's) are averaged exactly; 0: every leaf "
                        "compressed (default: %(default)s)")
    p.add_argument("--sync-batch-stats", action="store_true",
                   help="BatchNorm averages its batch statistics over the devices (default: each its own)")
    p.add_argument("--dropout", type=float, default=0.25, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=200, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=128, help="global batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's rate (default: %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50, help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    return args


def compression(bits: int, bucket_size: int, layer_min_size: int = 1024,
                min_size: int = jax_cgx.CompressionConfig.min_size):
    """The weight matrices at ``bits``; biases, BatchNorm scales and small leaves exact (with
    ``layer_min_size`` 0: only leaves under ``min_size`` values exact)."""
    config = jax_cgx.CompressionConfig(bits=bits, bucket_size=bucket_size, min_size=min_size)
    return cgx_optax.layer_filter(config, layer_min_size) if layer_min_size else config


def run(args) -> dict:
    """Train as ``args`` says; returns losses, test_accuracy (percent) and step_time (s, median)."""
    x_train, y_train, x_test, y_test = load_data()
    x_train, x_test = x_train.reshape(-1, 8, 8), x_test.reshape(-1, 8, 8)
    mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=_common.mesh_devices(args.devices))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    model = CNN(dropout=args.dropout, sync_batch_stats=args.sync_batch_stats, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    for state in (model, optimizer, metrics):  # replicated on the mesh, where train_step leaves them
        nnx.update(state, jax.device_put(nnx.state(state), replicated))
    train_step = make_train_step(mesh, compression(args.bits, args.bucket_size, args.layer_min_size, args.min_size))

    print(f"Flax NNX CNN with BatchNorm ({'averaged over' if args.sync_batch_stats else 'per'} device) and "
          f"dropout {args.dropout}, {args.devices} devices, "
          f"{'exact mean' if args.bits == 32 else f'{args.bits}-bit mean'}", flush=True)
    rng, key = np.random.default_rng(args.seed), jax.random.key(args.seed)
    losses, times = [], []
    with jax.set_mesh(mesh):  # the metrics' sums, reduced over the devices, are read on this mesh
        for step in range(args.steps):
            idx = rng.choice(len(x_train), args.batch, replace=False)
            x, y = jax.device_put(x_train[idx], sharded), jax.device_put(y_train[idx], sharded)
            t0 = time.perf_counter()
            losses.append(float(train_step(model, optimizer, metrics, x, y, jax.random.fold_in(key, step))))
            times.append(time.perf_counter() - t0)
            if args.log_every and (step + 1) % args.log_every == 0:
                m = metrics.compute()
                print(f"step {step + 1:4d}  loss {m['loss']:.4f}  accuracy {100 * m['accuracy']:.1f}%  "
                      f"{times[-1] * 1e3:.1f} ms", flush=True)
                metrics.reset()
    model.eval()  # BatchNorm from its running statistics, no dropout
    test_accuracy = 100 * float(jnp.mean(jnp.argmax(model(jnp.asarray(x_test)), -1) == y_test))
    step_time = float(np.median(times[1:] if len(times) > 1 else times))
    print(f"final: test accuracy {test_accuracy:.2f}%, loss {losses[-1]:.4f}, step {step_time * 1e3:.2f} ms "
          f"(median)", flush=True)
    return dict(losses=losses, test_accuracy=test_accuracy, step_time=step_time)

if __name__ == "__main__":
    ARGS = parse_args()
    _common.request_cpu_devices(ARGS.devices)
    run(ARGS)
    sys.exit(0)
