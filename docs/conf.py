"""Sphinx configuration of jax_cgx's documentation site.

    pip install -e ".[docs]"
    python -m sphinx -W -b html docs docs/_build/html      # the site, warnings as errors
    python -m sphinx -W -b doctest docs docs/_build/doctest  # every ``Examples:`` section, run

The Markdown pages of docs/ are pages of the site (myst-parser); the API reference is autodoc over
the public modules (docs/api/). Doctests run on 8 simulated CPU devices (set below, before JAX
is imported).
"""

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

# Before anything imports jax: the doctests' examples shard over 8 simulated CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = Path(__file__).resolve().parent

project = "jax_cgx"
# The version's one home is jax_cgx/__init__.py; read, not imported (conf.py runs before autodoc's imports).
release = version = re.search(r'^__version__ = "([^"]+)"', (HERE.parent / "jax_cgx" / "__init__.py").read_text(),
                              re.M).group(1)
author = "the jax_cgx developers"
copyright = "2026, the jax_cgx developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",  # the table each API page opens with
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",  # [source] links
    "sphinx_gallery.gen_gallery",  # examples/*.py as a gallery page
]
# Every cross-reference must resolve: -W makes a dead one an error.
nitpicky = True
# Other projects' documentation: their objects.inv when online, else docs/_inventories/ (the names
# jax_cgx links to, written by tools/make_inventories.py), so the build is the same offline (CI).
intersphinx_mapping = {
    name: (url, (None, str(HERE / "_inventories" / f"{name}.inv")))
    for name, url in {"python": "https://docs.python.org/3", "numpy": "https://numpy.org/doc/stable",
                      "jax": "https://docs.jax.dev/en/latest", "optax": "https://optax.readthedocs.io/en/latest"}.items()
}
intersphinx_timeout = 5
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.txt"]

# Markdown: `#heading` anchors for links between pages, $math$, ::: fences.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath", "colon_fence"]

# The API reference: members in source order, type hints in the parameter descriptions.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
# Each API page opens with an autosummary table of its module's public names, each row a link to its
# entry further down the same page (no stub pages: autodoc documents the names where they are).
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Doctests: what every example may use without importing it.
doctest_global_setup = """
import jax
import jax.numpy as jnp
import numpy as np
import jax_cgx
"""

# The examples gallery: examples/*.py (their docstring, then their code) written to docs/auto_examples/
# (generated, git-ignored) and linked from the index. Never run here: they train models, start
# processes and ask for many devices; tests/ run each of them (tests/test_gallery.py checks that
# every example has its test).
sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    "plot_gallery": False,
    "filename_pattern": r"^$",  # executes nothing, even with -D plot_gallery=1
    "ignore_pattern": r"^_",  # (the file name) _common.py: the training examples' shared code, not an example
    "image_scrapers": (),
    "reset_modules": (),
    "notebook_extensions": set(),  # no notebooks: the examples are scripts with a command line
    "download_all_examples": False,
    "write_computation_times": False,  # nothing runs, nothing to time (and no sg_execution_times page)
    "within_subsection_order": "FileNameSortKey",
}

html_theme = "furo"
html_title = "jax_cgx"

# The launcher's command line, as `--help` prints it (docs/api/launch.md includes it).
_generated = HERE / "_generated"
_generated.mkdir(exist_ok=True)
_help = subprocess.run([sys.executable, "-m", "jax_cgx.launch", "--help"], capture_output=True, text=True,
                       check=True, env={**os.environ, "COLUMNS": "100"})
(_generated / "launch_help.txt").write_text(_help.stdout)


# A constant has no docstring of its own (autodoc would summarize ``(2, 3, 4)`` with tuple's): its
# summary in the table is the first sentence of its ``.. py:data::`` entry on its API page.
def _data_descriptions() -> dict[str, list[str]]:
    found = {}
    for page in sorted((HERE / "api").glob("*.rst")):
        module = None
        for block in re.split(r"\n(?=\S)", page.read_text()):
            if m := re.match(r"\.\. (?:auto|current)module:: (\S+)", block):
                module = m.group(1)
            elif (m := re.match(r"\.\. py:data:: (\S+)\n((?:   :.*\n)*)\n((?:   .*\n?|\n)+)", block)) and module:
                found[f"{module}.{m.group(1)}"] = [line[3:] for line in m.group(3).rstrip().splitlines()]
    return found


def _summarize_constants(app, what, name, obj, options, lines):
    if what == "data" and name in _DATA and getattr(obj, "__doc__", None) == getattr(type(obj), "__doc__", None):
        lines[:] = _DATA[name]


_DATA = _data_descriptions()


# Builds of this checkout at the same time (tests/test_docs.py's html and doctest builds, on two pytest
# workers) write the same docs/auto_examples/: sphinx-gallery's step (builder-inited, priority 500) takes
# turns under a lock, the rest of the builds runs side by side.
def _lock_gallery(app):
    (HERE / "auto_examples").mkdir(exist_ok=True)
    app._gallery_lock = open(HERE / "auto_examples" / ".lock", "w")
    fcntl.flock(app._gallery_lock, fcntl.LOCK_EX)


def _unlock_gallery(app):
    app._gallery_lock.close()  # releases the lock


def setup(app):
    app.connect("autodoc-process-docstring", _summarize_constants)
    app.connect("builder-inited", _lock_gallery, priority=400)
    app.connect("builder-inited", _unlock_gallery, priority=600)
