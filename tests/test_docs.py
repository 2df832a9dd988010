"""The documentation site (docs/conf.py): it builds with warnings as errors, and every example in
it runs (Sphinx's doctest builder, on 8 simulated CPU devices): the commands the README gives.

A broken cross-reference, a page left out of every table of contents or a docstring that docutils
cannot parse is a warning, so drift fails here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs extra: pip install -e '.[docs]'")


def _sphinx(builder: str, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_CGX_", "CGX_")) and k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", builder,
                           str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)


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
