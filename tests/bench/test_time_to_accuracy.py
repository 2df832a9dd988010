"""benchmarks/time_to_accuracy.py: every compressor trained to a target side by side, on 2 CPU processes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "time_to_accuracy.py"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_reach_a_low_target(tmp_path):
    out, png = tmp_path / "tta.json", tmp_path / "tta.png"
    cmd = [sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(SCRIPT), "--compressors", "none", "maxmin:4",
           "maxmin:2+ef", "--target", "30", "--max-steps", "6", "--eval-every", "2", "--batch-per-device", "8",
           "--optimizer", "sgd", "--bucket-size", "128", "--stochastic",
           "--no-progress", "--output", str(out), "--plot", str(png)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert [r["compressor"] for r in records] == ["none", "maxmin:4", "maxmin:2+ef"]
    assert records[1]["description"] == "maxmin 4-bit, bucket 128, stochastic"
    assert png.stat().st_size > 0
    for r in records:
        assert r["devices"] == 2 and r["target"] == 30
        assert r["steps_to_target"] is not None and r["steps_to_target"] % 2 == 0  # evaluated every 2 steps
        reached = next(e for e in r["evaluations"] if e["step"] == r["steps_to_target"])
        assert reached["accuracy"] >= 30 and reached["seconds"] == r["seconds_to_target"] > 0
        # a trainer stops at its target: no evaluation after it
        assert r["evaluations"][-1]["step"] == r["steps_to_target"]
        assert all(e["accuracy"] < 30 for e in r["evaluations"][:-1])
    none = records[0]
    assert none["speedup"] == 1.0
    assert all(r["speedup"] == pytest.approx(none["seconds_to_target"] / r["seconds_to_target"]) for r in records)


@pytest.mark.parametrize("argv, message", [
    (["--compressors", "topk"], "'topk' is not none, maxmin:BITS[+ef|+backward][+auto][+tcp], cast, powersgd:RANK or topk:RATIO"),
    (["--compressors", "powersgd:2+ef"], "'powersgd:2+ef' is not"),
    (["--compressors", "maxmin:x"], "'maxmin:x' is not"),
    (["--compressors", "maxmin:4+ef+ef"], "'maxmin:4+ef+ef' is not"),
    (["--compressors", "maxmin:4+fast"], "'maxmin:4+fast' is not"),
    (["--compressors", "maxmin:4+ef+backward"], "'maxmin:4+ef+backward' is not"),
    (["--target", "101"], "--target must be a percentage"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--lr", "0"], "--lr must be positive"),
])
def test_bad_arguments_are_refused(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_compressor_specs_become_example_flags(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import time_to_accuracy

    assert time_to_accuracy.example_argv("maxmin:2+ef+auto") == [
        "--compressor", "maxmin", "--bits", "2", "--error-feedback", "--policy", "auto"]
    assert time_to_accuracy.example_argv("maxmin:4") == ["--compressor", "maxmin", "--bits", "4"]
    assert time_to_accuracy.example_argv("maxmin:4+backward") == [
        "--compressor", "maxmin", "--bits", "4", "--reduce-in-backward"]
    assert time_to_accuracy.example_argv("powersgd:2") == ["--compressor", "powersgd", "--rank", "2"]
