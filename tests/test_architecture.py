"""The package's shape (docs/architecture.md): no import circle, modules and native files of a readable size."""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Modules allowed past the size limit, each with the reason docs/architecture.md gives.
LONG_MODULES: dict[str, str] = {}
MAX_LINES = 450
MAX_NATIVE_LINES = 700  # C++ and CUDA files (xla_ffi/, cuda/)


def test_no_import_cycle(capsys):
    tool = runpy.run_path(str(ROOT / "tools" / "import_cycles.py"))
    assert tool["main"]() == 0, capsys.readouterr().out


def test_module_sizes():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "jax_cgx").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert set(long) <= set(LONG_MODULES), long


def test_native_file_sizes():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("xla_ffi", "cuda")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".cc", ".h", ".cu", ".cuh") and (n := len(p.read_text().splitlines())) > MAX_NATIVE_LINES
    }
    assert not long, long
