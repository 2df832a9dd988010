"""What the package says of itself: the jax it needs (one floor, refused below it) and its version."""

import pathlib
import re

import jax
import pytest

import jax_cgx
from jax_cgx._src import compat

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_jax_floor_is_the_one_pyproject_claims():
    floors = {m.groups() for d in PROJECT["dependencies"] if (m := re.match(r"(jax|jaxlib)>=(\S+)$", d))}
    floor = ".".join(map(str, compat.MIN_JAX))
    assert floors == {("jax", floor), ("jaxlib", floor)}
    assert compat._release(jax.__version__) >= compat.MIN_JAX


def test_release_numbers():
    assert compat._release("0.10.2") == (0, 10, 2)
    assert compat._release("0.10.3rc1") == (0, 10, 3)
    assert compat._release("0.11.2.dev20261101") == (0, 11, 2)
    assert compat._release("0.7.2") < compat.MIN_JAX < compat._release("1.0")


def test_the_version_has_one_home_and_a_changelog_entry():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", jax_cgx.__version__)
    assert f"## {jax_cgx.__version__}" in (ROOT / "CHANGELOG.md").read_text()
