"""Benchmarks: ``python -m jax_cgx.bench codec`` (more subcommands follow)."""
