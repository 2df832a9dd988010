"""Quantized.compression_ratio and nbytes, from first principles (docs/format.md, "Byte layout"):
the input's bytes over the encoding's, where the encoding is the payload (each bucket of ``c``
values costs ``ceil(c * bits / 8)`` bytes), 8 bytes of metadata per quantized bucket, and the
unquantized tail of ``skip_incomplete_buckets`` in the input dtype."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cgx
from jax_cgx import CompressionConfig

ITEMSIZE = {jnp.float32: 4, jnp.bfloat16: 2, jnp.float16: 2}


def expected_bytes(n: int, bits: int, bucket: int, skip: bool, itemsize: int) -> int:
    m = n - n % bucket if skip else n  # quantized values; the rest travel as they are
    buckets = math.ceil(m / bucket)
    payload = sum(math.ceil(min(bucket, m - k * bucket) * bits / 8) for k in range(buckets))
    return payload + 8 * buckets + (n - m) * itemsize


CASES = list(itertools.product(
    [1, 7, 64, 1000, 4099],  # n
    [1, 3, 4, 8],  # bits
    [3, 64, 512],  # bucket
    [False, True],  # skip_incomplete_buckets
))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["float32", "bfloat16", "float16"])
def test_compression_ratio_from_first_principles(dtype):
    itemsize = ITEMSIZE[dtype]
    for n, bits, bucket, skip in CASES:
        config = CompressionConfig(bits=bits, bucket_size=bucket, skip_incomplete_buckets=skip, min_size=16)
        # The sizes are static: the shapes quantize gives, without running it.
        q = jax.eval_shape(lambda x: jax_cgx.quantize(x, config), jax.ShapeDtypeStruct((n,), dtype))  # noqa: B023
        want = expected_bytes(n, bits, bucket, skip, itemsize)
        what = f"n={n} bits={bits} B={bucket} skip={skip} {np.dtype(dtype).name}"
        assert q.nbytes == want, what
        assert q.compression_ratio == pytest.approx(n * itemsize / want, rel=1e-12), what
    # And the arrays an actual encoding holds are that many bytes.
    for n, bits, bucket, skip in [(1000, 3, 64, True), (4099, 8, 512, False), (7, 1, 3, True)]:
        q = jax_cgx.quantize(jnp.linspace(-1.0, 1.0, n, dtype=dtype),
                             CompressionConfig(bits=bits, bucket_size=bucket, skip_incomplete_buckets=skip, min_size=16))
        held = sum(np.asarray(a).nbytes for a in (q.payload, q.meta, q.tail))
        assert held == q.nbytes == expected_bytes(n, bits, bucket, skip, itemsize)


def test_documented_ratios():
    """docs/format.md: 4 bits, B = 512, float32: 0.5156 bytes per value, 7.76x; docs/algorithm.md's
    table (4 / (bits/8 + 8/B)) for whole buckets."""
    q = jax_cgx.quantize(jnp.ones(512 * 64), CompressionConfig(bits=4, bucket_size=512, min_size=16))
    assert q.nbytes / (512 * 64) == pytest.approx(0.5156, abs=1e-4)
    assert q.compression_ratio == pytest.approx(7.76, abs=0.005)
    for bits, bucket, table in [(1, 128, 21.3), (2, 512, 15.1), (8, 2048, 4.0), (5, 128, 5.8)]:
        q = jax_cgx.quantize(jnp.ones(bucket * 8), CompressionConfig(bits=bits, bucket_size=bucket, min_size=16))
        assert q.compression_ratio == pytest.approx(4 / (bits / 8 + 8 / bucket), rel=1e-12)
        assert round(q.compression_ratio, 1) == table


def test_empty_input_ratio_is_one():
    q = jax_cgx.quantize(jnp.zeros(0), CompressionConfig(bits=4, bucket_size=64, min_size=16))
    assert q.nbytes == 0 and q.compression_ratio == 1.0
