"""optax gradient transformations that average gradients over a mapped axis, compressed.

Use them inside ``jax.shard_map`` or ``jax.pmap`` (where ``axis_name`` is bound), in place
of ``jax.lax.pmean(grads, axis_name)``, typically first in an ``optax.chain``::

    tx = optax.chain(jax_cgx.optax.compressed_mean("data", CompressionConfig(bits=4)), optax.adam(1e-3))

=====================  ============================================================
``compressed_mean``    max-min quantization (compressed_pmean), torch_cgx's layer filter,
                       optional error feedback
``cast_mean``          a mean in bfloat16/float16 (PyTorch's fp16/bf16 compress hooks)
``powersgd_mean``      PowerSGD (PyTorch's powerSGD_hook semantics)
``topk_mean``          Deep Gradient Compression's top-k sparsification
``sharded``            an optimizer with its state sharded over the devices (ZeRO-1/2): the
                       gradients reduce-scattered, the parameters all-gathered, both
                       optionally compressed (not a GradientTransformation: it returns
                       the parameters)
``state_specs``        the ``shard_map`` specs of any optax state holding the above's
                       (``chain``, ``named_chain``, ``inject_hyperparams``, ``MultiSteps``):
                       per-device leaves ``P(axis)``, the rest ``P()``
                       (``compressed_mean_state_specs``, ``topk_state_specs``: the same
                       function under its earlier names); with ``param_specs``, parameters
                       sharded over model axes (tensor parallelism, FSDP)
``shard_shapes``       one device's shard of each such parameter, for ``jax.eval_shape``
``resize_state``       any of those states, saved on W devices, laid out for W' (a restart on
                       another device count: docs/checkpointing.md)
``skip_not_finite``    ``optax.MultiSteps``' ``should_skip_update_fn`` for a step in
                       ``shard_map``: every device skips a mini-step where any device's
                       gradient is not finite (optax's own judges each device alone)
=====================  ============================================================

Every factory returns an ``optax.GradientTransformation`` with a NamedTuple state whose
shapes and dtypes never change across steps (so it works under ``jit``, ``optax.MultiSteps``
and ``optax.apply_if_finite``). Needs optax (``pip install optax``).

None of them fails silently: a step whose mean is non-finite (an inf or NaN on any rank)
gives a non-finite update for that step only and leaves the state bitwise unchanged on every
rank (``compressed_mean`` without error feedback and stochastic rounding, whose later updates do
not depend on its state, skips that check and counts the step); a state that does not match the updates (structure or shapes) raises a ``ValueError``
naming the leaf path and both shapes; a non-integer, bool or out-of-range count argument
raises a ``ValueError`` when the transformation is built (the checks live in ``jax_cgx._src.optax.checks``).
Complex leaves are averaged exactly.
"""

try:
    import optax as _optax  # noqa: F401
except ImportError as err:  # pragma: no cover - optional dependency
    raise ImportError("jax_cgx.optax needs optax: pip install optax (or jax_cgx[optax])") from err

from jax_cgx._src.optax.finite import skip_not_finite
from jax_cgx._src.optax.mean import (
    CastMeanState,
    CompressedMeanState,
    cast_mean,
    compressed_mean,
    layer_filter,
)
from jax_cgx._src.optax.powersgd import PowerSGDState, powersgd_bytes, powersgd_mean
from jax_cgx._src.optax.resize import resize_state
from jax_cgx._src.optax.specs import compressed_mean_state_specs, shard_shapes, state_specs, topk_state_specs
from jax_cgx._src.optax.topk import TopKState, topk_bytes, topk_mean
from jax_cgx._src.optax.zero import ShardedOptimizer, ShardedState, sharded

__all__ = [
    "compressed_mean",
    "CompressedMeanState",
    "compressed_mean_state_specs",
    "layer_filter",
    "cast_mean",
    "CastMeanState",
    "powersgd_mean",
    "PowerSGDState",
    "powersgd_bytes",
    "topk_mean",
    "TopKState",
    "topk_bytes",
    "topk_state_specs",
    "state_specs",
    "shard_shapes",
    "resize_state",
    "skip_not_finite",
    "sharded",
    "ShardedOptimizer",
    "ShardedState",
]
