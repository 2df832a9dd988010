"""How much noise each adaptive plan puts into Adam's steps: the word transformer, mid-training.

Trains ``examples/train_charlm.py``'s transformer on the help topics as words (``--words``, 4096)
uncompressed with Adam for ``--steps`` steps (batch 64, the rate decaying over 400), then splits the
next batch into ``--devices`` parts, one part's gradient standing for each device's own, and plans
within 4-bit and 3-bit bytes under each objective of ``jax_cgx.adaptive.leaf_errors``: ``relative``,
``adam`` (each value's error against its own square) and ``adam`` with Adam's own second moment
(``second_moment=``: bias-corrected ``nu``). Every plan, and uniform 3-, 4- and 8-bit, is then scored
by what Adam sees, the sum over values of ``e / (nu + e)`` (each value's share of noise in its step,
averaged over the devices), relative to uniform 4-bit's::

    python benchmarks/plan_noise.py                 # after 100 steps
    python benchmarks/plan_noise.py --steps 300
    python benchmarks/plan_noise.py --candidates 1 2 3 4 5 6 7 8    # widths from 1 bit

Uniform widths are in buckets of 512 (``--bucket-sizes`` must hold it). (docs/training.md, "Each value
against its own scale", "What Adam sees, per plan".)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_charlm  # noqa: E402

import jax_cgx  # noqa: E402
from jax_cgx.adaptive import CANDIDATES, EXACT, LeafPlan, choose_bits, leaf_bytes, leaf_errors  # noqa: E402

UNIFORM_BUCKET = 512


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, default=4096, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=100, help="uncompressed Adam steps first (default: %(default)s)")
    p.add_argument("--devices", type=int, default=2, help="the batch's split (default: %(default)s)")
    p.add_argument("--bucket-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 4096],
                   help="(default: %(default)s)")
    p.add_argument("--candidates", type=int, nargs="+", default=list(CANDIDATES),
                   help="the widths a leaf may get (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.devices < 1 or 64 % args.devices:
        p.error("--steps must be at least 1 and --devices divide the batch of 64")
    buckets = tuple(sorted(set(args.bucket_sizes)))  # leaf_errors' columns: bucket sizes sorted, then widths
    widths = tuple(sorted(set(args.candidates)))
    if UNIFORM_BUCKET not in buckets or not {3, 4, 8} <= set(widths) or not set(widths) <= set(range(1, 9)):
        p.error(f"--bucket-sizes must hold {UNIFORM_BUCKET} and --candidates 3, 4 and 8 (the uniform plans), "
                "all in 1..8")

    model = train_charlm.parse_args(["--words", str(args.words)])
    train_ids, _, symbols = train_charlm.load_corpus(0.1, args.words)
    T = model.context
    params = train_charlm.init_params(jax.random.key(args.seed), len(symbols), model.d_model, model.layers, T)

    def loss(p, t):
        return train_charlm.sequence_loss(p, t, model.heads).mean()

    adam = optax.scale_by_adam()
    optimizer = optax.chain(adam, optax.scale_by_learning_rate(optax.cosine_decay_schedule(0.003, 400)))
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, tokens):
        updates, state = optimizer.update(jax.grad(loss)(params, tokens), state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(args.seed)

    def batch():
        starts = rng.integers(0, len(train_ids) - T - 1, 64)
        return train_ids[starts[:, None] + np.arange(T + 1)]

    for _ in range(args.steps):
        params, state = step(params, state, batch())
    adam_state = state[0]
    nu = jax.tree.map(lambda v: v / (1 - 0.999 ** int(adam_state.count)), adam_state.nu)  # bias-corrected
    tokens = batch()
    grad_fn = jax.jit(jax.grad(loss))  # one compilation for every part (eagerly: ~200 small ones)
    grads = [grad_fn(params, t) for t in np.split(tokens, args.devices)]

    config = jax_cgx.CompressionConfig(bits=4, min_size=1024, bucket_size=UNIFORM_BUCKET)  # --layer-min-size 1024

    def errors(objective, second_moment=None):  # averaged over the devices, as Planner.leaf_errors does
        return np.mean([np.asarray(leaf_errors(g, config, widths, None, objective, buckets, second_moment))
                        for g in grads], axis=0)

    seen = errors("adam", nu)  # what Adam sees: the score

    def score(plans) -> float:
        return sum(0.0 if p.bits == EXACT else
                   seen[i, buckets.index(p.bucket_size) * len(widths) + widths.index(p.bits)]
                   for i, p in enumerate(plans))

    def plan(budget, errs):
        return choose_bits(grads[0], budget_bits=budget, candidates=widths, bucket_sizes=buckets, config=config,
                           errors=errs, return_plan=True)[1]

    objectives = {"relative": errors("relative"), "adam": errors("adam"), "adam, second_moment=nu": seen}
    planned = {f"within {budget}-bit bytes, {name}": plan(budget, errs)
               for budget in (4, 3) for name, errs in objectives.items()}
    leaves = next(iter(planned.values()))
    plans = {f"uniform {b}-bit": [LeafPlan(p.path, p.size, b, 0.0, leaf_bytes(p.size, b, UNIFORM_BUCKET),
                                           UNIFORM_BUCKET) for p in leaves] for b in (8, 4, 3)}
    plans.update(planned)
    reference = score(plans["uniform 4-bit"])
    values = sum(p.size for p in plans["uniform 4-bit"])
    print(f"after {args.steps} uncompressed Adam steps, the next batch in {args.devices} parts (one per device), "
          f"{values:,} values planned")
    print(f"{'plan':<44} {'bytes':>9} {'noise (x uniform 4-bit)':>24}  widths/buckets")
    rows = {}
    for name, chosen in plans.items():
        rows[name] = score(chosen) / reference
        choices = " ".join(f"{p.bits}/{p.bucket_size}" if p.bits != EXACT else "exact" for p in chosen)
        print(f"{name:<44} {sum(p.bytes for p in chosen):>9,} {rows[name]:>24.3f}  {choices}")
    return rows


if __name__ == "__main__":
    main()
