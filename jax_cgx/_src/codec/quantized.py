"""The packed form of a quantized array, and the arithmetic of its size."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jax_cgx._src.config import QUANTIZED_BITS

__all__ = ["Quantized", "num_buckets", "payload_bytes", "quantized_elements", "META_BYTES"]

# Each bucket carries (min, scale) as two float32.
META_BYTES = 8


def quantized_elements(n: int, bucket_size: int, skip_incomplete_buckets: bool) -> int:
    """How many of ``n`` values are quantized (the rest travel uncompressed)."""
    return (n // bucket_size) * bucket_size if skip_incomplete_buckets else n


def _check_sizes(fn: str, m, bucket_size, bits=1) -> None:
    whole = (int, np.integer)
    if not (isinstance(m, whole) and m >= 0 and isinstance(bucket_size, whole) and bucket_size >= 1
            and isinstance(bits, whole) and bits in QUANTIZED_BITS):
        raise ValueError(f"{fn}: needs integers m >= 0, bucket_size >= 1 and bits in "
                         f"{QUANTIZED_BITS.start}..{QUANTIZED_BITS.stop - 1}, got m={m!r}, "
                         f"bucket_size={bucket_size!r}, bits={bits!r}")


def num_buckets(m: int, bucket_size: int) -> int:
    """Buckets for ``m`` values: ceil(m / bucket_size).

    Args:
      m: the number of values (>= 0).
      bucket_size: values per bucket (>= 1).

    Returns:
      The number of buckets, each with its own (min, scale) metadata (8 bytes).

    Raises:
      ValueError: ``m`` or ``bucket_size`` not a whole number, ``m`` negative, or a bucket size below 1.

    Examples:
      >>> jax_cgx.num_buckets(1000, 512)
      2
    """
    _check_sizes("num_buckets", m, bucket_size)
    return -(-m // bucket_size)


def payload_bytes(m: int, bucket_size: int, bits: int) -> int:
    """Packed bytes for ``m`` values: ceil(n*bits/8) per bucket of n values.

    Args:
      m: the number of values (>= 0).
      bucket_size: values per bucket (>= 1).
      bits: bits per value, 1..8.

    Returns:
      The payload's bytes (each bucket starts on a byte), without the buckets' metadata.

    Raises:
      ValueError: a size that is not a whole number, ``m`` negative, a bucket size below 1, or bits
        outside 1..8.

    Examples:
      >>> jax_cgx.payload_bytes(1000, 512, 4)
      500
    """
    _check_sizes("payload_bytes", m, bucket_size, bits)
    full, rest = divmod(m, bucket_size)
    return full * (-(-bucket_size * bits // 8)) + (-(-rest * bits // 8))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """An array compressed by :func:`jax_cgx.quantize`.

    The array fields are pytree children (a leading batch axis appears under ``vmap`` or
    when several are stacked); ``shape``, ``dtype``, ``bits`` and ``bucket_size`` are static.
    The byte layout is specified in docs/format.md.

    Attributes:
      payload: ``uint8[P]``, the densely packed levels, bucket after bucket.
      meta: ``float32[num_buckets, 2]``, each bucket's ``(min, scale)``.
      tail: the values left uncompressed (``skip_incomplete_buckets``), in the
        original dtype; empty otherwise.
      shape: the original array's shape.
      dtype: the original array's dtype.
      bits: bits per value, 1..8.
      bucket_size: values per bucket.
    """

    payload: jax.Array
    meta: jax.Array
    tail: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))
    bucket_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        """Number of values in the original array."""
        return math.prod(self.shape)

    @property
    def num_quantized(self) -> int:
        """Number of values covered by buckets (the rest are in ``tail``)."""
        return self.size - self.tail.shape[-1]

    @property
    def nbytes(self) -> int:
        """The bytes of one encoded array (payload, metadata and tail; per batch element)."""
        tail_bytes = self.tail.shape[-1] * np.dtype(self.dtype).itemsize
        return self.payload.shape[-1] + self.meta.shape[-2] * META_BYTES + tail_bytes

    @property
    def compression_ratio(self) -> float:
        """Original bytes divided by encoded bytes."""
        original = self.size * np.dtype(self.dtype).itemsize
        return original / self.nbytes if self.nbytes else 1.0
