"""Each leaf's quantization error at each width, relative to its own mean square: why per-leaf widths
do or do not pay on the char transformer (docs/training.md, "Adaptive bit widths").

One gradient of ``examples/train_charlm.py``'s transformer at initialization (a batch of 64 windows),
its leaves' expected squared error at each width (``jax_cgx.adaptive.expected_errors``) divided by
the leaf's size and mean square, and the median over buckets of the bucket's range over its RMS
(what sets that error), then the plans ``choose_bits`` makes at 4-bit and 3-bit bytes under both
objectives::

    python benchmarks/leaf_errors.py                  # the characters of the help topics (103 symbols)
    python benchmarks/leaf_errors.py --words 4096     # the same text as words: the 4096 most frequent
                                                      # words and punctuation marks, the rest one symbol

``--bucket-sizes 64 128 256 512 1024 4096`` also prints ``choose_bits(..., bucket_sizes=...)``'s
relative-error plan over each leaf's width *and* bucket size (smaller buckets cost 8 bytes each but
cut a heavy-tailed leaf's range) at the same byte budgets, and the best single (width, bucket size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_charlm  # noqa: E402

import jax_cgx  # noqa: E402
from jax_cgx.adaptive import expected_errors, leaf_bytes  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, metavar="V", help="tokenize into the V most frequent words instead")
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size, help="(default: %(default)s)")
    p.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4, 5, 8], help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--bucket-sizes", type=int, nargs="+", metavar="B",
                   help="also plan width and bucket size per leaf over these bucket sizes")
    args = p.parse_args(argv)

    model = train_charlm.parse_args([])
    if args.words:  # the whole text as words (both parts of train_charlm's split)
        train, val, symbols = train_charlm.load_corpus(words=args.words)
        ids, vocab = np.concatenate([train, val]), len(symbols)
    else:
        ids, _, symbols = train_charlm.load_corpus()
        vocab = len(symbols)
    params = train_charlm.init_params(jax.random.key(args.seed), vocab, model.d_model, model.layers, model.context)
    starts = np.random.default_rng(args.seed).integers(0, len(ids) - model.context - 1, 64)
    tokens = ids[starts[:, None] + np.arange(model.context + 1)]

    def loss(p, t):
        return train_charlm.sequence_loss(p, t, model.heads).mean()

    grads = jax.grad(loss)(params, tokens)
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=args.bucket_size, min_size=1024)
    leaves = [(jax.tree_util.keystr(path), v) for path, v in jax.tree_util.tree_flatten_with_path(grads)[0]
              if v.size >= config.min_size]
    errors = expected_errors([v for _, v in leaves], config, args.widths, objective="relative")
    print(f"vocabulary {vocab}; error per value over the leaf's mean square, at each width; "
          f"crest: median over buckets of range / RMS")
    print(f"{'leaf':28s} {'values':>8s}  " + "  ".join(f"{b:>2d} bits " for b in args.widths) + "  crest")
    for (name, v), row in zip(leaves, errors):
        x = np.asarray(v, np.float64).ravel()
        b = np.concatenate([x, np.full(-x.size % args.bucket_size, x[-1])]).reshape(-1, args.bucket_size)
        rms = np.sqrt((b * b).mean(axis=1))
        crest = np.median((b.max(axis=1) - b.min(axis=1)) / np.where(rms > 0, rms, np.inf))
        print(f"{name:28s} {v.size:8d}  " + "  ".join(f"{e / v.size:8.2e}" for e in row) + f"  {crest:5.1f}")
    for objective in ("relative", "squared"):
        for budget in (4, 3):
            _, plans = jax_cgx.adaptive.choose_bits(grads, budget_bits=budget, config=config, return_plan=True,
                                                    objective=objective)
            print(f"\nchoose_bits(budget_bits={budget}, objective={objective!r}):")
            print(jax_cgx.adaptive.describe(plans))
    if args.bucket_sizes:
        plan_buckets(grads, leaves, args)


def plan_buckets(grads, leaves, args) -> None:
    """``choose_bits(..., bucket_sizes=...)``'s relative-error plan of width and bucket size per leaf,
    against uniform width at ``--bucket-size`` and the best single (width, bucket size), at the bytes
    of uniform 4 and 3 bits."""
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=args.bucket_size, min_size=1024)
    # Every (width, bucket size) for every leaf, for the best single choice: a better default alone.
    totals = {}
    for bucket in args.bucket_sizes:
        errors = expected_errors([v for _, v in leaves], config.replace(bucket_size=bucket), args.widths,
                                 objective="relative")
        for b, column in zip(args.widths, errors.T):
            totals[b, bucket] = (sum(leaf_bytes(v.size, b, bucket) for _, v in leaves), float(column.sum()))
    for budget_bits in (4, 3):
        budget = sum(leaf_bytes(v.size, budget_bits, args.bucket_size) for _, v in leaves)
        uniform = totals[budget_bits, args.bucket_size][1]
        _, plans = jax_cgx.adaptive.choose_bits(grads, budget_bits=budget_bits, candidates=args.widths,
                                                bucket_sizes=args.bucket_sizes, config=config, exact=False,
                                                objective="relative", return_plan=True)
        total = sum(p.error for p in plans)
        best = min((err, choice) for choice, (nbytes, err) in totals.items() if nbytes <= budget)
        print(f"\nwidth and bucket size per leaf, relative error, within uniform {budget_bits}-bit bytes "
              f"(bucket {args.bucket_size}): {total:.4g} against uniform's {uniform:.4g} ({total / uniform:.2f}x); "
              f"the best uniform choice within those bytes, {best[1][0]} bits in buckets of {best[1][1]}: "
              f"{best[0]:.4g} ({best[0] / uniform:.2f}x)")
        print(jax_cgx.adaptive.describe(plans))


if __name__ == "__main__":
    main()
