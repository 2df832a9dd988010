"""The seam between the compressed collectives and the transports that run them.

A compressed collective (``compressed_psum``'s all-reduce, ``compressed_psum_scatter``,
``compressed_all_gather``) is a JAX primitive whose exchange can run on several backends:

- ``xla``: the collective's own program, XLA collectives around the codec's kernels, on every
  platform (:mod:`jax_cgx._src.backends.xla`);
- ``tcp``: jax_cgx's TCP connections between CPU processes (:mod:`jax_cgx.tcp`);
- ``nccl``: jax_cgx's NCCL communicators on CUDA GPUs (:mod:`jax_cgx.nccl`).

Each is a :class:`Backend` in one registry (:func:`register`, done when its package is
imported): it says where it runs and what it runs, whether it can run a given reduction
(:meth:`Backend.unavailable`, :meth:`Backend.unsupported`), what ``policy="auto"`` times it as (``timed_as``), how to lower a reduction
(``lower``), and how to connect and disconnect a mesh (``setup``, ``teardown``). The
collectives name none of them.

A reduction's backend is chosen once, while it is traced (:func:`choose_in_trace`), from the
backend its config asks for and the communicators set up for the mesh and axes it reduces over.
The primitive carries the choice as its ``backend`` parameter, ``policy="auto"`` prices that
backend, and the primitive's one lowering rule (:func:`register_lowering`) hands the reduction
to it, once the processes agreed on it (:mod:`~jax_cgx._src.backends.agreement`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.interpreters import mlir

from jax_cgx._src import compat
from jax_cgx._src.backends import agreement
from jax_cgx._src.backends.groups import Families
from jax_cgx._src.config import BACKENDS

__all__ = ["Backend", "BackendError", "CommunicatorInfo", "Reduction", "XlaProgram", "choose", "choose_in_trace",
           "get", "mean_scale", "register", "register_lowering", "registered"]

log = logging.getLogger("jax_cgx")


class BackendError(RuntimeError):
    """A backend asked for by name cannot run a reduction (``NcclError`` and ``TcpError`` are these)."""


class CommunicatorInfo(NamedTuple):
    """One communicator a backend holds in this process (``jax_cgx.nccl.communicators()``, ``jax_cgx.tcp...``)."""

    #: The family key of the reduction's group (an attribute of the custom call).
    key: int
    #: The device ordinal it runs on (``jax.Device.local_hardware_id``).
    ordinal: int
    #: This device's rank in the communicator.
    rank: int
    #: The communicator's number of ranks.
    world: int
    #: What the backend says of it (peers, transport).
    description: str


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What a backend is asked to run: one compressed collective over ``axes`` (``world`` ranks)."""

    api: str  # the public function, for messages: "compressed_psum", "compressed_psum_scatter", ...
    op: str  # "psum", "psum_scatter" or "all_gather"
    axes: tuple[str, ...]
    world: int
    algorithm: str = "sra"
    impl: str = "auto"
    residual: bool = False  # error feedback: the exchange also returns each rank's compression error


def mean_scale(divisor: int) -> float:
    """The scale every backend decodes an all-reduce's result with when the primitive's ``divisor``
    is not 1 (``compressed_pmean``: ``W``): ``float32(1) / float32(divisor)``. XLA computes
    ``x / divisor`` as ``x`` times this (it turns a division by a constant into a multiplication by
    its reciprocal, and flushes subnormals on CPU), so a float32 decode scaled by it has the bits of
    ``sum / divisor``."""
    if divisor < 1:
        raise ValueError(f"mean_scale: the divisor must be a positive integer, got {divisor!r}")
    return float(np.float32(1) / np.float32(divisor))


class XlaProgram(NamedTuple):
    """A collective's per-device program written with XLA collectives: what the xla backend lowers.

    ``fn(*operands, platforms=..., **params)`` (``platforms``: the lowering's, which set the
    message cap) returns one array, or a tuple of them when ``multiple_results``.
    """

    fn: Callable
    multiple_results: bool = False


class Backend:
    """One way to run the compressed collectives' exchanges. Subclasses set the class attributes
    and implement :meth:`lower`; those that own connections also give :attr:`families`,
    :meth:`setup` and :meth:`teardown`."""

    name: str = ""
    platforms: frozenset[str] | None = None  # where it runs; None: everywhere
    where: str = ""  # the platforms in words, for messages: "CUDA GPUs"
    ops: frozenset[str] = frozenset({"psum", "psum_scatter", "all_gather"})
    residuals: bool = False  # computes error feedback's residuals (return_residual=True)
    timed_as: str = "xla"  # the backend policy="auto" times this one's buffers on (near-ties; all off CPU)
    error: type[Exception] = BackendError
    families: Families | None = None  # the meshes connected here (None: needs none)
    communicator: str = "communicator"  # what one connection is called, for messages
    setup_hint: str = ""  # the call that connects a mesh: "jax_cgx.nccl.setup(mesh)"
    # Why backend="auto" passes this backend over even where it is connected for a reduction ("":
    # auto takes it there); backend=NAME still runs it. Logged as a warning, once per axes.
    passed_over_by_auto: str = ""

    # ------------------------------------------------------------ what a backend implements

    def unavailable(self, requested: bool) -> str:
        """Why this backend cannot run anything in this process ("" when it can); ``requested``:
        raise the backend's own error with the fix instead."""
        return ""

    def unsupported(self, reduction: Reduction) -> str:
        """Why this backend cannot run ``reduction`` wherever it is connected ("" when it can)."""
        return ""

    def lower(self, ctx, op: str, operands: tuple, params: dict[str, Any], program: XlaProgram):
        """The reduction's MLIR: the ``op`` primitive's ``operands`` and ``params``, lowered by this backend."""
        raise NotImplementedError

    def setup(self, mesh, axes=None, **options):
        raise NotImplementedError(f"jax_cgx: the {self.name} backend connects nothing")

    def teardown(self, mesh=None) -> int:
        raise NotImplementedError(f"jax_cgx: the {self.name} backend connects nothing")

    # ------------------------------------------------------------ shared by every backend

    def check(self, reduction: Reduction, mesh, platform: str, requested: bool) -> str:
        """"" when this backend runs ``reduction`` over ``mesh`` on ``platform``, else why not;
        ``requested`` (the config names this backend): raise an error that says how to fix it."""
        axes, name = reduction.axes, self.name

        def refuse(why: str, error: Exception) -> str:
            if requested:
                raise error
            return why

        if reduction.op not in self.ops:
            return refuse(f"{name} runs {_ops_text(self.ops)} only", NotImplementedError(
                f"{reduction.api}: backend={name!r} runs {_ops_text(self.ops)} only so far; use backend='auto' or "
                "'xla' (XLA collectives around the codec's kernels, on every platform)"))
        if reduction.residual and not self.residuals:
            return refuse("error feedback residuals are computed by the xla backend only", NotImplementedError(
                f"{reduction.api}(return_residual=True): error feedback residuals are computed by the xla backend "
                "only; use backend='auto' or 'xla'."))
        if self.platforms is not None and platform not in self.platforms:
            return refuse(f"platform is {platform}", self.wrong_platform("jax_cgx", repr(platform)))
        if why := self.unavailable(requested):
            return why
        if self.families is not None:
            key, why = self.families.find(mesh, axes)
            if key is None:
                return refuse(f"{why}; call {self.setup_hint} to use {name}", self.error(
                    f"jax_cgx: backend={name!r}: no {self.communicator} for axes {_axes_text(axes)} of mesh "
                    f"{mesh!r} ({why}); call {self.setup_hint} (on every process, before the first call of the "
                    "compiled function), or use backend='auto' or 'xla'."))
        if why := self.unsupported(reduction):
            return refuse(why, self.error(f"jax_cgx: backend={name!r} cannot run this reduction: {why}; use "
                                          "backend='auto'"))
        return ""

    def wrong_platform(self, api: str, lowered_for: str) -> Exception:
        """This backend's error for a computation lowered for a platform it does not run on."""
        return self.error(
            f"{api}: backend={self.name!r} runs on {self.where} only, but this computation is lowered for "
            f"{lowered_for}. Use backend='auto' ({self.name} where set up, else xla) or backend='xla'.")

    def key(self, ctx, axes: tuple[str, ...]) -> int:
        """The family key of the mesh being lowered and ``axes``: which communicators run the call."""
        key, why = self.families.find(compat.context_mesh(ctx), axes)
        if key is None:  # there were some when the reduction was traced
            raise self.error(
                f"jax_cgx: backend {self.name!r} was chosen for axes {_axes_text(axes)} while tracing, but has no "
                f"{self.communicator} for them now that the computation is lowered ({why}); set up before the first "
                "call of a compiled function and tear down after its last")
        return key


def _ops_text(ops) -> str:
    words = {"psum": "all-reduces", "psum_scatter": "reduce-scatters", "all_gather": "all-gathers"}
    return ", ".join(words[o] for o in ("psum", "psum_scatter", "all_gather") if o in ops)


def _axes_text(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


# ---------------------------------------------------------------------------- the registry

_registry: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Make ``backend`` available under its name (its package does this when imported)."""
    if backend.name not in BACKENDS or backend.name == "auto":
        raise ValueError(f"jax_cgx: a backend's name must be one of {BACKENDS[1:]}, got {backend.name!r}")
    _registry[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(f"jax_cgx: backend {name!r} is not loaded (loaded: {sorted(_registry)}); "
                         f"import jax_cgx.{name}") from None


def registered() -> list[Backend]:
    return list(_registry.values())


_warned: set[tuple[str, tuple[str, ...]]] = set()


def _warn_once(backend: str, axes: tuple[str, ...], message: str) -> None:
    if (backend, axes) not in _warned:
        _warned.add((backend, axes))
        log.warning(message)


def choose(requested: str, reduction: Reduction, mesh, platform: str) -> tuple[str, str]:
    """The backend that runs ``reduction`` over ``mesh`` on ``platform``: ``(name, reason)``.

    ``requested`` is ``CompressionConfig.backend``. ``"xla"`` is always honoured; a named
    backend raises its error when it cannot run the reduction here; ``"auto"`` takes the first
    backend that owns connections for ``(mesh, axes)`` and can run the reduction, unless it is
    :attr:`Backend.passed_over_by_auto` (then it warns once), else xla.
    """
    if requested not in BACKENDS:
        raise ValueError(f"jax_cgx: backend must be one of {BACKENDS}, got {requested!r}")
    # Backends name the platforms they are lowered for ("cuda"); a device's platform is "gpu".
    platform = compat.lowering_platform(platform)
    if requested == "xla":
        choice = ("xla", "requested")
    elif requested != "auto":
        get(requested).check(reduction, mesh, platform, requested=True)
        choice = (requested, f"communicators set up for axes {_axes_text(reduction.axes)} on this mesh")
    else:
        reasons = []
        for backend in registered():
            if backend.families is None:
                continue
            why = backend.check(reduction, mesh, platform, requested=False)
            if not why and backend.passed_over_by_auto:
                why = f"connected, but passed over: {backend.passed_over_by_auto}"
                _warn_once(backend.name, reduction.axes,
                           f"jax_cgx: backend='auto' runs the xla backend for axes {_axes_text(reduction.axes)}, not "
                           f"the {backend.communicator}s set up for them: {backend.passed_over_by_auto}. Pass "
                           f"CompressionConfig(backend={backend.name!r}) to run them.")
            if not why:
                choice = (backend.name, f"communicators set up for axes {_axes_text(reduction.axes)} on this mesh")
                break
            reasons.append(f"{backend.name}: {why}")
        else:
            choice = ("xla", "; ".join(reasons) or "no backend owns connections")
    log.debug("jax_cgx: backend %s for axes %r on %s (requested %s): %s", choice[0], reduction.axes, platform,
              requested, choice[1])
    return choice


def choose_in_trace(requested: str, reduction: Reduction) -> str:
    """:func:`choose` for a reduction being traced: over the mesh of the enclosing ``shard_map``
    (none inside ``pmap`` or outside a mesh) on that mesh's platform (else JAX's default)."""
    mesh = jax.sharding.get_abstract_mesh()
    return choose(requested, reduction, None if mesh.empty else mesh, compat.trace_platform())[0]


# ---------------------------------------------------------------------------- lowering

def register_lowering(prim, api: str, op: str, program: XlaProgram, *, residual: bool = False) -> None:
    """``prim``'s one lowering rule, every platform: the backend its ``backend`` parameter names
    lowers it, once the processes agreed on it. ``program`` is its xla backend's program."""

    def rule(ctx, *operands, backend: str, **params):
        chosen = get(backend)
        platforms = tuple(ctx.module_context.platforms)
        if chosen.platforms is not None and not set(platforms) <= chosen.platforms:
            raise chosen.wrong_platform(api, ", ".join(platforms))
        extra = {"residual": True} if residual else {}
        agreement.check(ctx, api, backend, **extra, **params)  # across processes, once per compile
        return chosen.lower(ctx, op, operands, params, program)

    # Not cacheable: a cached lowering is emitted once as a private function that every identical
    # call site calls, and a backend may chain its calls within the block they are lowered into (tcp).
    mlir.register_lowering(prim, rule, cacheable=False)
