"""Processes agree on every compressed reduction they run together, when it is lowered.

Two processes that run different compressed reductions at the same point of a program (other
bits, bucket size, algorithm, dtype, fusion-buffer size, backend, axes) exchange messages of
different sizes: gloo aborts the process ("Received data size doesn't match expected size"),
other transports hang. So each compressed reduction that crosses processes is described when it
is lowered (:func:`check`, called by the one lowering rule every collective's primitive
registers, :func:`jax_cgx._src.backends.register_lowering`, before it hands the reduction to its backend),
and the descriptions are compared across the
processes through the ``jax.distributed`` key-value store: every process other than the first
publishes its description, the first reads them and publishes a verdict, and every process
raises the same :class:`ValueError`, naming both settings, when they differ; a process that did not
reach the point within ``$JAX_CGX_AGREE_TIMEOUT_S`` (300 s by default) is named in a
:class:`~jax_cgx.PeerError` instead (a fault of a peer, a ``jax.errors.JaxRuntimeError``). Lowering happens
once per compile, so this costs one store round trip per reduction per compile, and nothing at
run time.

Where a point is: the module's name, the processes that own its devices, and the descriptions
of the reductions lowered before it in the same module (those have matched, else lowering
stopped), plus how many other reductions this process agreed on at that same point (a function
traced again for new shapes). A reduction this process already agreed on at that point (a
function lowered again) is not sent again. So every process must lower the same compressed
reductions in the same order; one that lowers a cross-process reduction alone (``.lower()`` on
one process only) waits for its peers and fails after the timeout.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time

import jax
import numpy as np
from jax.interpreters import mlir

from jax_cgx._src.arguments import DEFAULT_TIMEOUT_S, timeout_seconds
from jax_cgx._src.compat import context_mesh
from jax_cgx._src.errors import PeerError

__all__ = ["check", "describe", "fields", "participants", "TIMEOUT_ENV"]

TIMEOUT_ENV = "JAX_CGX_AGREE_TIMEOUT_S"
_PREFIX = "jax_cgx/agree"
# The params that change neither the wire nor the program's collectives.
_SILENT = ("impl", "invariant", "message_cap")
# The order fields are described in (others follow, sorted).
_ORDER = ("bits", "bucket_size", "chunk", "algorithm", "stochastic", "segments", "residual", "backend", "axes",
          "world")

_lock = threading.Lock()
# id(module) -> [module, chain]: the hash of the module's point and the reductions agreed on in it so far.
_modules: dict[int, list] = {}
_MODULES_KEPT = 8
# point -> how many agreements this process started there; (point, description) agreed on.
_generations: dict[str, int] = {}
_agreed: set[tuple[str, str]] = set()


def fields(api: str, aval, platform: str, params: dict, mesh_shape: dict | None = None) -> list[list[str]]:
    """One reduction as ``[name, value]`` pairs: what it sends, over what, where."""
    shape = tuple(int(d) for d in aval.shape)
    out = [["function", api], ["n", str(math.prod(shape[1:]))], ["rows", str(shape[0])]]
    if len(shape) > 2:
        out.append(["shape", str(shape)])
    out.append(["dtype", np.dtype(aval.dtype).name])
    named = {k: v for k, v in params.items() if k not in _SILENT}
    for k in sorted(named, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k)):
        out.append([k, repr(named[k])])
    if mesh_shape:
        out.append(["mesh", repr(dict(mesh_shape))])
    out.append(["platform", platform])
    return out


def describe(pairs: list[list[str]]) -> str:
    """``compressed_psum(n=1000, rows=1, dtype=float32, bits=4, ...)``."""
    return f"{pairs[0][1]}({', '.join(f'{k}={v}' for k, v in pairs[1:])})"


def timeout() -> float:
    """``$JAX_CGX_AGREE_TIMEOUT_S``, else 300 s, checked as the backends' set-up timeouts."""
    return timeout_seconds(None, TIMEOUT_ENV, "jax_cgx")


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _devices(mesh):
    try:
        devices = mesh.devices  # an AbstractMesh has none
    except Exception:  # noqa: BLE001 - no concrete devices: unknown
        return None
    return devices if isinstance(devices, np.ndarray) and devices.size else None


def participants(ctx, axes: tuple) -> tuple[int, ...] | None:
    """The processes that lower this module, when the reduction over ``axes`` crosses processes; else None."""
    if jax.process_count() == 1:
        return None
    mesh = context_mesh(ctx)
    devices = _devices(mesh) if mesh is not None else None
    if devices is None:
        assigned = getattr(ctx.module_context.axis_context, "device_assignment", None)
        if assigned:
            processes = sorted({int(d.process_index) for d in assigned})
            return tuple(processes) if len(processes) > 1 else None
        return tuple(range(jax.process_count()))  # unknown devices: every process
    processes = sorted({int(d.process_index) for d in devices.flat})
    if len(processes) < 2:
        return None
    names = list(mesh.axis_names)
    if all(a in names for a in axes):
        moved = np.moveaxis(devices, [names.index(a) for a in axes], range(devices.ndim - len(axes), devices.ndim))
        groups = moved.reshape(-1, math.prod(devices.shape[names.index(a)] for a in axes))
        if all(len({int(d.process_index) for d in g}) == 1 for g in groups):
            return None  # every group lies within one process
    return tuple(processes)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def check(ctx, api: str, backend: str, **params) -> None:
    """Agree with the other processes on the reduction being lowered (module docstring).

    ``api``: the public function (``compressed_psum``, ...); ``backend``: the one that runs it;
    ``params``: the primitive's (``axes`` among them). Returns at once on one process, or when
    the reduction stays within each process. Raises :class:`ValueError` on every process when
    the processes' reductions differ.
    """
    axes = tuple(params.get("axes", ()))
    processes = participants(ctx, axes)
    client = _client() if processes else None
    if client is None:
        return
    module = ctx.module_context.module
    name = mlir.ir.StringAttr(module.operation.attributes["sym_name"]).value
    mesh = context_mesh(ctx)
    mesh_shape = dict(mesh.shape) if mesh is not None and hasattr(mesh, "shape") else None
    mine = json.dumps(fields(api, ctx.avals_in[0], ",".join(ctx.module_context.platforms),
                             dict(params, backend=backend), mesh_shape))
    with _lock:
        entry = _modules.get(id(module))
        if entry is None:
            if len(_modules) >= _MODULES_KEPT:
                _modules.pop(next(iter(_modules)))
            entry = _modules[id(module)] = [module, _digest(name, repr(processes)), 0]
        point, index = entry[1], entry[2]
        done = (point, mine) in _agreed
        if not done:
            generation = _generations.get(point, 0)
            _generations[point] = generation + 1
    if not done:
        where = f"the compressed reduction number {index + 1} lowered into '{name}'"
        _agree(client, f"{_PREFIX}/{point}/{generation}", processes, mine, where)
    with _lock:
        _agreed.add((point, mine))
        entry[1], entry[2] = _digest(point, mine), index + 1


def _agree(client, prefix: str, processes: tuple[int, ...], mine: str, where: str) -> None:
    """Publish ``mine`` (a JSON description), get the verdict of the first process, raise unless all agree.

    A malformed timeout raises after the exchange, which the other processes wait in, and marks
    this process's description, so that they fail too instead of running without this process.
    """
    try:
        wait, bad = timeout(), None
    except ValueError as err:
        wait, bad = DEFAULT_TIMEOUT_S, err
        mine = json.dumps([*json.loads(mine), [TIMEOUT_ENV, "malformed"]])
    try:
        _exchange(client, prefix, processes, mine, where, wait)
    finally:
        if bad is not None:
            raise bad


def _exchange(client, prefix: str, processes: tuple[int, ...], mine: str, where: str, wait: float) -> None:
    me, first = jax.process_index(), processes[0]
    deadline = time.monotonic() + wait
    remaining = lambda: max(1, int((deadline - time.monotonic()) * 1000))  # noqa: E731
    if me != first:
        client.key_value_set(f"{prefix}/{me}", mine)
        try:
            verdict = json.loads(client.blocking_key_value_get(f"{prefix}/verdict", remaining()))
        except Exception as err:  # noqa: BLE001 - the store's timeout error
            raise PeerError(
                f"jax_cgx: process {me} waited {wait:g} s at {where}, {describe(json.loads(mine))}, for process "
                f"{first}, which did not reach this point (it runs a different program here, failed, or is still "
                f"busy). {_RULE} More time: {TIMEOUT_ENV}. ({type(err).__name__}: {err})"
            ) from None
    else:
        seen, missing = {str(me): mine}, []
        for p in processes[1:]:
            try:
                seen[str(p)] = client.blocking_key_value_get(f"{prefix}/{p}", remaining())
            except Exception:  # noqa: BLE001 - the store's timeout error
                missing.append(p)
        verdict = {"seen": seen, "missing": missing}
        client.key_value_set(f"{prefix}/verdict", json.dumps(verdict))
    _raise_on(verdict, me, first, mine, where, wait)


_RULE = "Every process must run the same compressed reductions, with the same configs and shapes, in the same order."


def _raise_on(verdict: dict, me: int, first: int, mine: str, where: str, wait: float) -> None:
    seen, missing = verdict["seen"], verdict["missing"]
    theirs = seen[str(first)]
    other = [int(p) for p, d in seen.items() if d != theirs]
    if other:
        p = me if me in other else other[0]
        also = f" (processes that differ from process {first}: {', '.join(map(str, other))})" if len(other) > 1 else ""
        a, b = json.loads(seen[str(p)]), json.loads(theirs)
        raise ValueError(
            f"jax_cgx: process {p} runs a different reduction ({describe(a)}) than process {first} ({describe(b)}) "
            f"at {where}{also}: they differ in {_differing(a, b)}. {_RULE}")
    if missing:
        raise PeerError(
            f"jax_cgx: process {first} waited {wait:g} s at {where}, {describe(json.loads(theirs))}, for process"
            f"{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, which did not reach this point "
            f"(a different program here, a failure, or still busy). {_RULE} More time: {TIMEOUT_ENV}.")


def _differing(a: list, b: list) -> str:
    """The names of the fields in which two reductions differ."""
    fa, fb = dict(map(tuple, a)), dict(map(tuple, b))
    return ", ".join(k for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)) or "nothing visible"
