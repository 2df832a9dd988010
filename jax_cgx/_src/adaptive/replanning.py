"""Re-planning bit widths during training: :class:`Planner`.

A plan from :func:`~jax_cgx.adaptive.choose_bits` is a static config: a step compiled for it
compiles again for another. So the planner re-plans only every ``every`` steps, adopts a new plan
only when it predicts at least ``min_gain`` less error than the current one on the same gradient
(plans that differ by noise are not worth a compilation), and keeps every step it compiled: a plan
that comes back costs nothing. :attr:`Planner.compilations` counts them.

    planner = jax_cgx.adaptive.Planner(params, budget_bits=4, every=100)
    for step in range(steps):
        errors = local_errors(params, x, y) if step % planner.every == 0 else None
        train_step = planner.compiled(make_step)        # make_step(configs) -> a jitted step
        params, opt_state, loss = train_step(params, opt_state, x, y)
        if errors is not None:
            planner.observe(step, params, errors=errors)

``local_errors`` is a jitted ``shard_map`` over the data axis returning
``planner.leaf_errors(local_grads, "data")`` of each device's own gradient: one function for every
plan. (Returned by each plan's step instead, it would compile again with every plan: measured on
a word transformer, 29 s of compiling per new plan instead of 5 s.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_cgx._src.adaptive.choose import (
    CANDIDATES,
    LeafPlan,
    _base,
    _bucket_sizes,
    _check,
    _choose,
    _objective,
    describe,
    leaf_errors,
)
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.collectives.plan import lane
from jax_cgx._src.config import CompressionConfig

__all__ = ["Planner"]

log = logging.getLogger("jax_cgx")


class Planner:
    """Bit widths per leaf for a training run, re-planned from the averaged gradient.

    Args:
      like: a pytree with the gradient's structure, shapes and dtypes (the parameters, or
        ``jax.ShapeDtypeStruct``s).
      budget_bits, candidates, bucket_sizes, config, exact: as for :func:`~jax_cgx.adaptive.choose_bits`.
      every: re-plan at steps ``0, every, 2 every, ...`` (``observe``'s ``step``).
      objective: as for :func:`~jax_cgx.adaptive.choose_bits`.
      min_gain: adopt a new plan only when its predicted error is at most ``1 - min_gain`` times
        the current plan's on the same gradient (0: whenever it differs).

    The first plan, before any gradient, is uniform: the widest candidate within ``budget_bits``, in
    ``config``'s buckets. A plan is keyed by each leaf's ``(bits, bucket_size)``.
    """

    def __init__(self, like, *, budget_bits: float = 4.0, candidates: Sequence[int] = CANDIDATES,
                 bucket_sizes: Sequence[int] | None = None, config: CompressionConfig | None = None,
                 exact: bool = True, every: int = 100, min_gain: float = 0.05, objective: str = "squared"):
        budget, cands = _check(budget_bits, candidates, "Planner")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Planner: every must be a positive number of steps, got {every!r}")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
            raise ValueError(f"Planner: min_gain must be in [0, 1), got {min_gain!r}")
        self.base = _base(config, "Planner")
        self.bucket_sizes = _bucket_sizes(bucket_sizes, self.base, "Planner")
        self.budget_bits, self.candidates = budget, cands
        self.exact = check_bool("Planner", "exact", exact)
        self.every, self.min_gain = every, float(min_gain)
        self.objective = _objective(objective, "Planner")
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
        planned = [lane(p, v, self.base, "Planner") == "quantized" for p, v in with_paths]
        uniform = max(b for b in cands if b <= budget)
        self._configs = treedef.unflatten([self.base.replace(bits=uniform) if q else self.base for q in planned])
        self._choices = tuple((uniform, self.base.bucket_size) for q in planned if q)
        self.plans: list[LeafPlan] | None = None  # the adopted plan's table (None: still uniform)
        self.changes = 0
        self._compiled: dict[tuple, Any] = {}
        self._warned = False

    @property
    def configs(self):
        """The current plan: a pytree of ``CompressionConfig`` (or ``None``: exact), a static config."""
        return self._configs

    @property
    def compilations(self) -> int:
        """Steps :meth:`compiled` has made, one per distinct plan."""
        return len(self._compiled)

    def compiled(self, make_step: Callable[[Any], Any]):
        """``make_step(configs)`` for the current plan, made once per distinct plan (and
        ``make_step``) and kept. Pass the same function every step: a function defined anew each
        time (a lambda in the loop) is a new key, and a new compilation, every step."""
        key = (make_step, self._choices)
        if key not in self._compiled:
            code = getattr(make_step, "__code__", None)
            if code is not None and not self._warned and any(
                    getattr(f, "__code__", None) is code and f is not make_step for f, _ in self._compiled):
                self._warned = True
                log.warning("jax_cgx: Planner.compiled got a new make_step function with the code of one it "
                            "has seen (a function defined anew each step?): each is compiled again. Define "
                            "make_step once, outside the training loop.")
            self._compiled[key] = make_step(self._configs)
        return self._compiled[key]

    def leaf_errors(self, grads, axis_name=None, second_moment=None) -> jax.Array:
        """:func:`~jax_cgx.adaptive.leaf_errors` for this planner's config and candidates: call it
        inside a ``shard_map`` on the devices' own gradients with the data axis (in a function of its
        own, compiled once, not in each plan's step), and give the result to
        :meth:`observe` (the averaged gradient, sent compressed, lies on the grid it was sent on).
        ``second_moment``: as for :func:`~jax_cgx.adaptive.leaf_errors` (``objective="adam"``)."""
        return leaf_errors(grads, self.base, self.candidates, axis_name, self.objective, self.bucket_sizes,
                           second_moment)

    def observe(self, step: int, grads, *, errors=None) -> bool:
        """At a planning step, plan (from ``errors``, :meth:`leaf_errors` averaged over the devices,
        or else from ``grads``, a gradient every process holds alike) and adopt the plan if it gains
        enough; returns whether the plan changed. ``grads`` gives the structure either way."""
        if step % self.every:
            return False
        configs, plans, before = _choose(grads, self.budget_bits, self.candidates, self.base, self.exact, "Planner",
                                         current=self._choices, errors=errors, objective=self.objective,
                                         bucket_sizes=self.bucket_sizes)
        after = sum(p.error for p in plans)
        choices = tuple(p.choice for p in plans)
        if choices == self._choices or after > (1 - self.min_gain) * before:
            return False
        self._configs, self._choices, self.plans = configs, choices, plans
        self.changes += 1
        log.info("jax_cgx: step %d: new bit widths, predicted error %.4g (the previous plan's: %.4g)\n%s",
                 step, after, before, describe(plans))
        return True
