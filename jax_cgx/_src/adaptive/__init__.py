"""Adaptive bit widths' internals: ``choose`` (per-leaf widths within a byte budget), ``solver`` (its exact solver) and ``replanning``
(the plan re-chosen during training, one compiled step per plan); their public face is
:mod:`jax_cgx.adaptive`."""
