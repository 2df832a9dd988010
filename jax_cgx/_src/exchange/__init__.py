"""One buffer's compressed all-reduce: the primitive, its algorithms, and how they cut the wire.

- :mod:`~jax_cgx._src.exchange.all_reduce`: ``compressed_allreduce_p`` (and its error-feedback
  twin) and its JAX rules, and :func:`~jax_cgx._src.exchange.all_reduce.compressed_sum`, which binds
  it with the backend chosen for it;
- :mod:`~jax_cgx._src.exchange.algorithms`: the xla backend's program, the algorithm named by the
  config (:func:`~jax_cgx._src.exchange.algorithms.xla_rows`);
- :mod:`~jax_cgx._src.exchange.sra`, :mod:`~jax_cgx._src.exchange.ring`,
  :mod:`~jax_cgx._src.exchange.hierarchical`: one module per algorithm;
- :mod:`~jax_cgx._src.exchange.chunks`: how SRA and the ring cut a buffer, and their shared last step;
- :mod:`~jax_cgx._src.exchange.wire`: encodings as byte rows and the XLA collectives that move them,
  their messages sized to the platform and the link.

Below the collectives' pytree API (:mod:`jax_cgx._src.collectives`) and ``policy="auto"``
(:mod:`jax_cgx._src.policy`, whose probes time it); above the backends and the codec.
"""
