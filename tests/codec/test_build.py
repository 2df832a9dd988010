"""The package: imports without a GPU, reports its extensions, lowers to the FFI kernels."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src import extensions


def test_import_needs_no_gpu_and_no_nccl(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu", LD_LIBRARY_PATH="")
    code = "import jax_cgx, jax.numpy as jnp; print(jax_cgx.dequantize(jax_cgx.quantize(jnp.ones(8))).sum())"
    # cwd outside the checkout: `python -c` puts the current directory first on sys.path.
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8.0"


def test_missing_cuda_extension_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(extensions, "_cuda", None)
    monkeypatch.setattr(extensions, "_cuda_error", ImportError("not built"))
    assert not jax_cgx.cuda_extension_available()
    with pytest.raises(RuntimeError, match="built without its CUDA extension.*JAX_CGX_CUDA=ON"):
        extensions.require_cuda_extension()


def test_the_extensions_implement_this_code_s_interface():
    """The built extensions export the FFI interface this Python code lowers to; a stale build (another
    number, or none: built before the number existed) is refused at import with the rebuild command."""
    import types

    assert extensions.cpu().interface_version == extensions.INTERFACE_VERSION
    if extensions.cuda() is not None:
        assert extensions.cuda().interface_version == extensions.INTERFACE_VERSION
    for stale in (types.ModuleType("jax_cgx._cpu"), types.SimpleNamespace(__name__="jax_cgx._cuda",
                                                                           interface_version=1)):
        with pytest.raises(ImportError, match=r"implements FFI interface 1, but this jax_cgx needs 2.*pip install -e"):
            extensions.check_interface(stale)


def test_the_kernels_take_the_widths_python_checks():
    # One rule, one home per language: xla_ffi/codec_math.h's kMinBits..kMaxBits and config's QUANTIZED_BITS.
    from jax_cgx._src.config import QUANTIZED_BITS
    widths = (QUANTIZED_BITS.start, QUANTIZED_BITS.stop - 1)
    assert tuple(extensions.cpu().codec_bits) == widths
    if extensions.cuda() is not None:
        assert tuple(extensions.cuda().codec_bits) == widths


def test_cpu_lowering_is_the_ffi_custom_call():
    f = jax.jit(lambda x: jax_cgx.dequantize(jax_cgx.quantize(x, CompressionConfig(bits=3, min_size=16)), impl="kernel"))
    hlo = f.lower(jnp.ones(1000)).as_text()
    assert "jax_cgx_quantize" in hlo and "jax_cgx_dequantize" in hlo


@pytest.mark.skipif(not jax_cgx.cuda_extension_available(), reason="CUDA extension not built")
def test_cuda_lowering_is_the_ffi_custom_call():
    """Cross-lowering for CUDA works without a GPU and must name our targets."""
    f = jax.jit(lambda x: jax_cgx.quantize(x, CompressionConfig(bits=4, min_size=16), impl="kernel").payload)
    hlo = f.trace(jnp.ones(1000)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_cgx_quantize" in hlo


def test_platform_without_kernel_falls_back_to_reference_with_a_warning(caplog):
    f = jax.jit(lambda x: jax_cgx.quantize(x, CompressionConfig(bits=4, min_size=16), impl="auto").payload)
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        hlo = f.trace(jnp.ones(1000)).lower(lowering_platforms=("tpu",)).as_text()
    assert "jax_cgx_quantize" not in hlo
    assert any("pure-JAX reference" in r.message for r in caplog.records)


def test_platform_without_kernel_and_impl_kernel_raises():
    f = jax.jit(lambda x: jax_cgx.quantize(x, CompressionConfig(bits=4, min_size=16), impl="kernel").payload)
    with pytest.raises(NotImplementedError, match="no compiled kernel.*impl='auto'"):
        f.trace(jnp.ones(1000)).lower(lowering_platforms=("tpu",))
