"""Data-parallel training of a small character-level transformer, with a compressed gradient mean
==============================================================================================


    python examples/train_charlm.py                                   # uncompressed (pmean)
    python examples/train_charlm.py --compressor maxmin --bits 4
    python examples/train_charlm.py --compressor powersgd --rank 2 --plot loss.png
    python examples/train_charlm.py --words 4096 --compressor maxmin --adaptive 4 --adaptive-bucket-sizes 64 512

The corpus is the text of Python's own help topics (``pydoc_data.topics``, shipped with CPython, no
download: 465,126 characters of English and code in Python 3.11; other versions differ a little); the
last 10% is held out for validation. A 2-layer decoder-only transformer (d_model 64, 4 heads, context
64, learned positions, pre-LayerNorm) learns to predict the next character on 8 simulated CPU
devices: each device computes the gradient of its share of the batch, the compressor chosen averages
them, Adam follows (``--optimizer sgd``: SGD with momentum). It prints the loss, the step time and
the bytes each device sends per step, and the final validation loss (nats per character).

``--words V`` reads the same text as words instead: the ``V`` most frequent words and punctuation marks
(114,029 of them; 4,194 distinct), the rest one symbol. Its embedding tables then hold most of the
parameters and get sparse, heavy-tailed gradients: the model where per-leaf bucket sizes pay
(docs/training.md, "Adaptive bit widths"). The loss is then in nats per word.
"""

import argparse
import collections
import functools
import re
import sys

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_cgx


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_args(p, steps=1200, batch=64, lr=0.003, log_every=200)
    p.set_defaults(optimizer="adam")
    p.add_argument("--context", type=int, default=64, help="characters per sequence (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out tail of the text (default: %(default)s)")
    p.add_argument("--words", type=int, metavar="V",
                   help="read the text as words: the V most frequent words and marks, the rest one symbol")
    return p.parse_args(argv)


def load_corpus(val_fraction: float = 0.1, words: int | None = None):
    """(train ids, validation ids, vocabulary): the help topics in a fixed order, one id per character,
    or with ``words``, per word or punctuation mark (the ``words`` most frequent, then one for the rest)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    if words:
        tokens = re.findall(r"\w+|[^\w\s]", text)
        vocab = [w for w, _ in collections.Counter(tokens).most_common(words)] + ["<other>"]
    else:
        tokens, vocab = text, sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.array([index.get(c, len(vocab) - 1) for c in tokens], np.int32)
    split = int(len(ids) * (1 - val_fraction))
    return ids[:split], ids[split:], vocab


def validation_windows(val_ids, context: int) -> np.ndarray:
    """Every non-overlapping window of ``context + 1`` characters of the held-out tail."""
    n = (len(val_ids) - 1) // context
    return np.stack([val_ids[i * context: i * context + context + 1] for i in range(n)])


def init_params(key, vocab: int, d: int, layers: int, context: int):
    keys = iter(jax.random.split(key, 3 + 4 * layers))

    def dense(fan_in, fan_out, scale=1.0):
        return jax.random.normal(next(keys), (fan_in, fan_out)) * scale / jnp.sqrt(fan_in)

    def norm():
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    out = 1 / jnp.sqrt(2 * layers)  # residual branches start small
    return {
        "embed": jax.random.normal(next(keys), (vocab, d)),
        "pos": jax.random.normal(next(keys), (context, d)) * 0.1,
        "blocks": [
            {"ln1": norm(), "qkv": dense(d, 3 * d), "proj": dense(d, d, out),
             "ln2": norm(), "fc1": dense(d, 4 * d), "fc1_b": jnp.zeros(4 * d), "fc2": dense(4 * d, d, out),
             "fc2_b": jnp.zeros(d)}
            for _ in range(layers)
        ],
        "ln_f": norm(),
        "unembed": dense(d, vocab),
    }


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def logits_fn(params, tokens, heads: int):
    batch, length = tokens.shape
    x = params["embed"][tokens] + params["pos"][:length]
    d = x.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    for blk in params["blocks"]:
        h = layer_norm(x, blk["ln1"])
        q, k, v = jnp.split((h @ blk["qkv"]).reshape(batch, length, 3 * heads, d // heads), 3, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // heads)
        attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + jnp.einsum("bhts,bshd->bthd", attn, v).reshape(batch, length, d) @ blk["proj"]
        h = layer_norm(x, blk["ln2"])
        x = x + jax.nn.gelu(h @ blk["fc1"] + blk["fc1_b"]) @ blk["fc2"] + blk["fc2_b"]
    return layer_norm(x, params["ln_f"]) @ params["unembed"]


def sequence_loss(params, tokens, heads: int):
    """One value per sequence of ``tokens`` (``[batch, context + 1]``): its mean next-token loss."""
    logits = logits_fn(params, tokens[:, :-1], heads)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(-1)


def run(args) -> dict:
    """Train as ``args`` says; returns final_val_loss (nats/char), losses, bytes_per_step, step_time (s)."""
    train_ids, val_ids, vocab = load_corpus(args.val_fraction, args.words)
    unit = "word" if args.words else "char"
    if args.batch % args.devices:
        sys.exit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    T = args.context

    per_sequence = functools.partial(sequence_loss, heads=args.heads)  # one object: evaluate compiles it once

    def loss_fn(params, tokens):
        return per_sequence(params, tokens).mean()

    if args.reduce_in_backward:
        sys.exit("--reduce-in-backward: train_digits.py marks its layers; this example does not (yet)")
    compressor, optimizer = _common.make_optimizer(args, optax.cosine_decay_schedule(args.lr, args.steps))
    params = init_params(jax.random.key(args.seed), len(vocab), args.d_model, args.layers, T)
    planner = _common.adaptive_planner(args, params)
    errors_fn = None if planner is None else (lambda grads: planner.leaf_errors(grads, _common.AXIS))
    dp = _common.DataParallel(loss_fn, compressor, optimizer, _common.mesh_devices(args.devices),
                              backend=args.backend, errors_fn=errors_fn)
    params, state = dp.init(params, (np.zeros((args.batch, T + 1), np.int32),))
    wire = _common.wire_bytes(args, params, dp.world)
    print(f"corpus: pydoc_data.topics, {len(train_ids):,} {unit}s to train, {len(val_ids):,} to validate, "
          f"{len(vocab)} distinct")
    print(_common.header(f"{unit} transformer ({args.layers} layers, d_model {args.d_model}, context {T})",
                         args, params, dp.world, wire), flush=True)

    rng = np.random.default_rng(args.seed)
    offsets = np.arange(T + 1)

    def next_batch(step):
        starts = rng.integers(0, len(train_ids) - T - 1, args.batch)
        return (train_ids[starts[:, None] + offsets],)

    params, state, losses, times = _common.train(args, dp, params, state, next_batch, wire=wire, planner=planner)
    val_loss = dp.evaluate(per_sequence, params, validation_windows(val_ids, T))
    step_time = _common.median_step_time(times)
    print(f"final: validation loss {val_loss:.4f} nats/{unit} ({val_loss / np.log(2):.3f} bits), training loss "
          f"{np.mean(losses[-20:]):.4f} (last 20 steps), step {step_time * 1e3:.1f} ms (median; first step with "
          f"compilation {times[0]:.1f} s), {_common.human_bytes(wire)} on the wire per device per step", flush=True)
    if args.plot:
        _common.save_plot(args.plot, losses, f"{unit} transformer, {dp.world} devices, {_common.describe(args)}: "
                                             f"validation loss {val_loss:.3f}")
        print(f"wrote {args.plot}")
    result = dict(final_val_loss=val_loss, losses=losses, bytes_per_step=wire, step_time=step_time)
    if planner is not None:
        print(f"adaptive: {planner.changes} plan changes, {planner.compilations} compiled steps; the last plan:\n"
              + (jax_cgx.adaptive.describe(planner.plans) if planner.plans else "uniform"), flush=True)
        result.update(plan_changes=planner.changes, compilations=planner.compilations)
    return result


if __name__ == "__main__":
    ARGS = parse_args()
    _common.request_cpu_devices(ARGS.devices)
    run(ARGS)
    sys.exit(0)
