"""benchmarks/time_to_loss.py: uniform and adaptive widths side by side on the word transformer."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "time_to_loss.py"


@pytest.mark.slow
def test_specs_train_side_by_side_and_reach_the_target(tmp_path):
    # A 65-word vocabulary and 4 steps (the adaptive spec 6, on its own schedule) on 2 simulated devices:
    # the loop, the planner's compiled steps and the records, not the figures.
    out = tmp_path / "ttl.json"
    cmd = [sys.executable, str(SCRIPT), "--specs", "none", "adaptive:4@6", "--objective", "adam", "--words", "64", "--steps", "4",
           "--eval-every", "2", "--batch", "4", "--replan-every", "2", "--bucket-sizes", "64", "512", "--devices", "2",
           "--no-progress", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert [r["spec"] for r in records] == ["none", "adaptive:4@6"]
    none, adaptive = records
    assert none["target"] == none["final_val_loss"] and none["vs_none"] == 0 and none["speedup"] == 1.0
    hit = next(e for e in none["evaluations"] if e["val_loss"] <= none["target"])  # the first evaluation there
    assert (none["steps_to_target"], none["seconds_to_target"]) == (hit["step"], hit["seconds"]) and hit["seconds"] > 0
    assert [e["step"] for e in none["evaluations"]] == [2, 4] and none["steps"] == 4
    assert [e["step"] for e in adaptive["evaluations"]] == [2, 4, 6] and adaptive["steps"] == 6
    assert all(r["devices"] == 2 for r in records)
    assert none["plan_changes"] is None and adaptive["compiled_steps"] == adaptive["plan_changes"] + 1
    assert adaptive["wire_bytes"] < none["wire_bytes"]
    assert "buckets of 64/512" in adaptive["description"] and adaptive["description"].endswith(", 6 steps")


@pytest.mark.parametrize("argv, message", [
    (["--specs", "maxmin:x"], "'maxmin:x' is not none, maxmin:BITS, adaptive:BUDGET or widths:BUDGET"),
    (["--specs", "topk:4"], "'topk:4' is not"),
    (["--specs", "maxmin:4"], "give --target, or include the spec none"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--specs", "none", "maxmin:4@0"], "'maxmin:4@0': @STEPS must be a positive number of steps, got '0'"),
    (["--specs", "none", "maxmin:4@"], "@STEPS must be a positive number of steps, got ''"),
    (["--specs", "none", "none"], "--specs: each spec once"),
    (["--specs", "none@500"], "'none@500': none is the baseline, trained for --steps"),
])
def test_bad_arguments_are_refused(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
