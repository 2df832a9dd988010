"""Moved to :mod:`jax_cgx.codec.quantized`; this path keeps working."""

from jax_cgx.codec.quantized import *  # noqa: F401,F403
from jax_cgx.codec.quantized import __all__  # noqa: F401
