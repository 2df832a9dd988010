"""Every repository path the documentation names exists: README.md, CHANGELOG.md, docs/, the
examples', benchmarks' and tools' own text, and the package's docstrings and comments. A file moved or
renamed without its mentions fails here, not in a reader's terminal."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("jax_cgx", "docs", "examples", "benchmarks", "tests", "tools", "xla_ffi", "cuda", ".ci")
SUFFIXES = "py|md|cc|h|cu|cuh|sh|txt|toml|json|png|svg|yaml|yml|cmake|cfg|ini"
# A path: one of the top folders, then names, ending in a file with a known suffix.
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./-]*?\.(?:{SUFFIXES}))(?![\w/-])")
WRITTEN = re.compile(r"--(?:output|plot|json|out)[\s=]+$")
GENERATED = ("docs/_build/", "docs/_generated/", "build/", "dist/")
SOURCES = ["README.md", "CHANGELOG.md", "CMakeLists.txt", "pyproject.toml", ".ci/run", "docs/**/*.md", "docs/conf.py",
           "jax_cgx/**/*.py", "examples/**/*.py", "benchmarks/**/*.py", "tools/**/*", "xla_ffi/**/*", "cuda/**/*"]


def _mentions() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for pattern in SOURCES:
        for source in ROOT.glob(pattern):
            if not source.is_file() or any(str(source.relative_to(ROOT)).startswith(g) for g in GENERATED):
                continue
            try:
                text = source.read_text()
            except UnicodeDecodeError:
                continue
            for match in PATH.finditer(text):
                if WRITTEN.search(text[max(0, match.start() - 12):match.start()]):
                    continue  # a file the command writes
                path = match.group(1).rstrip(".")
                if not any(path.startswith(g) for g in GENERATED):
                    found.setdefault(path, set()).add(str(source.relative_to(ROOT)))
    return found


def test_paths_were_found():
    assert len(_mentions()) > 100  # the pattern still matches how the docs write paths


def test_every_path_named_exists():
    missing = {path: sorted(where) for path, where in _mentions().items() if not (ROOT / path).exists()}
    assert not missing, "\n".join(f"{path}: named in {', '.join(where)}" for path, where in sorted(missing.items()))
