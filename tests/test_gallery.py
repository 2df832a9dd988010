"""The examples gallery: every script of examples/ is on the site's gallery page (sphinx-gallery,
docs/conf.py), which shows them without running them, so each of them is run by a test instead.

``TESTED_BY`` is the registry: each example and the test modules that run it. An example added to
examples/ without an entry here, or an entry whose test no longer imports or names its example,
fails here. The build itself (a gallery page per example, linked from the index) is checked by
tests/test_docs.py.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Each example: the test modules that run it (in-process through its parse_args/run, or as a script),
# by file name (unique under tests/, whichever folder holds it).
TESTED_BY = {
    "codec_demo.py": ["test_gallery.py"],  # below
    "quickstart.py": ["test_quickstart.py"],
    "ray_job.py": ["test_ray.py"],
    "train_charlm.py": ["test_example_flags.py"],
    "train_digits.py": ["test_convergence.py", "test_example_flags.py"],
    "train_flax.py": ["test_flax_example.py"],
    "train_flax_cnn.py": ["test_flax_example.py"],
    "train_sharded.py": ["test_sharded_optimizer.py"],
}


def _examples() -> list[str]:
    # _common.py is the training examples' shared code, not an example (the gallery's ignore_pattern).
    return sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def _uses(tree: ast.Module, example: str) -> bool:
    """Whether a test module imports the example (``import train_digits``) or names its file."""
    stem = example.removesuffix(".py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name == stem for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == stem:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                rf"(?:^|/){re.escape(example)}$", node.value):
            return True
    return False


def test_every_example_has_a_test():
    missing = sorted(set(_examples()) - set(TESTED_BY))
    assert not missing, f"examples without a test (add one, and its entry to TESTED_BY): {missing}"
    gone = sorted(set(TESTED_BY) - set(_examples()))
    assert not gone, f"TESTED_BY names examples that are gone: {gone}"


def test_each_registered_test_runs_its_example():
    for example, modules in TESTED_BY.items():
        for module in modules:
            found = sorted((ROOT / "tests").rglob(module))
            assert len(found) == 1, f"{example}'s test {module}: found {found}"
            tree = ast.parse(found[0].read_text())
            assert any(isinstance(node, ast.FunctionDef) and node.name.startswith("test_") for node in tree.body), module
            assert _uses(tree, example), f"{module} neither imports nor names examples/{example}"


def test_every_example_opens_with_a_gallery_title():
    # sphinx-gallery takes an example's title from the first line of its docstring, underlined with
    # '='; the rest of the docstring is the text of its page (and what `--help` prints).
    for example in _examples():
        doc = ast.get_docstring(ast.parse((EXAMPLES / example).read_text()), clean=False)
        assert doc, example
        lines = doc.split("\n")
        assert (len(lines) > 3 and lines[0].strip() and set(lines[1]) == {"="} and len(lines[1]) >= len(lines[0])
                and lines[2] == ""), (f"examples/{example}'s docstring should open with a title line, a line of '=' "
                                      "at least as long, a blank line")


def test_codec_demo_compresses_and_the_kernel_matches_the_reference():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, str(EXAMPLES / "codec_demo.py"), "--mib", "0.25", "--bits", "4"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    row = re.search(r"^\s+4\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+\S+\s+\S+\s+\S+\s+(\w+)$", run.stdout, re.M)
    assert row, run.stdout
    ratio, max_error, same = float(row.group(2)), float(row.group(3)), row.group(4)
    assert ratio > 7  # 4 bits of 32, less the bucket metadata
    assert max_error <= 0.5 + 1e-3  # nearest rounding: within half a quantization step
    assert same == "True", run.stdout  # the kernel's bytes are the reference's
