"""README.md's code runs as written: every ```python block of the DOCUMENTS (README.md, the user
guide and the checkpointing page) in a fresh Python process (8 virtual CPU devices, an empty
working directory, no jax_cgx or torch_cgx variables set), and the user guide's mpirun line.

A block that cannot run here (several processes, a GPU) carries ``<!-- not run: why -->`` on the
line before its fence; it is reported as skipped with that reason (``pytest -rs``).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
DOCUMENTS = [README, GUIDE, ROOT / "docs" / "getting-started.md", ROOT / "docs" / "checkpointing.md"]  # Markdown files whose python blocks must run as written
PYTHON = {"python", "py", "python3"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[^\s`]*)")


class Block(NamedTuple):
    path: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason given by a `<!-- not run: ... -->` line just before the fence


def code_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with the line of its opening fence."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(opening["fence"]) and not lines[j].strip().strip("`~")), None)
        if end is None:
            raise AssertionError(f"{path.name} line {i + 1}: the code fence is never closed")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.fullmatch(before)
        indent = len(opening["indent"])
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        blocks.append(Block(path, i + 1, opening["lang"], code, marker["why"] if marker else None))
        i = end + 1
    return blocks


def _python_blocks():
    params = []
    for block in (b for path in DOCUMENTS for b in code_blocks(path)):
        if block.lang not in PYTHON:
            continue
        marks = [pytest.mark.skip(reason=f"{block.path.name} line {block.line}: not run: {block.not_run}")] \
            if block.not_run is not None else []
        params.append(pytest.param(block, id=f"{block.path.name}:{block.line}", marks=marks))
    return params


def _clean_env(**extra) -> dict:
    """The environment of a user who set nothing: no jax_cgx or torch_cgx variables (they change
    what ``config=None`` means, and the backend), jax on the CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_CGX_", "CGX_")) and k != "XLA_FLAGS"}
    env.update(extra)
    return env


@pytest.mark.parametrize("block", _python_blocks())
def test_readme_python_block_runs(block, tmp_path):
    # Blank lines before the code put each line at its own line number in the Markdown file, so a
    # traceback's line numbers are README.md's.
    script = tmp_path / f"{block.path.stem}_line_{block.line}.py"
    script.write_text("\n" * block.line + block.code)
    env = _clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert run.returncode == 0, (
        f"{block.path.name} line {block.line}: the ```{block.lang} block exited with status {run.returncode} "
        f"(line numbers below are {block.path.name}'s)\n{run.stderr[-4000:]}")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_not_run_markers_stand_before_python_blocks(path):
    # A `not run` marker left behind when its block moved would silently stop nothing, or (moved
    # onto another block) silently skip one: each must sit right before a python block.
    text = path.read_text().splitlines()
    blocks = code_blocks(path)
    marked = {b.line for b in blocks if b.not_run is not None and b.lang in PYTHON}
    for number, line in enumerate(text, 1):
        if NOT_RUN.search(line):
            following = next((n for n in range(number + 1, len(text) + 1) if text[n - 1].strip()), None)
            assert following in marked, f"{path.name} line {number}: `{line.strip()}` is not right before a ```python block"
    assert any(b.lang in PYTHON and b.not_run is None for b in blocks), f"no python block of {path.name} runs"


def test_code_blocks_lines_and_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n```python\nprint(1)\n```\n\n<!-- not run: needs 2 processes -->\n\n"
                   "```python\nprint(2)\n```\n- item\n  ```bash\n  ls\n  ```\n")
    assert code_blocks(doc) == [Block(doc, 3, "python", "print(1)\n", None),
                                Block(doc, 9, "python", "print(2)\n", "needs 2 processes"),
                                Block(doc, 13, "bash", "ls\n", None)]
    doc.write_text("```python\nprint(1)\n")
    with pytest.raises(AssertionError, match="doc.md line 1: the code fence is never closed"):
        code_blocks(doc)


def _guide_mpirun_lines() -> list[str]:
    return [line.split("#")[0].strip() for b in code_blocks(GUIDE) if b.lang in {"bash", "sh", "shell"}
            for line in b.code.splitlines() if line.lstrip().startswith("mpirun ")]


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (Debian: openmpi-bin)")
def test_readme_mpirun_line_runs():
    # Open MPI refuses to start as root without --allow-run-as-root, and more processes than cores
    # without --oversubscribe; the guide gives a line for that case too. Run the one that applies here.
    lines = _guide_mpirun_lines()
    plain = [c for c in lines if "--allow-run-as-root" not in c and "--oversubscribe" not in c]
    for_root = [c for c in lines if "--allow-run-as-root" in c and "--oversubscribe" in c]
    assert plain and for_root, f"docs/guide.md's mpirun lines: {lines}"
    as_written = plain[0] if os.geteuid() != 0 and (os.cpu_count() or 1) >= 2 else for_root[0]
    command = as_written.split() + ["--steps", "2", "--width", "256"]  # the demo, smaller
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=_clean_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    assert run.returncode == 0, f"docs/guide.md's `{as_written}` failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert "compressed_pmean (4 bits): step" in run.stdout, run.stdout[-3000:]
