"""Adaptive per-leaf bit widths: :func:`choose_bits` gives each leaf of a gradient the width that
minimizes the expected quantization error of the whole tree within a uniform width's bytes
(CGX's adaptive compression; the model: ``jax_cgx/_src/adaptive/choose.py``, the solver: ``solver.py``);
:class:`Planner` re-plans during training with bounded recompilation (``.../replanning.py``)."""

from jax_cgx._src.adaptive.choose import (
    CANDIDATES,
    EXACT,
    OBJECTIVES,
    LeafPlan,
    choose_bits,
    describe,
    expected_errors,
    leaf_bytes,
    leaf_errors,
)
from jax_cgx._src.adaptive.replanning import AUTO_BUCKET_SIZES, Planner
from jax_cgx._src.adaptive.solver import solve

__all__ = ["AUTO_BUCKET_SIZES", "CANDIDATES", "EXACT", "OBJECTIVES", "LeafPlan", "Planner", "choose_bits", "describe", "expected_errors",
           "leaf_bytes", "leaf_errors", "solve"]
