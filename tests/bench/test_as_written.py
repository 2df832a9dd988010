"""benchmarks/as_written.py: a README-written script in both import orders beside the harness, on 2 CPU
processes under jax_cgx.launch (the figures come from benchmarks/netem/run.py: docs/performance.md)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compare_runs_the_harness_and_both_orders(tmp_path):
    out = tmp_path / "as_written.json"
    cmd = [sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(ROOT / "benchmarks" / "as_written.py"), "--compare",
           "--what", "allreduce", "--mib", "1", "--rounds", "1", "--calls", "3", "--output", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == ["harness", "jax-first", "jax-cgx-first"]
    assert rows[0]["of_harness"] == 1.0
    for r in rows:
        assert r["what"] == "allreduce" and len(r["runs_ms"]) == 1 and r["median_ms"] > 0
        assert r["of_harness"] == pytest.approx(r["median_ms"] / rows[0]["median_ms"])
    assert "jax-first" in proc.stdout and "the harness's" in proc.stdout


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "as_written.py"), "--calls", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--calls must be at least 3" in proc.stderr, proc.stderr
