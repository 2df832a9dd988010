"""The compiled half of the nccl backend and the NCCL library it runs on.

:func:`binding` is the one door to the compiled NCCL functions of ``jax_cgx._cuda``
(tests replace it with a fake to run everything but real NCCL on CPU); :func:`load`
dlopens libnccl into the extension once, trying :func:`library_candidates` in order.
The errors of the whole backend live here too: every other module raises them.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from jax_cgx._src import extensions
from jax_cgx._src.backends.protocol import BackendError

__all__ = [
    "DEFAULT_SONAME",
    "LIBRARY_ENV",
    "NcclError",
    "NcclNotFoundError",
    "binding",
    "compiled",
    "library_candidates",
    "load",
    "require_binding",
]

log = logging.getLogger("jax_cgx")

LIBRARY_ENV = "JAX_CGX_NCCL_LIBRARY"
DEFAULT_SONAME = "libnccl.so.2"


class NcclError(BackendError):
    """The NCCL backend cannot do what was asked (setup, lookup or a failed NCCL call)."""


class NcclNotFoundError(NcclError):
    """NCCL is not available: no CUDA extension, one built without NCCL, or no libnccl."""


# ------------------------------------------------------------- the binding


def binding():
    """The compiled NCCL functions: ``jax_cgx._cuda``, or None without the CUDA extension.

    The object has ``nccl_compiled``, ``nccl_load``, ``nccl_unique_id``, ``nccl_init``,
    ``nccl_destroy`` and ``nccl_communicators``. Every module of jax_cgx.nccl calls it as
    ``library.binding()``, so that tests can monkeypatch this one function.
    """
    return extensions.cuda()


def _rebuild_hint() -> str:
    return (
        "Rebuild jax_cgx on a machine with nvcc and the NCCL headers: "
        "`pip install nvidia-nccl-cu13` (or set NCCL_HOME to an NCCL install), then "
        "`JAX_CGX_CUDA=ON pip install .` from a source checkout"
    )


def require_binding():
    """The binding, or NcclNotFoundError saying why it cannot run NCCL and how to fix it."""
    found = binding()
    if found is None:
        why = extensions.cuda_import_error()
        raise NcclNotFoundError(
            "jax_cgx.nccl: the nccl backend needs jax_cgx's CUDA extension (jax_cgx._cuda), "
            f"which this install lacks ({why}). {_rebuild_hint()}. Or use backend='xla'."
        )
    nccl_compiled = getattr(found, "nccl_compiled", None)  # absent in an extension older than the backend
    if nccl_compiled is None or not nccl_compiled():
        raise NcclNotFoundError(
            "jax_cgx.nccl: jax_cgx's CUDA extension was built without NCCL support (nccl.h was "
            f"not found at build time). {_rebuild_hint()}. Or use backend='xla'."
        )
    return found


def compiled() -> bool:
    """Whether the CUDA extension is installed and was built with NCCL support."""
    found = binding()
    try:
        return found is not None and bool(found.nccl_compiled())
    except Exception:  # pragma: no cover - a broken extension
        return False


# ------------------------------------------------------------- loading libnccl


def _wheel_libraries() -> list[str]:
    """libnccl.so.2 of the nvidia-nccl-cu13 wheel (the one jax[cuda13] installs), if present."""
    found: list[str] = []
    try:
        wheel = importlib.import_module("nvidia.nccl")
        for root in list(getattr(wheel, "__path__", [])):
            found.append(os.path.join(root, "lib", DEFAULT_SONAME))
    except ImportError:
        pass
    if not any(os.path.exists(p) for p in found):
        # Another layout of the wheel: ask its file list.
        try:
            from importlib import metadata

            for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
                try:
                    files = metadata.files(dist) or []
                except metadata.PackageNotFoundError:
                    continue
                for f in files:
                    if f.name == DEFAULT_SONAME:
                        path = str(f.locate())
                        if path not in found:
                            found.append(path)
        except Exception:  # pragma: no cover - unusual metadata
            pass
    return found


def library_candidates() -> list[str]:
    """Where libnccl is looked for, in order.

    1. ``$JAX_CGX_NCCL_LIBRARY`` (a file path), when set;
    2. ``libnccl.so.2`` of the ``nvidia-nccl-cu13`` wheel
       (``nvidia.nccl.__path__[0]/lib/libnccl.so.2``), when installed;
    3. ``""``: the dynamic loader's default search for ``libnccl.so.2``.

    Returns:
      The candidates, a list of ``str`` paths, the last always ``""``.
    """
    candidates: list[str] = []
    env = os.environ.get(LIBRARY_ENV, "")
    if env:
        candidates.append(env)
    for path in _wheel_libraries():
        if path not in candidates:
            candidates.append(path)
    candidates.append("")
    return candidates


_load_lock = threading.Lock()
_loaded: tuple[Any, int] | None = None  # (binding, ncclGetVersion code)


def load() -> int:
    """Load libnccl into the CUDA extension (once) and return its version code (e.g. 23203).

    Tries :func:`library_candidates` in order. Raises :class:`NcclNotFoundError` when the
    CUDA extension is missing or was built without NCCL, or when no candidate loads.

    Returns:
      NCCL's version code, an ``int`` (``ncclGetVersion``'s: 23203 for 2.32.3).

    Raises:
      NcclNotFoundError: no CUDA extension, one built without NCCL, or no candidate that loads
        (the message lists each one tried, with why).
    """
    global _loaded
    with _load_lock:
        found = require_binding()
        if _loaded is not None and _loaded[0] is found:
            return _loaded[1]
        env = os.environ.get(LIBRARY_ENV, "")
        tried: list[str] = []
        for path in library_candidates():
            try:
                version = int(found.nccl_load(path))
            except Exception as err:  # RuntimeError with dlerror's text
                tried.append(f"{path or DEFAULT_SONAME + ' (default search)'}: {err}")
                continue
            if env and path != env:
                log.warning("jax_cgx.nccl: %s=%s did not load (%s); using %s", LIBRARY_ENV, env, tried[0],
                            path or DEFAULT_SONAME)
            log.debug("jax_cgx.nccl: loaded NCCL %d from %s", version, path or DEFAULT_SONAME)
            _loaded = (found, version)
            return version
        raise NcclNotFoundError(
            "jax_cgx.nccl: cannot load the NCCL library. Tried:\n  " + "\n  ".join(tried) + "\n"
            "Install it with `pip install 'jax_cgx[cuda]'` (the nvidia-nccl-cu13 wheel), or set "
            f"{LIBRARY_ENV}=/path/to/libnccl.so.2."
        )

