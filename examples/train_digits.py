"""Data-parallel training of an MLP on scikit-learn's digits, with a compressed gradient mean
==========================================================================================


    python examples/train_digits.py                                   # uncompressed (pmean)
    python examples/train_digits.py --compressor maxmin --bits 4      # 4-bit max-min quantization
    python examples/train_digits.py --compressor maxmin --bits 2 --error-feedback
    python examples/train_digits.py --compressor cast                 # bfloat16 mean
    python examples/train_digits.py --compressor powersgd --rank 2
    python examples/train_digits.py --compressor topk --ratio 0.01 --plot loss.png

The 8x8 digit images bundled with scikit-learn (1,797 of them; 1,347 to train, 450 to test, a fixed
stratified split, standardized) train an MLP 64-256-256-10 on 8 simulated CPU devices: each device
computes the gradient of its share of the batch, the compressor chosen averages them, SGD with
momentum (or Adam) follows. It prints the loss, the step time and the bytes each device sends per
step, and the final test accuracy. Everything is seeded: the same command gives the same numbers.
"""

import argparse
import sys

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax

SIZES = (64, 256, 256, 10)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_args(p, steps=400, batch=256, lr=0.05, log_every=50)
    return p.parse_args(argv)


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): the fixed split, standardized with the training statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32), digits.target.astype(np.int32),
        test_size=450, stratify=digits.target, random_state=seed,
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def init_params(key, sizes=SIZES):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def logits_fn(params, x, mark=None):
    """``mark(i, layer)``: where each layer is used (jax_cgx.reduce_in_backward; --reduce-in-backward)."""
    for i, layer in enumerate(params):
        layer = mark(i, layer) if mark else layer
        x = x @ layer["w"] + layer["b"]
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return x


def loss_fn(params, x, y, mark=None):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x, mark), y).mean()


def correct(params, x, y):
    return (jnp.argmax(logits_fn(params, x), -1) == y).astype(jnp.float32)


def run(args) -> dict:
    """Train as ``args`` says; returns final_accuracy (percent), losses, bytes_per_step, step_time (s)."""
    x_train, y_train, x_test, y_test = load_data()
    if args.batch % args.devices:
        sys.exit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    compressor, optimizer = _common.make_optimizer(args, optax.cosine_decay_schedule(args.lr, args.steps))
    dp = _common.DataParallel(loss_fn, compressor, optimizer, _common.mesh_devices(args.devices),
                              mark=_common.backward_marker(args), backend=args.backend)
    params, state = dp.init(init_params(jax.random.key(args.seed)), (x_train[:args.batch], y_train[:args.batch]))
    wire = _common.wire_bytes(args, params, dp.world)
    print(_common.header("digits MLP", args, params, dp.world, wire), flush=True)

    rng = np.random.default_rng(args.seed)

    def next_batch(step):
        idx = rng.choice(len(x_train), args.batch, replace=False)
        return x_train[idx], y_train[idx]

    params, state, losses, times = _common.train(args, dp, params, state, next_batch, wire=wire)
    accuracy = 100 * dp.evaluate(correct, params, x_test, y_test)
    train_accuracy = 100 * dp.evaluate(correct, params, x_train, y_train)
    step_time = _common.median_step_time(times)
    print(f"final: test accuracy {accuracy:.2f}% (train {train_accuracy:.2f}%), loss {losses[-1]:.4f}, "
          f"step {step_time * 1e3:.2f} ms (median; first step with compilation {times[0]:.1f} s), "
          f"{_common.human_bytes(wire)} on the wire per device per step", flush=True)
    if args.plot:
        _common.save_plot(args.plot, losses, f"digits MLP, {dp.world} devices, {_common.describe(args)}: "
                                             f"test accuracy {accuracy:.2f}%")
        print(f"wrote {args.plot}")
    return dict(final_accuracy=accuracy, train_accuracy=train_accuracy, losses=losses, bytes_per_step=wire,
                step_time=step_time)


if __name__ == "__main__":
    ARGS = parse_args()
    _common.request_cpu_devices(ARGS.devices)
    run(ARGS)
    sys.exit(0)
