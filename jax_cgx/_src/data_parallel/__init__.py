"""The shard_map recipe for a plain ``jax.jit`` step: :func:`data_parallel_value_and_grad`
(``step``: the recipe, aux modes, weighted losses, device keys), how its gradients are averaged
(``averaging``: in backward bucket by bucket, or after as one mean) and the checks it runs on what a
step is given, each naming the argument and the fix (``checks``)."""

from jax_cgx._src.data_parallel.averaging import buckets
from jax_cgx._src.data_parallel.step import AUX_MODES, DEFAULT_BUCKET_MB, data_parallel_value_and_grad

__all__ = ["AUX_MODES", "DEFAULT_BUCKET_MB", "buckets", "data_parallel_value_and_grad"]
