"""The exact solver of :func:`~jax_cgx.adaptive.choose_bits`: one option per leaf, least total error
within a byte budget (a multiple-choice knapsack).

A dynamic program over the leaves keeps, after each leaf, every plan so far that no other beats in
both bytes and error (a Pareto frontier, with numpy), bytes counted in units of ``1 / 65536`` of the
budget, rounded up (so a plan never exceeds the budget; for budgets under 64 KiB the unit is one
byte and the optimum is exact). Ties go to the plan found first, in the leaves' order: the same
errors give the same plan on every process.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["solve"]


def solve(options: list[list[tuple[int, float, Any]]], budget: float) -> list[tuple[int, float, Any]]:
    """The option per leaf minimizing the total error with the total bytes within ``budget``:
    :func:`~jax_cgx.adaptive.choose_bits`' exact solver (module docstring), for other error models or choices.

    ``options``: per leaf, a list of ``(bytes, error, label)`` (the label, e.g. a width or a
    ``(width, bucket_size)`` pair, is returned as given). Returns the chosen option of each leaf.

    Args:
      options: per leaf, its options ``(bytes, error, label)``.
      budget: the most bytes the chosen options may take together.

    Returns:
      A list with one option per leaf, each as given in ``options``; empty for no leaves.

    Raises:
      ValueError: no plan fits: the cheapest options of all leaves together exceed ``budget``.
    """
    if not options:
        return []
    unit = max(1.0, budget / 65536)
    limit = math.floor(budget / unit + 1e-9)
    costs = [np.array([math.ceil(o[0] / unit - 1e-9) for o in opts], np.int64) for opts in options]
    errors = [np.array([o[1] for o in opts], np.float64) for opts in options]
    rest = np.cumsum([0] + [int(c.min()) for c in costs[::-1]])[::-1]  # the least the leaves after i cost
    if rest[0] > limit:
        cheapest = sum(min(o[0] for o in opts) for opts in options)
        raise ValueError(f"no plan fits the budget: the cheapest option of every leaf together takes {cheapest:.6g} "
                         f"bytes, the budget is {budget:.6g}. Offer cheaper options (narrower candidates, larger "
                         "bucket sizes: each bucket sends its own scale and minimum) or raise the budget")
    cost, err = np.zeros(1, np.int64), np.zeros(1, np.float64)
    steps = []  # per leaf: (the frontier point each new point extends, the option it takes)
    for i, (c, e) in enumerate(zip(costs, errors)):
        k = len(c)
        total = (cost[:, None] + c[None, :]).ravel()
        error = (err[:, None] + e[None, :]).ravel()
        parent = np.repeat(np.arange(len(cost)), k)
        pick = np.tile(np.arange(k), len(cost))
        ok = total + rest[i + 1] <= limit
        total, error, parent, pick = total[ok], error[ok], parent[ok], pick[ok]
        order = np.lexsort((np.arange(len(total)), error, total))  # by bytes, then error, then first found
        total, error, parent, pick = total[order], error[order], parent[order], pick[order]
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(error)[:-1]])
        keep = error < best_before  # the Pareto frontier: each kept point has less error than any cheaper
        cost, err = total[keep], error[keep]
        steps.append((parent[keep], pick[keep]))
    j = int(np.argmin(err))  # the first of the least errors
    chosen = []
    for parent, pick in reversed(steps):
        chosen.append(int(pick[j]))
        j = int(parent[j])
    return [opts[k] for opts, k in zip(options, reversed(chosen))]
