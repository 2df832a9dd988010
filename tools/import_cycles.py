"""Report import cycles inside jax_cgx, lazy (function-level) imports included.

    python tools/import_cycles.py      # exit 1 and print each cycle if there is one
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_cgx"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The jax_cgx modules ``path`` imports anywhere in its body (a package's own submodules
    count as the submodule, ``from pkg import sub`` as ``pkg.sub`` when that is a module)."""
    found = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules and n != me)
    return found


def main() -> int:
    files = [p for p in PACKAGE.rglob("*.py")]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports(p, modules) for p in files}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            # A package importing its own submodules (re-exports) is not a cycle by itself.
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    for c in cycles:
        print(" -> ".join(c))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
