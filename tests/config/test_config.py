"""CompressionConfig validation and torch_cgx's environment variables."""

import numpy as np
import pytest

from jax_cgx import CompressionConfig


def test_defaults_and_hashable():
    c = CompressionConfig()
    assert (c.bits, c.bucket_size, c.stochastic, c.skip_incomplete_buckets) == (4, 128, False, False)
    assert (c.min_size, c.fusion_buffer_mb) == (1024, 64)  # docs/choosing-settings.md: the default setting
    torch_cgx = CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "4"})
    assert (torch_cgx.bucket_size, torch_cgx.min_size) == (512, 16)  # torch_cgx's defaults there
    assert hash(c) == hash(CompressionConfig())
    assert {c: 1}[CompressionConfig()] == 1
    with pytest.raises(AttributeError):
        c.bits = 8  # frozen


@pytest.mark.parametrize("bits", [*range(1, 9), 16, 32])
def test_valid_bits(bits):
    assert CompressionConfig(bits=bits).bits == bits


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(bits=0), ValueError, "bits=0 is not supported"),
        (dict(bits=9), ValueError, "bits=9 is not supported"),
        (dict(bits=12), ValueError, "bits=12"),
        (dict(bits=4.0), TypeError, "bits must be an int"),
        (dict(bits=True), TypeError, "bits must be an int"),
        (dict(bucket_size=0), ValueError, r"bucket_size=0 must be >= 1; use a whole number of values in 1\.\.2147483647"),
        (dict(bucket_size=-5), ValueError, r"bucket_size=-5 must be >= 1"),
        (dict(bucket_size=2**63), ValueError, r"bucket_size=9223372036854775808 is above the largest bucket, 2147483647"),
        (dict(half_dtype=np.dtype("float16")), ValueError, "half_dtype must be 'bfloat16' or 'float16'"),
        (dict(fusion_buffer_mb=np.bool_(True)), TypeError, "fusion_buffer_mb must be a number of MiB"),
        (dict(stochastic=1), TypeError, "stochastic must be a bool"),
        (dict(skip_incomplete_buckets="yes"), TypeError, "skip_incomplete_buckets must be a bool"),
        (dict(min_size=-1), ValueError, "min_size=-1 must be >= 0"),
        (dict(fusion_buffer_mb=0), ValueError, r"fusion_buffer_mb=0 is below 1/1024 MiB \(1 KiB\); use a finite number of MiB >= 1/1024"),
        (dict(fusion_buffer_mb=float("inf")), ValueError, "fusion_buffer_mb=inf is not finite"),
        (dict(fusion_buffer_mb=float("nan")), ValueError, "fusion_buffer_mb=nan is not finite"),
        (dict(fusion_buffer_mb=1e-9), ValueError, r"fusion_buffer_mb=1e-09 is below 1/1024 MiB"),
        (dict(fusion_buffer_mb="64"), TypeError, "fusion_buffer_mb must be a number"),
        (dict(half_dtype="float8"), ValueError, "half_dtype must be"),
    ],
)
def test_invalid_values_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        CompressionConfig(**kwargs)


def test_replace_validates():
    assert CompressionConfig().replace(bits=8).bits == 8
    with pytest.raises(ValueError):
        CompressionConfig().replace(bits=10)


def test_fusion_buffer_bounds():
    from jax_cgx._src.config import MIN_FUSION_BUFFER_MB

    assert MIN_FUSION_BUFFER_MB == 2**-10
    assert CompressionConfig(fusion_buffer_mb=MIN_FUSION_BUFFER_MB).fusion_buffer_bytes == 1024
    # finite but huge: exact, no OverflowError
    assert CompressionConfig(fusion_buffer_mb=1e308).fusion_buffer_bytes == int(1e308) * 2**20
    with pytest.raises(ValueError, match="fusion_buffer_mb"):
        CompressionConfig(fusion_buffer_mb=MIN_FUSION_BUFFER_MB / 2)
    # numpy numbers are numbers, kept as the Python ones (equal configs hash alike)
    for value, same in ((np.int64(64), 64), (np.float32(0.5), 0.5)):
        config = CompressionConfig(fusion_buffer_mb=value)
        assert type(config.fusion_buffer_mb) is type(same) and config == CompressionConfig(fusion_buffer_mb=same)
        assert hash(config) == hash(CompressionConfig(fusion_buffer_mb=same))


def test_properties():
    assert not CompressionConfig(bits=32).enabled
    assert CompressionConfig(bits=16).enabled and not CompressionConfig(bits=16).quantizes
    assert CompressionConfig(bits=3).quantizes
    assert CompressionConfig(fusion_buffer_mb=1.5).fusion_buffer_bytes == 3 * 2**19


def test_from_env_defaults_are_torch_cgx_defaults():
    c = CompressionConfig.from_env({})
    assert c.bits == 32 and not c.enabled  # compression off unless asked for
    assert (c.bucket_size, c.skip_incomplete_buckets, c.min_size, c.fusion_buffer_mb) == (512, False, 16, 64)


def test_from_env_reads_every_variable():
    env = {
        "CGX_COMPRESSION_QUANTIZATION_BITS": "3",
        "CGX_COMPRESSION_BUCKET_SIZE": "1024",
        "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "1",
        "CGX_COMPRESSION_MINIMAL_SIZE": "4096",
        "CGX_FUSION_BUFFER_SIZE_MB": "8",
    }
    c = CompressionConfig.from_env(env)
    assert (c.bits, c.bucket_size, c.skip_incomplete_buckets, c.min_size, c.fusion_buffer_mb) == (
        3,
        1024,
        True,
        4096,
        8,
    )


def test_from_env_minimal_size_never_below_16():
    assert CompressionConfig.from_env({"CGX_COMPRESSION_MINIMAL_SIZE": "2"}).min_size == 16


def test_from_env_overrides_win():
    c = CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "8"}, stochastic=True, bits=2)
    assert c.bits == 2 and c.stochastic


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "6")
    assert CompressionConfig.from_env().bits == 6


@pytest.mark.parametrize(
    "name, value",
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "four"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "9"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "1.5"),
        ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "2"),
        ("CGX_COMPRESSION_MINIMAL_SIZE", "-1"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "lots"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "0"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "inf"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "nan"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "1e-9"),
        ("JAX_CGX_PIPELINE_SEGMENTS", "65"),
        ("JAX_CGX_PIPELINE_SEGMENTS", "-1"),
        ("JAX_CGX_PIPELINE_SEGMENTS", "x"),
    ],
)
def test_from_env_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        CompressionConfig.from_env({name: value})


def test_execution_fields_defaults_and_validation():
    c = CompressionConfig()
    assert (c.backend, c.algorithm, c.hierarchical, c.pipeline_segments) == ("auto", "sra", False, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        CompressionConfig(backend="mpi")
    with pytest.raises(ValueError, match="algorithm must be 'sra' or 'ring'"):
        CompressionConfig(algorithm="tree")
    with pytest.raises(TypeError, match="hierarchical must be a bool"):
        CompressionConfig(hierarchical=1)
    with pytest.raises(ValueError, match=r"pipeline_segments=65 is above 64; use 0\.\.64"):
        CompressionConfig(pipeline_segments=65)
    with pytest.raises(TypeError, match="pipeline_segments must be an int"):
        CompressionConfig(pipeline_segments=2.0)


def test_from_env_execution_variables():
    env = {"JAX_CGX_BACKEND": "NCCL", "JAX_CGX_ALGORITHM": "ring", "JAX_CGX_HIERARCHICAL": "1",
           "JAX_CGX_PIPELINE_SEGMENTS": "4"}
    c = CompressionConfig.from_env(env)
    assert (c.backend, c.algorithm, c.hierarchical, c.pipeline_segments) == ("nccl", "ring", True, 4)
    # torch_cgx's cross-node communicator type maps to a backend; ours wins when both are set
    assert CompressionConfig.from_env({"CGX_CROSS_COMMUNICATOR_TYPE": "nccl"}).backend == "nccl"
    assert CompressionConfig.from_env({"CGX_CROSS_COMMUNICATOR_TYPE": "MPI"}).backend == "xla"
    assert CompressionConfig.from_env({"CGX_CROSS_COMMUNICATOR_TYPE": "SHM", "JAX_CGX_BACKEND": "auto"}).backend == "auto"
    # accepted for compatibility (validated, no effect)
    assert CompressionConfig.from_env({"CGX_INNER_COMMUNICATOR_TYPE": "SHM", "CGX_INTRA_BROADCAST": "1"}) == (
        CompressionConfig.from_env({})
    )


@pytest.mark.parametrize(
    "env, match",
    [
        ({"JAX_CGX_BACKEND": "gloo"}, "JAX_CGX_BACKEND='gloo' must be auto, xla, nccl or tcp"),
        ({"JAX_CGX_ALGORITHM": "tree"}, "JAX_CGX_ALGORITHM='tree' must be sra or ring"),
        ({"JAX_CGX_HIERARCHICAL": "yes"}, "JAX_CGX_HIERARCHICAL='yes' must be 0 or 1"),
        ({"JAX_CGX_PIPELINE_SEGMENTS": "x"}, "JAX_CGX_PIPELINE_SEGMENTS='x' is not an integer"),
        ({"CGX_CROSS_COMMUNICATOR_TYPE": "UCX"}, "CGX_CROSS_COMMUNICATOR_TYPE='UCX' must be NCCL, MPI or SHM"),
        ({"CGX_INNER_COMMUNICATOR_TYPE": "UCX"}, "CGX_INNER_COMMUNICATOR_TYPE='UCX' must be NCCL, MPI or SHM"),
        ({"CGX_INTRA_BROADCAST": "2"}, "CGX_INTRA_BROADCAST='2' must be 0 or 1"),
    ],
)
def test_from_env_execution_variables_malformed(env, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig.from_env(env)
