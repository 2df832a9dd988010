"""The codec: bucketed max-min quantization to 1-8 bits (docs/format.md).

- :mod:`~jax_cgx._src.codec.arrays`: :func:`quantize`, :func:`dequantize`, :func:`dequantize_sum`,
  :func:`dequantize_sum_requantize` on whole arrays, returning or taking a :class:`Quantized`;
- :mod:`~jax_cgx._src.codec.rows`: the same at the kernels' row shapes, for the collectives;
- :mod:`~jax_cgx._src.codec.quantized`: the :class:`Quantized` pytree and the byte layout;
- :mod:`~jax_cgx._src.codec.kernels`: the compiled extension and one JAX primitive per FFI target;
- :mod:`~jax_cgx._src.codec.reference`: the pure-JAX transcription of xla_ffi/codec_math.h, which
  gives the same bytes (the test oracle, and the fallback where no kernel exists).
"""

from jax_cgx._src.codec.arrays import (
    SUPPORTED_DTYPES,
    check_float_dtype,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    quantize,
    rounding_seeds,
)
from jax_cgx._src.codec.kernels import Impl, batch_rows, check_impl, cuda_extension_available
from jax_cgx._src.codec.quantized import Quantized, num_buckets, payload_bytes
from jax_cgx._src.codec.rows import dequantize_rows, dequantize_sum_requantize_rows, dequantize_sum_rows, quantize_rows

__all__ = [
    "quantize", "dequantize", "dequantize_sum", "dequantize_sum_requantize", "Quantized", "Impl",
    "num_buckets", "payload_bytes", "quantize_rows", "dequantize_rows", "dequantize_sum_rows",
    "dequantize_sum_requantize_rows", "check_impl", "check_float_dtype", "rounding_seeds",
    "SUPPORTED_DTYPES", "batch_rows", "cuda_extension_available",
]
