"""The layering rule of docs/architecture.md, as a test: which part of jax_cgx may import which.

A part is a package or module of ``jax_cgx._src`` (``collectives``, ``config``, ...) together
with its public face, if it has one (``jax_cgx.nccl`` re-exports ``jax_cgx._src.nccl``), or a
public module of its own (``launch``, ``testing``, ...). Imports anywhere in a module count, lazy
(function-level) ones included. An import not in ALLOWED fails, unless it is one of
KNOWN_EXCEPTIONS (today's departures from the rule, each with the issue that removes it); an
exception that no longer occurs fails too, so the list only shrinks. And the parts import each
other without a circle.
"""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_cgx"
COMPILED = {"jax_cgx._cpu", "jax_cgx._cuda"}  # extension modules: what _src/extensions loads

BASE = {"compat", "arguments", "config", "errors"}
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "errors": set(),
    "compat": set(),
    "arguments": {"compat"},
    "allocator": set(),
    "extensions": set(),
    "codec": BASE | {"extensions"},
    # The seam: knows no particular transport; every backend implements it.
    "backends": BASE,
    # One buffer's all-reduce: its primitive carries the backend chosen for it.
    "exchange": BASE | {"codec", "backends"},
    # policy="auto": its probes time the exchange and set up a backend's probe mesh.
    "policy": BASE | {"codec", "backends", "exchange"},
    "collectives": BASE | {"codec", "backends", "exchange", "policy"},
    # The transports: they implement the protocol and know nothing of the collectives.
    "nccl": BASE | {"extensions", "backends"},
    "tcp": BASE | {"extensions", "backends"},
    "optax": BASE | {"codec", "collectives", "exchange"},
    "data_parallel": BASE | {"codec", "collectives"},
    # Bit widths per leaf: reads the plan's lanes.
    "adaptive": BASE | {"collectives"},
    "testing": BASE | {"codec", "collectives", "exchange"},
    "distributed": BASE | {"exits", "unmatched"},
    # A failed process ends at once (the failure line the launcher reads), not in jax's barrier.
    "exits": {"outputs"},
    # A process left in a collective its peers never run: ended by name.
    "unmatched": {"arguments", "exits", "outputs"},
    # The launcher (its processes' ends and --mps's daemon inside it): starts processes with the
    # allocator's settings and the variables distributed reads.
    "launch": BASE | {"distributed", "allocator", "outputs"},
    "outputs": set(),  # the processes' output as the launcher reads it: copied, and read for reports
    "cost_model": {"policy"},
    # The public face and the tools on top of it may use anything.
    "__init__": None,
    "bench": None,
}
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["_src"]:
        parts = parts[1:]
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def part_imports() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the importing modules, across parts only."""
    tool = runpy.run_path(str(ROOT / "tools" / "import_cycles.py"))
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {tool["module_name"](p) for p in paths} | COMPILED
    edges: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        me = tool["module_name"](path)
        for target in tool["imports"](path, modules):
            if target in COMPILED:
                continue
            edge = (_part(me), _part(target))
            if edge[0] != edge[1]:
                edges.setdefault(edge, []).append(me)
    return edges


def test_every_part_is_listed():
    parts = {_part(m) for m in (runpy.run_path(str(ROOT / "tools" / "import_cycles.py"))["module_name"](p)
                                for p in PACKAGE.rglob("*.py"))}
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to ALLOWED (and docs/architecture.md)"


def test_imports_follow_the_layers():
    edges = part_imports()
    bad = {
        edge: modules for edge, modules in edges.items()
        if ALLOWED[edge[0]] is not None and edge[1] not in ALLOWED[edge[0]] and edge not in KNOWN_EXCEPTIONS
    }
    assert not bad, "imports against docs/architecture.md's layers: " + "; ".join(
        f"{a} -> {b} (in {', '.join(sorted(set(m)))})" for (a, b), m in sorted(bad.items()))
    stale = set(KNOWN_EXCEPTIONS) - set(edges)
    assert not stale, f"no longer imported, remove from KNOWN_EXCEPTIONS: {sorted(stale)}"


def test_no_circle_between_parts():
    edges = {edge for edge in part_imports() if edge[0] != "__init__" and edge[1] != "__init__"}
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    circles = sorted((a, b) for a, b in edges if reaches(b, a, {b}))
    assert not circles, f"parts that import each other, directly or around a circle: {circles}"
