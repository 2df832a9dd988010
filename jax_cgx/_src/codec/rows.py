"""The codec at the FFI targets' own shapes: rows ``x[R, n]``, ``payload[R, P]``, ``meta[R, nb, 2]``.

For callers that already hold rows (the public functions of :mod:`jax_cgx._src.codec` and the
all-reduce). Each function runs the compiled kernels (``impl="kernel"``), the pure-JAX
reference (``impl="reference"``) or the kernel where one exists for the platform
(``impl="auto"``); all give the same bytes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_cgx._src.codec import kernels, reference
from jax_cgx._src.codec.kernels import Impl

__all__ = ["quantize_rows", "dequantize_rows", "dequantize_sum_rows", "dequantize_sum_requantize_rows"]


# ------------------------------------------------------------ row level
#
# The FFI targets' own shapes (xla_ffi/README.md), for callers that already hold
# rows: the array-level API (jax_cgx/_src/codec/arrays.py) and the all-reduce's programs.


def _valid_operand(valid):
    """The kernels' ``valid`` operand: int32 ``[R]`` counts, or ``[0]`` for none."""
    return jnp.zeros((0,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32)


def quantize_rows(x, seeds, *, bits, bucket_size, stochastic, m, impl: Impl, valid=None):
    """``x[R, n]``, ``seeds[R, 2]`` -> ``payload[R, P]``, ``meta[R, nb, 2]`` (first ``m`` values).

    ``valid[R]`` (None: all ``m``): only the first ``valid[r]`` values of row ``r`` set its
    buckets' ranges; the rest (padding) are encoded inside them (docs/format.md, "Padding").
    """
    params = dict(bits=bits, bucket_size=bucket_size, stochastic=stochastic, m=m)
    if impl == "reference":
        return reference.quantize(x, seeds, valid, **params)
    if m < jnp.shape(x)[-1] and m % bucket_size:
        x = x[:, :m]  # the kernels end a row's last bucket at the row's end, not at m
    return tuple(kernels.quantize_p.bind(x, seeds, _valid_operand(valid), **params, strict=impl == "kernel"))


def dequantize_rows(payload, meta, *, bits, bucket_size, m, dtype, impl: Impl, scale: float = 1.0):
    """``payload[R, P]``, ``meta[R, nb, 2]`` -> ``out[R, m]`` in ``dtype``.

    ``scale`` (a float32 value): each decoded value times it, flushed, before its one rounding
    to ``dtype`` (:func:`~jax_cgx._src.codec.reference.scale_output`; ``1/W`` for a mean).
    """
    params = dict(bits=bits, bucket_size=bucket_size, m=m, dtype=np.dtype(dtype), scale=float(np.float32(scale)))
    if impl == "reference":
        return reference.dequantize(payload, meta, **params)
    (out,) = kernels.dequantize_p.bind(payload, meta, **params, strict=impl == "kernel")
    return out


def dequantize_sum_rows(payload, meta, addend, *, bits, bucket_size, m, dtype, impl: Impl):
    """``payload[R, W, P]``, ``meta[R, W, nb, 2]``, ``addend[R, m]`` (or ``[R, 0]``) -> ``out[R, m]``."""
    params = dict(bits=bits, bucket_size=bucket_size, m=m, dtype=np.dtype(dtype))
    if impl == "reference":
        return reference.dequantize_sum(payload, meta, kernels._addend_or_none(addend), **params)
    (out,) = kernels.dequantize_sum_p.bind(payload, meta, addend, **params, strict=impl == "kernel")
    return out


def dequantize_sum_requantize_rows(
    payload, meta, addend, seeds, *, bits, bucket_size, stochastic, m, dtype, impl: Impl, valid=None
):
    """As :func:`dequantize_sum_rows`, plus ``seeds[R, 2]``: -> ``payload[R, P]``, ``meta``, ``out[R, m]``.

    ``valid``: as for :func:`quantize_rows`, for the re-quantized sum.
    """
    params = dict(bits=bits, bucket_size=bucket_size, stochastic=stochastic, m=m, dtype=np.dtype(dtype))
    if impl == "reference":
        return reference.dequantize_sum_requantize(
            payload, meta, kernels._addend_or_none(addend), seeds, valid, **params
        )
    return tuple(
        kernels.dequantize_sum_requantize_p.bind(
            payload, meta, addend, seeds, _valid_operand(valid), **params, strict=impl == "kernel"
        )
    )
