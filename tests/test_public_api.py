"""What a user sees: the public names resolve, dir() shows only them, internals stay under
jax_cgx._src, and the examples and benchmarks (what users copy) use the public API."""

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


def test_packaging_metadata_files():
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]  # what pyproject.toml declares
    assert (ROOT / "jax_cgx" / "py.typed").exists()  # PEP 561: the package ships its type hints
