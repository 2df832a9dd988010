"""jax_cgx's internals: nothing here is public API (import from ``jax_cgx`` and its
public subpackages ``optax``, ``nccl``, ``tcp``; docs/architecture.md maps this package)."""
