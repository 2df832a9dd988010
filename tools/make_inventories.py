"""Writes docs/_inventories/*.inv: the offline fallback of the site's intersphinx links.

    python tools/make_inventories.py

docs/conf.py links Python's, NumPy's, JAX's and optax's documentation through their own
``objects.inv`` (fetched when the build is online). Where it is not (CI reaches only PyPI and
Debian), Sphinx falls back to these files: Sphinx inventories (version 2) holding just the names
jax_cgx's reference links to, with their pages on those sites, so that ``sphinx -n -W`` resolves every
reference either way. ``tests/test_docs.py`` checks that each name here still imports. Add a row when
a docstring or a type hint names another external object.
"""

from __future__ import annotations

import pathlib
import zlib

OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "_inventories"

# project -> (its documentation's version, [(name, domain:role, page$ (``$``: the name), shown as)])
ENTRIES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "python": ("3", [
        ("collections.abc.Callable", "py:class", "library/collections.abc.html#$"),
        ("collections.abc.Sequence", "py:class", "library/collections.abc.html#$"),
        ("collections.abc.Mapping", "py:class", "library/collections.abc.html#$"),
        ("atexit", "py:module", "library/atexit.html#module-$"),
        ("logging", "py:module", "library/logging.html#module-$"),
        ("pathlib.Path", "py:class", "library/pathlib.html#$"),
    ]),
    "numpy": ("2", [
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#$"),
        ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html#$"),
    ]),
    "jax": ("0.10", [
        ("jax.Array", "py:class", "_autosummary/jax.Array.html#$"),
        # What autodoc writes for a `jax.Array` type hint (its defining module).
        ("jax.jaxlib._jax.Array", "py:class", "_autosummary/jax.Array.html#jax.Array"),
        ("jax.errors.JaxRuntimeError", "py:class", "jax.errors.html#$"),
        ("jax.shard_map", "py:function", "_autosummary/jax.shard_map.html#$"),
        ("jax.sharding.PartitionSpec", "py:class", "jax.sharding.html#$"),
        ("jax.lax.psum", "py:function", "_autosummary/jax.lax.psum.html#$"),
        ("jax.lax.pmean", "py:function", "_autosummary/jax.lax.pmean.html#$"),
        ("jax.distributed.initialize", "py:function", "_autosummary/jax.distributed.initialize.html#$"),
    ]),
    "optax": ("0.2", [
        ("optax.GradientTransformation", "py:class", "api/transformations.html#$"),
        ("optax._src.base.GradientTransformation", "py:class",
         "api/transformations.html#optax.GradientTransformation"),
    ]),
}


def inventory(project: str, version: str, rows: list[tuple[str, str, str]]) -> bytes:
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    body = "".join(f"{name} {role} 1 {page} -\n" for name, role, page in rows).encode()
    return header + zlib.compress(body)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for project, (version, rows) in ENTRIES.items():
        (OUT / f"{project}.inv").write_bytes(inventory(project, version, rows))
        print(f"{OUT / project}.inv: {len(rows)} names")


if __name__ == "__main__":
    main()
