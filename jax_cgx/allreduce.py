"""Moved to :mod:`jax_cgx.collectives`; this path keeps working."""

from jax_cgx.collectives.allreduce import ConfigSpec, bytes_on_wire, compressed_pmean, compressed_psum

__all__ = ["compressed_psum", "compressed_pmean", "bytes_on_wire", "ConfigSpec"]
