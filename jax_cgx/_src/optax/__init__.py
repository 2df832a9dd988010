"""The gradient transformations' internals; their public face is :mod:`jax_cgx.optax`."""
