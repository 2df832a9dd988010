"""What the adaptive functions accept, checked once for all of them
(:mod:`jax_cgx._src.adaptive.choose` and :mod:`jax_cgx._src.adaptive.replanning`): widths, candidates, bucket sizes, a budget, an objective, and the config a
plan sets widths on. Each error names the function and the argument."""

from __future__ import annotations

import math

import numpy as np

from jax_cgx._src.config import MAX_BUCKET_SIZE, QUANTIZED_BITS, CompressionConfig

__all__ = ["OBJECTIVES", "is_width", "check_candidates", "check_bucket_sizes", "check_budget", "base_config",
           "check_objective"]

OBJECTIVES = ("squared", "relative", "adam")


def is_width(b) -> bool:
    """A quantized width: an integer in 1..8 (not a bool)."""
    return not isinstance(b, bool) and isinstance(b, (int, np.integer)) and b in QUANTIZED_BITS


def check_candidates(candidates, api: str) -> tuple[int, ...]:
    cands = tuple(candidates)
    if not cands or not all(is_width(b) for b in cands):
        raise ValueError(f"{api}: candidates must be widths in 1..8, got {candidates!r}")
    return tuple(sorted({int(b) for b in cands}))


def check_bucket_sizes(bucket_sizes, base: CompressionConfig, api: str) -> tuple[int, ...]:
    """``bucket_sizes`` checked and sorted; None: ``base``'s bucket size alone."""
    if bucket_sizes is None:
        return (base.bucket_size,)
    sizes = tuple(bucket_sizes) if not isinstance(bucket_sizes, (str, bytes)) else ()
    if not sizes or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= MAX_BUCKET_SIZE
                        for b in sizes):
        raise ValueError(f"{api}: bucket_sizes must be bucket sizes in 1..{MAX_BUCKET_SIZE}, got {bucket_sizes!r}")
    return tuple(sorted({int(b) for b in sizes}))


def check_budget(budget_bits, candidates, api: str = "choose_bits") -> tuple[float, tuple[int, ...]]:
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not math.isfinite(budget_bits):
        raise ValueError(f"{api}: budget_bits must be a number of bits, got {budget_bits!r}")
    cands = check_candidates(candidates, api)
    if budget_bits < cands[0]:
        raise ValueError(f"{api}: budget_bits={budget_bits} is below the narrowest candidate ({cands[0]} bits): "
                         "no plan fits; raise budget_bits or add a narrower candidate")
    return float(budget_bits), cands


def base_config(config, api: str, with_paths=()) -> tuple[CompressionConfig, list]:
    """Every setting but the widths, and each leaf's own config (None: exact, outside the plan):
    ``config``, or ``CompressionConfig()`` for None, for every leaf; for a config function
    (``jax_cgx.optax.layer_filter(...)``), what it gives each of ``with_paths``' leaves, whose
    CompressionConfigs must agree (the plan sets widths on one config)."""
    if callable(config) and not isinstance(config, CompressionConfig):
        own = [config(path, leaf) for path, leaf in with_paths]
        given = {c for c in own if c is not None}
        if not all(c is None or isinstance(c, CompressionConfig) for c in own):
            bad = next(c for c in own if c is not None and not isinstance(c, CompressionConfig))
            raise TypeError(f"{api}: the config function must return a CompressionConfig or None, got "
                            f"{type(bad).__name__}")
        if len(given) > 1:
            raise ValueError(f"{api}: the config function gives the leaves {len(given)} different configs; a plan "
                             "sets the widths of one: give the leaves it compresses one CompressionConfig (None "
                             "for those sent exact), e.g. jax_cgx.optax.layer_filter(config, 1024)")
        return (given.pop() if given else CompressionConfig()), own
    base = CompressionConfig() if config is None else config
    if not isinstance(base, CompressionConfig):
        raise TypeError(f"{api}: config must be a CompressionConfig, a config function "
                        f"(jax_cgx.optax.layer_filter(...)) or None, got {type(base).__name__}")
    return base, [base] * len(with_paths)


def check_objective(objective, api: str) -> str:
    """``objective``, checked against :data:`OBJECTIVES`."""
    if not isinstance(objective, str) or objective not in OBJECTIVES:
        raise ValueError(f"{api}: objective must be one of {OBJECTIVES}, got {objective!r}")
    return objective
