"""Adaptive bit widths: ``choose`` (per-leaf widths within a byte budget) and ``replanning``
(the plan re-chosen during training, one compiled step per plan)."""

from jax_cgx._src.adaptive.choose import (
    EXACT,
    LeafPlan,
    choose_bits,
    describe,
    expected_errors,
    leaf_bytes,
    leaf_errors,
    solve,
)
from jax_cgx._src.adaptive.replanning import Planner

__all__ = ["EXACT", "LeafPlan", "Planner", "choose_bits", "describe", "expected_errors", "leaf_bytes",
           "leaf_errors", "solve"]
