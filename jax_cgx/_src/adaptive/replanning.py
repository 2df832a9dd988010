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
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cgx._src.adaptive.arguments import base_config, check_bucket_sizes, check_budget, check_objective
from jax_cgx._src.adaptive.choose import (
    CANDIDATES,
    EXACT,
    LeafPlan,
    _choose,
    describe,
    leaf_errors,
)
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.collectives.plan import lane
from jax_cgx._src.config import CompressionConfig

__all__ = ["AUTO_BUCKET_SIZES", "Planner"]

# The bucket sizes a Planner offers by default, beside its config's (docs/training.md measured
# plans over these: the embedding's rows in 64, the rest in 512 or 4096).
AUTO_BUCKET_SIZES = (64, 512, 4096)

log = logging.getLogger("jax_cgx")


class Planner:
    """Bit widths per leaf for a training run, re-planned from the averaged gradient.

    Args:
      like: a pytree with the gradient's structure, shapes and dtypes (the parameters, or
        ``jax.ShapeDtypeStruct`` objects).
      budget_bits: as for :func:`~jax_cgx.adaptive.choose_bits`.
      candidates: as for :func:`~jax_cgx.adaptive.choose_bits`.
      config: as for :func:`~jax_cgx.adaptive.choose_bits` (``config``
        may be a config function: ``jax_cgx.optax.layer_filter(CompressionConfig(bits=4, bucket_size=128),
        1024)``, the recommended transformer setting, keeps its small leaves exact and plans the rest).
      exact: as for :func:`~jax_cgx.adaptive.choose_bits`.
      bucket_sizes: the bucket sizes a leaf may get, as for :func:`~jax_cgx.adaptive.choose_bits`;
        ``"auto"`` (the default): :data:`~jax_cgx.adaptive.AUTO_BUCKET_SIZES` and ``config``'s bucket size; None:
        ``config``'s alone (then only widths change).
      every: re-plan at steps ``0, every, 2 every, ...`` (``observe``'s ``step``).
      objective: as for :func:`~jax_cgx.adaptive.choose_bits`.
      min_gain: adopt a new plan only when its predicted error is at most ``1 - min_gain`` times
        the current plan's on the same gradient (0: whenever it differs).

    Raises:
      ValueError: ``every`` not a positive int; ``min_gain`` outside [0, 1); ``exact`` not a bool;
        ``budget_bits``, ``candidates``, ``bucket_sizes`` or ``objective`` refused as by
        :func:`~jax_cgx.adaptive.choose_bits`; a config function giving the leaves different configs.
      TypeError: ``config`` not a :class:`~jax_cgx.CompressionConfig`, a config function or None.

    The first plan, before any gradient, is uniform: the widest candidate within ``budget_bits``, in
    ``config``'s buckets. A plan is keyed by each leaf's ``(bits, bucket_size)``.

    Checkpointing: :meth:`state_dict` is the adopted plan and its statistics as a dict of NumPy
    arrays (what orbax saves beside the training state); :meth:`load_state_dict` puts them into a
    planner made with the same ``like`` and settings (docs/checkpointing.md).
    """

    def __init__(self, like, *, budget_bits: float = 4.0, candidates: Sequence[int] = CANDIDATES,
                 bucket_sizes: Sequence[int] | str | None = "auto", config: CompressionConfig | Callable | None = None,
                 exact: bool = True, every: int = 100, min_gain: float = 0.05, objective: str = "squared"):
        budget, cands = check_budget(budget_bits, candidates, "Planner")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Planner: every must be a positive number of steps, got {every!r}")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
            raise ValueError(f"Planner: min_gain must be in [0, 1), got {min_gain!r}")
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
        self.config = config  # what leaf_errors and the plans read: a config function keeps its exact leaves
        self.base, own = base_config(config, "Planner", with_paths)
        if isinstance(bucket_sizes, str) and bucket_sizes == "auto":
            # A plan gains most from buckets sized to each leaf's spread (an embedding's few wide rows
            # in small buckets, smooth leaves in large ones): offered by default, with config's own.
            bucket_sizes = sorted({*AUTO_BUCKET_SIZES, self.base.bucket_size})
        self.bucket_sizes = check_bucket_sizes(bucket_sizes, self.base, "Planner")
        self.budget_bits, self.candidates = budget, cands
        self.exact = check_bool("Planner", "exact", exact)
        self.every, self.min_gain = every, float(min_gain)
        self.objective = check_objective(objective, "Planner")
        planned = [lane(p, v, c, "Planner") == "quantized" for (p, v), c in zip(with_paths, own)]
        self._treedef = treedef
        self._like = [(jax.tree_util.keystr(p), tuple(jnp.shape(v)), jnp.result_type(v)) for p, v in with_paths]
        self._planned = [i for i, q in enumerate(planned) if q]
        self._sizes = [math.prod(self._like[i][1]) for i in self._planned]  # the planned leaves' values
        uniform = max(b for b in cands if b <= budget)
        self._configs = treedef.unflatten([c.replace(bits=uniform) if q else c for q, c in zip(planned, own)])
        self._choices = tuple((uniform, self.base.bucket_size) for q in planned if q)
        self._initial = self._choices
        self.plans: list[LeafPlan] | None = None  # the adopted plan's table (None: still uniform)
        self.changes = 0
        self._compiled: dict[tuple, Any] = {}
        self._warned = False

    @property
    def configs(self):
        """The current plan, a pytree of ``CompressionConfig`` (or ``None``: exact), a static config."""
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
        return leaf_errors(grads, self.config, self.candidates, axis_name, self.objective, self.bucket_sizes,
                           second_moment)

    def observe(self, step: int, grads, *, errors=None) -> bool:
        """At a planning step, plan (from ``errors``, :meth:`leaf_errors` averaged over the devices,
        or else from ``grads``, a gradient every process holds alike) and adopt the plan if it gains
        enough; returns whether the plan changed. ``grads`` gives the structure either way."""
        if step % self.every:
            return False
        self._check_like(grads)
        # The uniform plan a planner starts from has the config's bucket size, which explicit
        # bucket_sizes may leave out: it is then not priced, and the first plan is adopted.
        options = {(b, k) for k in self.bucket_sizes for b in self.candidates} | {(EXACT, None)}
        current = self._choices if set(self._choices) <= options else None
        configs, plans, before = _choose(grads, self.budget_bits, self.candidates, self.config, self.exact, "Planner",
                                         current=current, errors=errors, objective=self.objective,
                                         bucket_sizes=self.bucket_sizes)
        after = sum(p.error for p in plans)
        choices = tuple(p.choice for p in plans)
        if current is not None and (choices == self._choices or after > (1 - self.min_gain) * before):
            why = ("it is the best plan for this gradient" if choices == self._choices else
                   f"the best plan's predicted error, {after:.4g}, is not {self.min_gain:.0%} below it (min_gain)")
            log.info("jax_cgx: step %d: the bit widths stay: predicted error %.4g; %s", step, before, why)
            return False
        self._configs, self._choices, self.plans = configs, choices, plans
        self.changes += 1
        previous = (f"{before:.4g}" if current is not None else
                    f"not priced: its buckets of {self.base.bucket_size} are not among bucket_sizes")
        log.info("jax_cgx: step %d: new bit widths, predicted error %.4g (the previous plan's: %s)\n%s",
                 step, after, previous, describe(plans))
        return True

    def _check_like(self, grads) -> None:
        """A ``ValueError`` unless ``grads`` has ``like``'s structure, shapes and dtypes: a plan made
        for other shapes would send other bytes than the budget says."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
        if treedef != self._treedef:
            raise ValueError(f"Planner.observe: the gradient's structure {treedef} is not the structure of the "
                             f"pytree the planner was made for ({self._treedef}): make the Planner with the "
                             "parameters (or their jax.ShapeDtypeStructs) these gradients belong to")
        for (path, leaf), (name, shape, dtype) in zip(flat, self._like):
            got_shape, got_dtype = tuple(jnp.shape(leaf)), jnp.result_type(leaf)
            if (got_shape, got_dtype) != (shape, dtype):
                raise ValueError(
                    f"Planner.observe: gradient leaf {name} has shape {got_shape} and dtype {got_dtype}, but the "
                    f"planner was made for shape {shape} and dtype {dtype}: its byte budget and plan are for those. "
                    "Make the Planner with the parameters these gradients belong to")

    def observe_loss(self, step: int, grad_fn, params, *batch, **kwargs) -> bool:
        """:meth:`observe` fed by :func:`jax_cgx.data_parallel_value_and_grad` itself: at a planning
        step, the errors of each device's own gradient of ``grad_fn``'s loss at ``params`` on the
        batch (``grad_fn(params, *batch, **kwargs)``'s arguments; any plan's ``grad_fn`` of the same
        loss and options: its config plays no part, and the errors' program is compiled once);
        elsewhere nothing is computed. Returns whether the plan changed::

            params, opt_state, loss = planner.compiled(make_step)(params, opt_state, x, y)
            planner.observe_loss(step, grad_fn, params, x, y)
        """
        if step % self.every:
            return False
        if not callable(getattr(grad_fn, "leaf_errors", None)):
            raise TypeError("Planner.observe_loss: grad_fn must be a jax_cgx.data_parallel_value_and_grad function "
                            f"(it computes each device's gradient), got {type(grad_fn).__name__}")
        return self.observe(step, params, errors=grad_fn.leaf_errors(self.leaf_errors, params, *batch, **kwargs))

    def state_dict(self) -> dict[str, np.ndarray]:
        """The adopted plan and its statistics, as NumPy arrays (orbax, ``np.savez`` or any
        checkpointer saves them): per planned leaf ``bits`` (32: sent exact), ``bucket_size`` (0 when
        exact), ``size``, and, once a plan was adopted, its predicted ``error`` and ``bytes`` (NaN and
        -1 while the plan is still the uniform one); ``changes``, the plans adopted so far."""
        plans = self.plans
        return {
            "bits": np.array([b for b, _ in self._choices], np.int32),
            "bucket_size": np.array([bucket or 0 for _, bucket in self._choices], np.int32),
            "size": np.array(self._sizes, np.int64),
            "error": np.array([p.error for p in plans] if plans else [np.nan] * len(self._planned), np.float64),
            "bytes": np.array([p.bytes for p in plans] if plans else [-1] * len(self._planned), np.int64),
            "changes": np.array(self.changes, np.int64),
        }

    def load_state_dict(self, state: dict) -> None:
        """Adopt the plan of :meth:`state_dict` (from a planner made with the same ``like``, budget,
        candidates and bucket sizes). Raises a ``ValueError`` naming what differs; nothing is changed
        then. The compiled steps are not part of it: the first :meth:`compiled` after a restore
        compiles the restored plan's step."""
        try:
            bits = np.asarray(state["bits"]).astype(np.int64).reshape(-1)
            buckets = np.asarray(state["bucket_size"]).astype(np.int64).reshape(-1)
            sizes = np.asarray(state["size"]).astype(np.int64).reshape(-1)
            errors = np.asarray(state["error"], np.float64).reshape(-1)
            nbytes = np.asarray(state["bytes"]).astype(np.int64).reshape(-1)
            changes = int(np.asarray(state["changes"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"Planner.load_state_dict: not a Planner.state_dict() ({err!r}): it needs bits, "
                             "bucket_size, size, error, bytes and changes") from None
        want = self._sizes
        if sizes.tolist() != want or not len(bits) == len(buckets) == len(errors) == len(nbytes) == len(want):
            raise ValueError(f"Planner.load_state_dict: the saved plan is for {len(sizes)} planned leaves of sizes "
                             f"{sizes.tolist()[:8]}, this planner plans {len(want)} of sizes {want[:8]}: make it "
                             "with the parameters (like) and config of the run that saved it")
        choices = tuple((int(b), None if b == EXACT else int(k)) for b, k in zip(bits, buckets))
        allowed = ({(b, k) for k in self.bucket_sizes for b in self.candidates} | ({(EXACT, None)} if self.exact else set())
                   | set(self._initial))  # the uniform plan a planner starts from
        if not set(choices) <= allowed:
            raise ValueError(f"Planner.load_state_dict: the saved choices {sorted(set(choices) - allowed, key=str)} are "
                             f"not among this planner's (bits, bucket_size) options {sorted(allowed, key=str)}: make "
                             "it with the candidates, bucket sizes and exact= of the run that saved it")
        configs = [self.base] * len(self._like)
        for i, (b, k) in zip(self._planned, choices):
            configs[i] = None if b == EXACT else self.base.replace(bits=b, bucket_size=k)
        self._configs, self._choices = self._treedef.unflatten(configs), choices
        self.plans = None if np.isnan(errors).all() else [
            LeafPlan(self._like[i][0], int(n), b, float(e), int(nb), k)
            for i, n, (b, k), e, nb in zip(self._planned, sizes, choices, errors, nbytes)]
        self.changes = changes
        log.info("jax_cgx: Planner: restored a plan of %d leaves (%d changes so far)%s", len(choices), changes,
                 "" if self.plans is None else "\n" + describe(self.plans))
