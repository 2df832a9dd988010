"""The compiled extensions, loaded once: ``jax_cgx._cpu`` (always built) and ``jax_cgx._cuda``
(built where nvcc was found). Every other module reaches them through :func:`cpu` and :func:`cuda`,
never by their private names, so that a missing or broken build is explained in one place.

Loading them registers every FFI target they export with XLA, here and nowhere else: the codec's
kernels and the tcp and nccl transports' calls alike, so no part of jax_cgx depends on another
having been imported first. Also the CPU kernels' instruction-set variant (``JAX_CGX_CPU_ISA``),
chosen at import.
"""

from __future__ import annotations

import os
from types import ModuleType

import jax

__all__ = ["INTERFACE_VERSION", "ISAS", "ISA_ENV", "check_interface", "choose_isa", "cpu", "cuda",
           "cuda_extension_available", "cuda_import_error", "require_cuda_extension"]

# The FFI targets' interface this Python code lowers to: kInterfaceVersion in xla_ffi/ffi_support.h,
# which the extensions export. Bump both together whenever a target's operands or attributes change.
INTERFACE_VERSION = 2


def check_interface(module: ModuleType) -> None:
    """Refuse an extension built from other sources than this Python code (an old build left in an
    editable install): every call would fail on an attribute it does not know, far from the cause."""
    built = getattr(module, "interface_version", 1)  # builds before the number existed were 1
    if built != INTERFACE_VERSION:
        raise ImportError(
            f"jax_cgx's compiled extension {module.__name__} implements FFI interface {built}, but this jax_cgx "
            f"needs {INTERFACE_VERSION}: it was built from older or newer sources. Rebuild it: `pip install -e .` "
            "from the checkout (or, with the build dependencies installed, `pip install --no-build-isolation "
            "--no-deps -e .`).")


try:
    from jax_cgx import _cpu
except ImportError as err:  # pragma: no cover - a broken install
    here = os.path.dirname(os.path.abspath(__file__))
    hint = f"Reinstall jax_cgx with `pip install .` from a source checkout ({err})."
    if os.path.exists(os.path.join(os.path.dirname(here), "CMakeLists.txt")):
        hint = (
            f"Python imported jax_cgx from the source tree {here}, which holds no compiled "
            "extension, instead of the installed package: run from another directory, use "
            "`pytest` rather than `python -m pytest` (which puts the current directory first), "
            "or install in editable mode (`pip install -e .`)."
        )
    raise ImportError(f"jax_cgx's compiled CPU extension (jax_cgx._cpu) cannot be imported. {hint}") from err
check_interface(_cpu)

try:
    from jax_cgx import _cuda
    _cuda_error: Exception | None = None
except ImportError as err:
    _cuda = None
    _cuda_error = err
if _cuda is not None:
    check_interface(_cuda)  # a stale CUDA build is an error, not a silent fallback to the reference


def _register_targets() -> None:
    """Every FFI target of the extensions, registered with XLA under its name (each extension's
    ``registrations()``: name -> handler capsule), for the platform it runs on."""
    for name, capsule in _cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if _cuda is not None:
        for name, capsule in _cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


_register_targets()


def cpu() -> ModuleType:
    """The CPU extension: the codec kernels' FFI targets and the tcp transport."""
    return _cpu


def cuda() -> ModuleType | None:
    """The CUDA extension (the CUDA kernels' FFI targets and the nccl transport), or None."""
    return _cuda


def cuda_extension_available() -> bool:
    """Whether jax_cgx was built with its CUDA extension.

    Returns:
      True when the CUDA kernels were compiled in (a GPU may still be absent); False where the
      build found no nvcc (GPU arrays then use the pure-JAX reference, bitwise the same).
    """
    return _cuda is not None


def cuda_import_error() -> Exception | None:
    """Why the CUDA extension did not import (None when it did)."""
    return _cuda_error


def require_cuda_extension() -> ModuleType:
    """The CUDA extension, or a clear error when a GPU-only feature is used without it."""
    if _cuda is None:
        raise RuntimeError(
            f"jax_cgx was built without its CUDA extension (jax_cgx._cuda: {_cuda_error}). Rebuild on a "
            "machine with nvcc, e.g. `JAX_CGX_CUDA=ON pip install .`, to use the GPU kernels."
        )
    return _cuda


ISA_ENV = "JAX_CGX_CPU_ISA"
ISAS = ("auto", "avx512", "avx2", "baseline")


def choose_isa(environ=None) -> str:
    """Set the CPU kernels' variant from ``JAX_CGX_CPU_ISA`` (unset or empty: auto); at import.

    The C++ reads the variable when a kernel first runs and takes a name it does not know
    (``AVX2``, a typo) or one this CPU lacks for ``auto`` without a word; so it is checked
    here, before, and the variant is set explicitly (the C++ then never reads it).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ISA_ENV, "")
    name = raw or "auto"
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={raw!r} is not a CPU kernel variant: use one of {', '.join(ISAS)} (lower "
                         "case; auto, the default, picks the best this CPU runs)")
    if not _cpu.set_isa(name):
        runs = ", ".join(_cpu.kernel_info()["isa_supported"])
        raise ValueError(f"{ISA_ENV}={raw!r}: this CPU cannot run the {name} kernels; it runs {runs} "
                         "(auto, the default, picks the best of them)")
    return name


choose_isa()
