"""The layering rule of docs/architecture.md, as a test: which part of jax_cgx may import which.

A part is a subpackage (``collectives``, ``nccl``, ...) or a top-level module (``config``, ...).
Imports anywhere in a module count, lazy (function-level) ones included. An import not in
ALLOWED fails, unless it is one of KNOWN_EXCEPTIONS (today's departures from the rule, each with
the issue that removes it); an exception that no longer occurs fails too, so the list only shrinks.
"""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_cgx"
COMPILED = {"jax_cgx._cpu", "jax_cgx._cuda"}  # extension modules: what _extensions loads

BASE = {"_compat", "_args", "config"}
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "_compat": set(),
    "_args": {"_compat"},
    "allocator": set(),
    "_extensions": set(),
    "codec": BASE | {"_extensions"},
    # The seam: knows no particular transport; every backend implements it.
    "backends": BASE,
    "collectives": BASE | {"codec", "backends"},
    # The transports: they implement the protocol and know nothing of the collectives.
    "nccl": BASE | {"_extensions", "backends"},
    "tcp": BASE | {"_extensions", "backends"},
    "optax": BASE | {"codec", "collectives"},
    "data_parallel": BASE | {"codec", "collectives"},
    "testing": BASE | {"codec", "collectives"},
    "distributed": BASE,
    "launch": BASE | {"distributed"},
    # The public face and the tools on top of it may use anything.
    "__init__": None,
    "bench": None,
}
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _part(module: str) -> str:
    parts = module.split(".")
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
