"""Where a program's time goes, from JAX's profiler: XLA:CPU's operations grouped into phases.

    with jax.profiler.trace(directory, create_perfetto_trace=True):
        ...                                   # the steps to look at
    phases = summarize(directory)             # {"compute": ms, "codec": ms, "wire": ms, ...}

XLA:CPU records one event per operation it runs (its HLO name: ``fusion.3``,
``all-to-all.1``, ``jax_cgx_quantize.2``) on its own threads. :func:`phase` sorts them:

- ``codec``: jax_cgx's custom calls (quantize, dequantize, the fused reductions);
- ``wire``: the collectives (all-to-all, all-gather, all-reduce, collective-permute, ...);
- ``copies``: operations that only move bytes (concatenate, copy, pad, slice, dynamic update):
  fusion buffers being filled and emptied;
- ``compute``: everything else (forward, backward, the optimizer).

A process runs its operations one after another on XLA:CPU (docs/performance.md), so the
phases add up to the time the device was busy; what the step took beyond that is the host's
(dispatch, Python, waiting) and is reported as ``host`` by the caller, who knows the wall time.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

__all__ = ["PHASES", "phase", "summarize"]

PHASES = ("compute", "copies", "codec", "wire")

_WIRE = re.compile(r"all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute|send|recv|"
                   r"all_to_all|all_gather|all_reduce|reduce_scatter|collective_permute")
_COPIES = re.compile(r"^(wrapped_)?(concatenate|copy|pad|slice|dynamic[-_]update[-_]slice|dynamic[-_]slice|"
                     r"bitcast|reshape|transpose)([._-]|$)|^(concatenate|copy|pad|slice|dynamic_update_slice)_fusion")
# Events of the runtime around the operations (not operations themselves).
_RUNTIME = re.compile(r"^\$|Execute|PjRt|Pjit|Thunk|Buffer|Allocate|Handle |Parse|Threadpool|CreateOutputs|"
                      r"Await|Collect|^end: |Rendezvous|rendezvous")


def phase(name: str) -> str | None:
    """The phase of an operation's event name, or None for the runtime's own events."""
    if _RUNTIME.search(name):
        return None
    if name.startswith("jax_cgx_"):
        return "codec"
    if _WIRE.search(name):
        return "wire"
    if _COPIES.search(name):
        return "copies"
    return "compute"


def _events(directory: str | pathlib.Path) -> list[dict]:
    traces = sorted(pathlib.Path(directory).glob("**/*perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}: trace with create_perfetto_trace=True")
    with gzip.open(traces[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(directory: str | pathlib.Path) -> dict[str, float]:
    """Milliseconds per phase in the newest trace under ``directory``, plus ``ops``: their sum.

    Only events on XLA's threads count (not the Python thread's dispatch); an operation whose
    work is split over several threads counts once per thread, so ``compute`` can exceed the
    wall time of a multi-threaded operation.
    """
    events = _events(directory)
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "XLA" not in threads.get((e.get("pid"), e.get("tid")), ""):
            continue
        kind = phase(e.get("name", ""))
        if kind is not None:
            totals[kind] += float(e.get("dur", 0.0)) / 1e3
    out = {k: totals.get(k, 0.0) for k in PHASES}
    out["ops"] = sum(out.values())
    return out
