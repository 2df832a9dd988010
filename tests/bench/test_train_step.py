"""benchmarks/train_step.py: the training-step benchmark, on 2 CPU processes under jax_cgx.launch."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_time_every_compressor(tmp_path):
    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(ROOT / "benchmarks" / "train_step.py"),
           "--model", "charlm", "--compressors", "none", "maxmin:4", "powersgd:1", "onecall:4", "--steps", "4", "--warmup", "1",
           "--d-model", "32", "--batch-per-device", "2", "--context", "16", "--link-gbps", "1", "--no-progress",
           "--output", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert [r["compressor"] for r in records] == ["compute", "none", "maxmin:4", "powersgd:1", "onecall:4"]
    compute, none, maxmin, powersgd, onecall = records
    assert compute["devices"] == 1 and compute["wire_bytes"] == 0 and compute["speedup"] is None
    for r in records:
        assert r["platform"] == "cpu" and r["steps"] == 4 and r["step_ms"] > 0 and r["spread"] >= 1
        assert r["final_loss"] > 0 and r["parameters"] == records[0]["parameters"]
        assert len(r["steps_ms"]) == 4 and max(r["steps_ms"][1:]) == pytest.approx(r["step_ms_max"], abs=1e-3)
        # the ideal: compute + bytes sent / 1 Gbit/s
        assert r["ideal_ms"] == pytest.approx(compute["step_ms"] + r["wire_bytes"] * 8e-9 * 1e3)
    assert {r["devices"] for r in records[1:]} == {2}
    assert none["speedup"] == 1.0 and maxmin["speedup"] == pytest.approx(none["step_ms"] / maxmin["step_ms"])
    assert maxmin["wire_bytes"] < none["wire_bytes"] and powersgd["wire_bytes"] < none["wire_bytes"]
    # The README's one-call step, timed beside the others.
    assert onecall["description"] == "data_parallel_value_and_grad 4-bit, in backward"
    assert onecall["wire_bytes"] < none["wire_bytes"]
    assert "training step, char transformer" in proc.stdout


def test_bad_compressor_spec_is_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--compressors", "topk:3",
                           "--steps", "4"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "is not none, maxmin:BITS[+auto][+backward][+tcp], cast or powersgd:RANK" in proc.stderr


def test_bad_arguments_are_refused():
    for argv, message in ((["--compressors", "onecall:4+tcp"], "'onecall:4+tcp' is not onecall:BITS[+after]"),
                          (["--compressors", "onecall:4+hier+hier"], "is not onecall:BITS[+after][+hier][+ring][+auto]"),
                          (["--per-node", "0"], "--per-node must be at least 1"),
                          (["--steps", "3", "--warmup", "3"], "--steps 3 must exceed --warmup 3"),
                          (["--batch-per-device", "0"], "--batch-per-device must be at least 1"),
                          (["--link-gbps", "0"], "--link-gbps must be positive")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), *argv],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
