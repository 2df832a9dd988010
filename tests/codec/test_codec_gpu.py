"""CUDA kernels: bitwise parity with the CPU kernel (and so the reference), same properties.

Marked `gpu`: skipped where jax sees no GPU. tools/gpu_check.sh runs them on a GPU machine.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from codec_cases import BITS, BUCKETS, DTYPES, error_bound, roundtrip, sample, sum_plain, sum_requantize

import jax_cgx
from jax_cgx import CompressionConfig

pytestmark = pytest.mark.gpu
KEY = jax.random.key(99)


def _on(device, tree):
    return jax.device_put(tree, device)


def _assert_same_roundtrip(a, b, what: str) -> None:
    """Two ``(quantized, decoded)`` results (``roundtrip``, ``sum_requantize``), bit for bit."""
    (q_a, y_a), (q_b, y_b) = a, b
    assert_same_bits(q_a.payload, q_b.payload, "payload " + what)
    assert_same_bits(q_a.meta, q_b.meta, "meta " + what)
    assert_same_bits(y_a, y_b, "decoded " + what)


@pytest.fixture(scope="module")
def devices():
    assert jax_cgx.cuda_extension_available(), "jax_cgx was built without its CUDA extension"
    return jax.devices("gpu")[0], jax.devices("cpu")[0]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_cuda_matches_cpu_every_width(devices, bucket_size, dtype, stochastic):
    gpu, cpu = devices
    for n in (0, 1, 97, 2 * bucket_size + 7, 100_003):
        x = sample(n, dtype, seed=n + bucket_size)
        for bits in BITS:
            config = CompressionConfig(bits=bits, bucket_size=bucket_size, stochastic=stochastic, min_size=16)
            q_g, y_g = roundtrip(_on(gpu, x), _on(gpu, KEY), config, "kernel")
            what = f"n={n} bits={bits} B={bucket_size} {np.dtype(dtype).name}"
            _assert_same_roundtrip((q_g, y_g), roundtrip(_on(cpu, x), _on(cpu, KEY), config, "kernel"), what)
            err, bound = error_bound(x, np.asarray(y_g), n, bucket_size, bits, stochastic)
            assert np.all(err <= bound), what


def test_cuda_special_values(devices):
    gpu, cpu = devices
    x = sample(4096, jnp.float32)
    x[70], x[200], x[330], x[460] = np.nan, np.inf, -np.inf, 2.0**126
    x[512:576] = 2.0**-130  # subnormal
    x[600:664] = -0.0
    x[700:764] = 5.0  # degenerate
    for bits in BITS:
        for stochastic in (False, True):
            config = CompressionConfig(bits=bits, bucket_size=64, stochastic=stochastic, min_size=16)
            _assert_same_roundtrip(roundtrip(_on(gpu, x), _on(gpu, KEY), config, "kernel"),
                                   roundtrip(_on(cpu, x), _on(cpu, KEY), config, "kernel"), f"bits={bits}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("w", [1, 4])
def test_cuda_reduce_kernels_match_cpu(devices, dtype, stochastic, w):
    gpu, cpu = devices
    for bits, bucket in [(1, 3), (4, 512), (5, 500), (8, 4096)]:
        config = CompressionConfig(bits=bits, bucket_size=bucket, min_size=16)
        n = 3 * bucket + 11
        xs = [jnp.asarray(sample(n, dtype, seed=s)) for s in range(w)]
        q = jax.tree.map(lambda *a: jnp.stack(a), *[jax_cgx.quantize(x, config) for x in xs])
        addend = jnp.asarray(sample(n, dtype, seed=77))
        for dev_args in ((q, addend), (q, None)):
            out_g = sum_plain(*_on(gpu, dev_args), "kernel")
            out_c = sum_plain(*_on(cpu, dev_args), "kernel")
            assert_same_bits(out_g, out_c, f"dequantize_sum bits={bits}")
        _assert_same_roundtrip(sum_requantize(*_on(gpu, (q, addend, KEY)), stochastic, "kernel"),
                               sum_requantize(*_on(cpu, (q, addend, KEY)), stochastic, "kernel"),
                               f"requantized bits={bits}")


def test_cuda_large_buffer(devices):
    """256 MiB of float32: the sizes the benchmarks use, with int64 offsets."""
    gpu, cpu = devices
    n = 64 * 2**20
    x = jax.random.normal(jax.random.key(3), (n,), jnp.float32)
    config = CompressionConfig(bits=4, bucket_size=512, min_size=16)
    q_g, y_g = roundtrip(_on(gpu, x), _on(gpu, KEY), config, "kernel")
    q_c, y_c = roundtrip(_on(cpu, x), _on(cpu, KEY), config, "kernel")
    assert_same_bits(q_g.payload, q_c.payload, "payload 256 MiB")
    assert_same_bits(y_g, y_c, "decoded 256 MiB")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_compiled_for_gpu_matches_kernels(devices, stochastic):
    """The pure-JAX reference is exact under XLA:GPU too (no float divide: see
    reference.inverse_scale), so it is an oracle on either platform."""
    gpu, cpu = devices
    x = sample(100_003, jnp.float32, seed=11)
    for bits in BITS:
        for bucket in (7, 512):
            config = CompressionConfig(bits=bits, bucket_size=bucket, stochastic=stochastic, min_size=16)
            _assert_same_roundtrip(roundtrip(_on(gpu, x), _on(gpu, KEY), config, "reference"),
                                   roundtrip(_on(cpu, x), _on(cpu, KEY), config, "kernel"), f"bits={bits} B={bucket}")
