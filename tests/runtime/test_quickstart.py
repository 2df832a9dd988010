"""examples/quickstart.py, the README's main demo: it runs, and on simulated devices it says what
their step times mean and prints the cost model's prediction for real links."""

import os
import re
import subprocess
import sys
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_tells_what_simulated_devices_measure():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # its own 8 devices
    out = subprocess.run([sys.executable, str(QUICKSTART), "--steps", "3", "--width", "256"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "pmean: step" in text and "compressed_pmean (4 bits): step" in text
    assert "simulated in one process: no byte crosses a network" in text
    rows = re.findall(r"^\s+(\d+) Gbit/s\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+)x$", text, re.M)
    assert [r[0] for r in rows] == ["1", "10", "100"], text
    speedups = [float(r[3]) for r in rows]
    assert speedups == sorted(speedups, reverse=True)  # compression pays most on the slowest link
    assert "benchmarks/netem/run.py" in text  # how to measure it for real
    assert "expected at 4 bits" in text  # what the printed error means
    assert "Next, in your own training step" in text and "data_parallel_value_and_grad" in text


def test_under_the_launcher_it_says_the_same_next_step():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(QUICKSTART), "--steps", "2",
                          "--width", "64"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=QUICKSTART.parent)  # not the checkout: `-m` puts the cwd on sys.path
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "(2 process(es))" in text and "expected at 4 bits" in text
    assert text.count("Next, in your own training step") == 1, text  # once: process 0 reports
    assert "Measured, not predicted" in text
