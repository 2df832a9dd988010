"""The shard_map recipe for a plain ``jax.jit`` step: :func:`data_parallel_value_and_grad`
(``step``: the recipe, its buckets, aux modes, weighted losses, device keys) and the checks it runs
on what a step is given, each naming the argument and the fix (``checks``)."""

from jax_cgx._src.data_parallel.step import AUX_MODES, DEFAULT_BUCKET_MB, buckets, data_parallel_value_and_grad

__all__ = ["AUX_MODES", "DEFAULT_BUCKET_MB", "buckets", "data_parallel_value_and_grad"]
