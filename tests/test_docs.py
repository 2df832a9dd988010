"""The documentation site (docs/conf.py): it builds with warnings as errors, and every example in
it runs (Sphinx's doctest builder, on 8 simulated CPU devices): the commands the README gives.

A broken cross-reference, a page left out of every table of contents or a docstring that docutils
cannot parse is a warning, so drift fails here. Each API page opens with a table of its module's
public names (autosummary), each a link to its entry on the same page: a name added to ``__all__``
and not to its table, or listed and not documented, fails here too.
"""

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("sphinx_gallery", reason="the docs extra: pip install -e '.[docs]'")

# Public names documented on another page than their module's, so not in its table.
ELSEWHERE = {"jax_cgx.tcp.CommunicatorInfo": "jax_cgx.nccl.CommunicatorInfo, the same class"}


def _sphinx(builder: str, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_CGX_", "CGX_")) and k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", builder,
                           str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)


def _summary_table(page: Path) -> tuple[str, list[str]]:
    """The module of an API page and the names of the autosummary table it opens with (after its title)."""
    opening = re.match(r"\S+\n=+\n\n\.\. currentmodule:: (\S+)\n\n\.\. autosummary::\n\n((?:   \S+\n)+)",
                       page.read_text())
    assert opening, f"docs/api/{page.name} does not open with '.. currentmodule::' and '.. autosummary::'"
    return opening.group(1), opening.group(2).split()


def test_each_api_page_opens_with_a_table_of_its_public_names():
    pages = sorted((ROOT / "docs" / "api").glob("*.rst"))
    assert len(pages) >= 9
    for page in pages:
        module_name, names = _summary_table(page)
        module = importlib.import_module(module_name)
        public = [name for name in module.__all__ if not inspect.ismodule(getattr(module, name))
                  and f"{module_name}.{name}" not in ELSEWHERE]
        # In __all__'s order, which is the page's (autodoc_member_order = "bysource").
        assert names == public, f"docs/api/{page.name}'s table should list {public}"


def _links_of_summary(html: str) -> list[str]:
    """The target of each row of the page's first autosummary table (its name's link)."""
    table = re.search(r'<table class="autosummary[^"]*">(.*?)</table>', html, re.S)
    assert table, "no autosummary table"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)
    return [re.search(r'href="([^"]*)"', row).group(1) for row in rows]


@pytest.mark.slow
def test_the_site_builds_without_a_warning(tmp_path):
    run = _sphinx("html", tmp_path / "html")
    assert run.returncode == 0, run.stderr[-6000:]
    pages = {p.relative_to(tmp_path / "html").as_posix() for p in (tmp_path / "html").rglob("*.html")}
    for page in ("index.html", "getting-started.html", "choosing-settings.html", "guide.html", "api/jax_cgx.html",
                 "api/optax.html", "api/adaptive.html", "api/tcp.html", "api/nccl.html", "api/distributed.html",
                 "api/launch.html"):
        assert page in pages, sorted(pages)
    # Every public name of the listed modules has its entry in the reference.
    import jax_cgx

    reference = (tmp_path / "html" / "api" / "jax_cgx.html").read_text()
    for name in jax_cgx.__all__:
        if name not in ("adaptive", "allocator", "cost_model", "distributed", "nccl", "optax", "tcp"):
            assert f'id="jax_cgx.{name}"' in reference, name
    # Each API page opens with its table (before the first entry), every row a link to an entry on the page.
    for page in sorted((ROOT / "docs" / "api").glob("*.rst")):
        module_name, names = _summary_table(page)
        html = (tmp_path / "html" / "api" / f"{page.stem}.html").read_text()
        assert html.index('<table class="autosummary') < html.index('<dl class="py'), page.name
        links = _links_of_summary(html)
        assert links == [f"#{module_name}.{name}" for name in names], (page.name, links)
        for link in links:
            assert f'id="{link[1:]}"' in html, (page.name, link)
    # The examples gallery (sphinx-gallery, docs/conf.py) has a page for every example, linked from its
    # index, which the site's index links. tests/test_gallery.py: each of them is run by a test.
    gallery = (tmp_path / "html" / "auto_examples" / "index.html").read_text()
    assert 'href="auto_examples/index.html"' in (tmp_path / "html" / "index.html").read_text()
    for example in sorted((ROOT / "examples").glob("*.py")):
        if not example.name.startswith("_"):  # _common.py: the training examples' shared code
            assert f"auto_examples/{example.stem}.html" in pages, example.name
            assert f'href="{example.stem}.html"' in gallery, example.name


@pytest.mark.slow
def test_every_example_in_the_site_runs(tmp_path):
    run = _sphinx("doctest", tmp_path / "doctest")
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    report = (tmp_path / "doctest" / "output.txt").read_text()
    assert " 0 failures in tests" in report, report[-3000:]
    # At least one example per public module, and each of them ran and passed.
    passed = dict(re.findall(r"^Document: (\S+)\n-+\n(?:.*\n)*?(\d+) passed and 0 failed", report, re.M))
    for module in ("jax_cgx", "optax", "adaptive", "tcp", "nccl", "distributed", "cost_model"):
        assert int(passed.get(f"api/{module}", 0)) >= 1, (module, passed)
