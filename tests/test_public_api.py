"""What a user sees: the public names resolve, dir() shows only them, internals stay under
jax_cgx._src, the examples and benchmarks (what users copy) use the public API, and every public
function and class documents its arguments and what it returns."""

import importlib
import inspect
import pathlib
import re

import jax_cgx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Internals the examples may still use, each with its reason.
EXAMPLE_INTERNALS = {
    ("examples/_common.py", "jax_cgx._src.compat"): "JAX's varying-axes type, whose attribute moved between jax "
                                                    "versions (state specs would make it unneeded)",
}


def test_every_public_name_resolves_and_dir_shows_only_them():
    for name in jax_cgx.__all__:
        assert getattr(jax_cgx, name) is not None, name
    assert dir(jax_cgx) == sorted(jax_cgx.__all__)
    for module in (jax_cgx.optax, jax_cgx.nccl, jax_cgx.tcp, jax_cgx.cost_model, jax_cgx.adaptive):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_examples_and_benchmarks_use_the_public_api():
    found = {}
    for path in sorted([*(ROOT / "examples").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        rel = str(path.relative_to(ROOT))
        for match in re.finditer(r"^\s*(?:from|import) (jax_cgx\._src[\w.]*)", path.read_text(), re.M):
            found[(rel, match.group(1))] = None
    unexpected = sorted(set(found) - set(EXAMPLE_INTERNALS))
    assert not unexpected, f"examples or benchmarks import internals (use jax_cgx's public API): {unexpected}"


# The public modules whose functions and classes the reference documents (a module without __all__:
# its names without a leading underscore).
PUBLIC_MODULES = ("jax_cgx", "jax_cgx.optax", "jax_cgx.adaptive", "jax_cgx.cost_model", "jax_cgx.distributed",
                  "jax_cgx.launch", "jax_cgx.testing", "jax_cgx.allocator", "jax_cgx.nccl", "jax_cgx.tcp",
                  "jax_cgx.bench")
# Classes users build themselves: an Args: section names each constructor argument. Other public
# classes (what a function returns: states, reports, records) may document their fields as
# Attributes: or with #: comments instead; exceptions need neither.
USER_BUILT = {"CompressionConfig", "CodecRates", "LinkModel", "LeafPlan", "Planner", "ShardedOptimizer", "Communicators",
              "ProcessGroup", "Job"}


def _public_objects():
    """``(qualified name, object)`` of every public function and class, each once."""
    seen = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and id(obj) not in seen:
                seen.add(id(obj))
                yield f"{module_name}.{name}", obj


def _section(doc: str, title: str) -> list[str] | None:
    """The names a Google-style section (``Args:``, ``Attributes:``) documents; None without it."""
    lines = doc.splitlines()
    if f"{title}:" not in lines:
        return None
    names, indent = [], None
    for line in lines[lines.index(f"{title}:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section or paragraph
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth == indent and (match := re.match(r"\s*\*{0,2}(\w+)\s*(\(.*\))?:", line)):
            names.append(match.group(1))
    return names


def _field_comments(cls) -> set[str]:
    """The fields of a NamedTuple or dataclass documented by a ``#:`` comment above them (autodoc shows those)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return set()
    return {m.group(1) for above, line in zip(lines, lines[1:])
            if above.strip().startswith("#:") and (m := re.match(r"\s+(\w+)\s*:", line))}


def test_public_functions_and_classes_document_their_arguments_and_results():
    """Every parameter under ``Args:`` and a ``Returns:`` section (``None.`` for a function that
    returns nothing), as Sphinx's napoleon renders them; a class users build names each constructor
    argument under ``Args:``, any other class documents each under ``Args:``, ``Attributes:`` or a
    ``#:`` comment."""
    problems = []
    objects = list(_public_objects())
    assert USER_BUILT <= {obj.__name__ for _, obj in objects if inspect.isclass(obj)}, "USER_BUILT names a non-class"
    for name, obj in objects:
        if not obj.__module__.startswith("jax_cgx"):
            problems.append(f"{name}: {obj.__module__}'s, exported by accident (name it with a leading underscore)")
            continue
        doc = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        params = [p.name for p in inspect.signature(obj).parameters.values() if p.name not in ("self", "cls")]
        args = _section(doc, "Args") or []
        if inspect.isfunction(obj):
            if missing := [p for p in params if p not in args]:
                problems.append(f"{name}: Args: lacks {missing}")
            if not re.search(r"^Returns:$", doc, re.M):
                problems.append(f"{name}: no Returns: section")
        elif obj.__name__ in USER_BUILT:
            if missing := [p for p in params if p not in args]:
                problems.append(f"{name}: Args: lacks the constructor arguments {missing}")
        else:
            documented = {*args, *(_section(doc, "Attributes") or []), *_field_comments(obj)}
            if missing := [p for p in params if p not in documented]:
                problems.append(f"{name}: {missing} documented under neither Args:, Attributes: nor #: comments")
    assert not problems, "\n".join(problems)


def test_packaging_metadata_files():
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]  # what pyproject.toml declares
    assert (ROOT / "jax_cgx" / "py.typed").exists()  # PEP 561: the package ships its type hints
