"""``policy="auto"``: whether each fusion buffer is worth compressing on this machine.

- :mod:`~jax_cgx._src.policy.calibration`: the figures, measured once and agreed across processes
  (``calibrate``, ``figures``, ``levels`` over nodes);
- :mod:`~jax_cgx._src.policy.pricing`: each buffer's decision (``decide``): the model, and near a
  tie a timing of the buffer itself;
- :mod:`~jax_cgx._src.policy.figures`: the records it keeps and returns,
  :class:`~jax_cgx._src.policy.figures.Figures` and :class:`~jax_cgx._src.policy.figures.Decision`;
- :mod:`~jax_cgx._src.policy.forms`: over nodes, which form (flat or hierarchical, SRA or ring)
  runs a group's buffers;
- :mod:`~jax_cgx._src.policy.cost_model`: the predicted seconds of a psum and of the
  compressed exchange;
- :mod:`~jax_cgx._src.policy.probes`: timing this machine (codec rates, the link, one buffer's
  two collectives side by side).

The collectives call it through :func:`~jax_cgx._src.policy.pricing.decide` while they trace;
it is the one path that runs collectives while tracing (its probes, collectively on every
process), kept here, apart. It sits below the collectives and above the all-reduce's exchange
(:mod:`jax_cgx._src.exchange`), which its probes time.
"""
