"""Every Sphinx cross-reference in the package and in docs/ names something that exists.

``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:`` and ``:obj:``
targets in every module of jax_cgx (private ones too, which the site does not render) and the
same roles in docs/ (``{func}`...``` in Markdown). A target is resolved by importing it: absolute
(``jax_cgx._src.policy.pricing.decide``, ``jax.lax.psum``), else relative to the module it is
written in or to one of that module's classes (``:meth:`replace``` in CompressionConfig's
docstring). Drift (a function renamed, a module moved) fails here, not in a reader's browser.
"""

import ast
import builtins
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROLES = "mod|func|class|meth|attr|data|exc|obj"
RST_ROLE = re.compile(rf":(?:py:)?(?:{ROLES}):`([^`]+)`")
MYST_ROLE = re.compile(rf"\{{(?:py:)?(?:{ROLES})\}}`([^`]+)`")


def _target(text: str) -> str:
    inside = re.search(r"<([^>]+)>$", text)
    target = (inside.group(1) if inside else text).strip().lstrip("~!").removesuffix("()")
    return target


def _lookup(obj, names):
    for name in names:
        if inspect.isclass(obj) and name in getattr(obj, "__dataclass_fields__", {}):
            obj = obj.__dataclass_fields__[name]
            continue
        if inspect.isclass(obj) and name in getattr(obj, "__annotations__", {}):
            obj = obj.__annotations__[name]
            continue
        obj = getattr(obj, name)
    return obj


def _resolve_absolute(target: str) -> bool:
    if hasattr(builtins, target):  # :exc:`ValueError`
        return True
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            _lookup(module, parts[i:])
            return True
        except AttributeError:
            return False
    return False


def _resolve(target: str, module_name: str | None) -> bool:
    if _resolve_absolute(target):
        return True
    if module_name is None:
        return False
    module = importlib.import_module(module_name)
    scopes = [module] + [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module_name]
    for scope in scopes:
        try:
            _lookup(scope, target.split("."))
            return True
        except AttributeError:
            continue
    return False


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _references():
    found = []
    for path in sorted((ROOT / "jax_cgx").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in RST_ROLE.finditer(node.value):
                    found.append((path, _module_name(path), _target(match.group(1))))
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.suffix in (".md", ".rst") and "_build" not in path.parts:
            text = path.read_text()
            for match in [*RST_ROLE.finditer(text), *MYST_ROLE.finditer(text)]:
                found.append((path, None, _target(match.group(1))))
    return found


REFERENCES = _references()


def test_references_were_found():
    assert len(REFERENCES) > 100, len(REFERENCES)


def test_every_reference_resolves():
    dangling = sorted({f"{path.relative_to(ROOT)}: {target}" for path, module, target in REFERENCES
                       if not _resolve(target, module)})
    assert not dangling, "targets that do not exist:\n" + "\n".join(dangling)


@pytest.mark.parametrize("target, module, expected", [
    ("jax_cgx.compressed_psum", None, True),
    ("jax_cgx._src.policy.pricing.decide", None, True),
    ("jax.lax.psum", None, True),
    ("jax_cgx.compressed_sum", None, False),
    ("CompressionConfig.from_env", "jax_cgx._src.config.compression", True),
    ("replace", "jax_cgx._src.config.compression", True),  # a method of the module's class
    ("bits", "jax_cgx._src.config.compression", True),  # a dataclass field
    ("cannot", "jax_cgx._src.backends.protocol", False),
])
def test_the_resolver(target, module, expected):
    assert _resolve(target, module) == expected


def test_the_offline_inventories_name_what_exists():
    # docs/_inventories/ (tools/make_inventories.py) stand in for Python's, NumPy's, JAX's and optax's
    # objects.inv where the build is offline: each name there must still be importable.
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from make_inventories import ENTRIES, OUT, inventory
    finally:
        sys.path.pop(0)
    for project, (version, rows) in ENTRIES.items():
        public = {name: page.replace("$", name) for name, _, page in rows if not any(p.startswith("_") for p in name.split("."))}
        for name, _, page in rows:
            if name in public:
                assert _resolve_absolute(name), name
            else:  # a private path autodoc writes for a public object: it must link to that object's page
                assert page.replace("$", name) in public.values(), (name, page)
        # The files are what the table says (run tools/make_inventories.py after editing it).
        assert (OUT / f"{project}.inv").read_bytes() == inventory(project, version, rows), project
