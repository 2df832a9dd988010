"""jax_cgx: compressed cross-device reductions for JAX.

Bucketed max-min quantization (1-8 bits) as XLA FFI kernels on CPU and CUDA, with a
bit-identical pure-JAX reference, and a compressed all-reduce over XLA collectives or
jax_cgx's own communicators (:mod:`jax_cgx.nccl` on GPUs, :mod:`jax_cgx.tcp` on CPUs).
:mod:`jax_cgx.optax` (gradient transformations) is imported on first use, as optax's own
subpackages are reachable from ``optax``. See README.md and docs/.
"""

import importlib as _importlib

from jax_cgx import allocator

# Before anything computes, so that XLA's threads are born on the main arena (jax_cgx/allocator.py).
allocator.apply_default()

# nccl and tcp: each registers its backend (jax_cgx._src.backends) when imported.
from jax_cgx import distributed, nccl, tcp  # noqa: E402
from jax_cgx._src.backends.protocol import BackendError  # noqa: E402
from jax_cgx._src.codec import (  # noqa: E402
    Quantized,
    cuda_extension_available,
    dequantize,
    dequantize_sum,
    dequantize_sum_requantize,
    num_buckets,
    payload_bytes,
    quantize,
)
from jax_cgx._src.collectives import (  # noqa: E402
    bytes_on_wire,
    calibrate,
    compressed_all_gather,
    compressed_pmean,
    compressed_psum,
    compressed_psum_scatter,
    explain,
    reduce_in_backward,
)
from jax_cgx._src.collectives.explain import Explanation  # noqa: E402
from jax_cgx._src.config import CompressionConfig  # noqa: E402
from jax_cgx._src.data_parallel import data_parallel_value_and_grad  # noqa: E402
from jax_cgx._src.errors import PeerError  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CompressionConfig",
    "compressed_psum",
    "compressed_pmean",
    "compressed_psum_scatter",
    "compressed_all_gather",
    "bytes_on_wire",
    "reduce_in_backward",
    "data_parallel_value_and_grad",
    "explain",
    "Explanation",
    "calibrate",
    "BackendError",
    "PeerError",
    "Quantized",
    "quantize",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_requantize",
    "num_buckets",
    "payload_bytes",
    "cuda_extension_available",
    "adaptive",
    "allocator",
    "cost_model",
    "distributed",
    "nccl",
    "optax",
    "tcp",
]

# Imported on first use: importing optax costs time that users of the collectives alone need not pay.
_LAZY_SUBMODULES = ("adaptive", "cost_model", "optax")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"jax_cgx.{name}")  # binds jax_cgx.<name>: no second call
    raise AttributeError(f"module 'jax_cgx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)  # the public API only (the extensions and _src are internal)
