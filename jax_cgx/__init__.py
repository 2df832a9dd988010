"""jax_cgx: compressed cross-device reductions for JAX.

Bucketed max-min quantization (1-8 bits) as XLA FFI kernels on CPU and CUDA, with a
bit-identical pure-JAX reference, and a compressed all-reduce over XLA collectives or
jax_cgx's own NCCL communicators (:mod:`jax_cgx.nccl`). See README.md and docs/.
"""

from jax_cgx import allocator

# Before anything computes, so that XLA's threads are born on the main arena (jax_cgx/allocator.py).
allocator.apply_default()

from jax_cgx import distributed, nccl  # noqa: E402
from jax_cgx.codec import (  # noqa: E402
    Quantized,
    cuda_extension_available,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    num_buckets,
    payload_bytes,
    quantize,
)
from jax_cgx.collectives import (  # noqa: E402
    calibrate,
    compressed_pmean,
    compressed_psum,
    explain,
    reduce_in_backward,
)
from jax_cgx.config import CompressionConfig  # noqa: E402
from jax_cgx.nccl import lowering as _nccl_lowering  # noqa: E402, F401  (registers the CUDA lowering rule)
from jax_cgx.tcp import lowering as _tcp_lowering  # noqa: E402, F401  (registers the CPU lowering rule)

__version__ = "0.1.0"

__all__ = [
    "CompressionConfig",
    "compressed_psum",
    "compressed_pmean",
    "reduce_in_backward",
    "explain",
    "calibrate",
    "Quantized",
    "quantize",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_requantize",
    "num_buckets",
    "payload_bytes",
    "cuda_extension_available",
    "allocator",
    "distributed",
    "nccl",
]
