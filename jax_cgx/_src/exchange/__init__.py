"""One buffer's compressed collective: one module per op, each a primitive, its program and its binding.

- :mod:`~jax_cgx._src.exchange.all_reduce`: ``compressed_allreduce_p`` (and its error-feedback
  twin), the algorithm its ``algorithm`` parameter names, and
  :func:`~jax_cgx._src.exchange.all_reduce.compressed_sum`, which binds it;
- :mod:`~jax_cgx._src.exchange.reduce_scatter`: ``compressed_reduce_scatter_p`` (and its twin),
  its program and :func:`~jax_cgx._src.exchange.reduce_scatter.compressed_scatter`;
- :mod:`~jax_cgx._src.exchange.all_gather`: ``compressed_all_gather_p``, its program and
  :func:`~jax_cgx._src.exchange.all_gather.compressed_gather`;
- :mod:`~jax_cgx._src.exchange.primitives`: the rules the three share (lowering by the chosen
  backend, vmap as rows, the impl), registered by one call;
- :mod:`~jax_cgx._src.exchange.sra`, :mod:`~jax_cgx._src.exchange.ring`,
  :mod:`~jax_cgx._src.exchange.hierarchical`: the all-reduce's algorithms, one module each;
- :mod:`~jax_cgx._src.exchange.chunks`: how a buffer is cut into chunks, and the shared
  all-gather-and-decode;
- :mod:`~jax_cgx._src.exchange.wire`: encodings as byte rows and the XLA collectives that move them,
  their messages sized to the platform and the link.

Each op's module reads top to bottom: the per-device program on rows (XLA collectives around the
codec's kernels), the primitive and its rules (differentiation as lax's collective; vmap folds into
rows; lowering through the backend chosen while tracing, :mod:`jax_cgx._src.backends`, whose xla
backend runs the program and any other computes the same bits), and the function that binds it.

Below the collectives' pytree API (:mod:`jax_cgx._src.collectives`) and ``policy="auto"``
(:mod:`jax_cgx._src.policy`, whose probes time it); above the backends and the codec.
"""
