"""benchmarks/torch_ddp.py: the PyTorch DDP yardstick inside train_step.py's round robin.

PyTorch is not a jax_cgx dependency and CI does not install it (PyPI's Linux wheel is a multi-GB CUDA
build): the tests that run the yardstick need torch and are skipped without it; the spec checks and
the message for a missing torch run everywhere.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch_ddp  # noqa: E402
import train_step  # noqa: E402


@pytest.mark.parametrize("spec, hook", [("ddp:none", ("none", None)), ("ddp:fp16", ("fp16", None)),
                                        ("ddp:powersgd:3", ("powersgd", 3))])
def test_specs(spec, hook):
    assert torch_ddp.parse_spec(spec) == hook


@pytest.mark.parametrize("spec", ["ddp:", "ddp:fp32", "ddp:powersgd", "ddp:powersgd:0", "ddp:powersgd:x",
                                  "ddp:fp16:2"])
def test_bad_specs_are_refused(spec, capsys):
    with pytest.raises(SystemExit) as err:
        train_step.parse_args(["--compressors", "none", spec])
    assert err.value.code == 2 and spec in capsys.readouterr().err


def test_bf16_hook_is_refused_before_any_process_group(capsys):
    """DDP's bf16_compress_hook needs CUDA and NCCL: refused with the reason, not at registration."""
    with pytest.raises(SystemExit) as err:
        train_step.parse_args(["--compressors", "none", "ddp:bf16"])
    assert err.value.code == 2 and "bf16_compress_hook needs CUDA and NCCL; on the CPU use ddp:fp16" in capsys.readouterr().err


def test_profiling_the_yardstick_is_refused(capsys):
    with pytest.raises(SystemExit) as err:
        train_step.parse_args(["--compressors", "none", "ddp:none", "--profile", "/tmp/x"])
    assert err.value.code == 2 and "--profile traces JAX steps only" in capsys.readouterr().err


def test_missing_torch_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(SystemExit, match="the ddp: compressors need PyTorch.*pip install torch"):
        torch_ddp.import_torch()


@pytest.mark.parametrize("model, parameters", [("mlp", 16_805_898), ("charlm", None)])
def test_the_yardstick_trains_the_same_model(model, parameters):
    """One process: DDP's losses follow the JAX step's (same weights, batches, Adam, schedule) to float
    rounding, for the MLP and for the character transformer written again in PyTorch."""
    pytest.importorskip("torch")
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import train_step, torch_ddp\n"
        f"args = train_step.parse_args(['--model', '{model}', '--steps', '5', '--warmup', '1', "
        "'--compressors', 'none', 'ddp:none', '--batch-per-device', '4'])\n"
        "m = train_step.Model(args)\n"
        "jax_side = train_step.Trainer('none', m, args)\n"
        "torch_side = torch_ddp.DdpTrainer('ddp:none', m, args, train_step.example_args('none', args, 1).lr)\n"
        "for _ in range(5): jax_side.step(); torch_side.step()\n"
        "import jax; n = sum(v.size for v in jax.tree.leaves(jax_side.params))\n"
        "import json; print(json.dumps([jax_side.losses, torch_side.losses, train_step.record(torch_side, 1), n]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jax_losses, torch_losses, record, jax_parameters = json.loads(proc.stdout.splitlines()[-1])
    # Step 0's loss checks the weights, the batch and the loss; step 1's the gradient, Adam and the
    # learning rate. Later steps are not compared: on random labels the loss swings (2.9 -> 15 -> 22)
    # and amplifies the frameworks' different summation orders step after step.
    assert torch_losses[:2] == pytest.approx(jax_losses[:2], rel=1e-4)
    assert record["compressor"] == "ddp:none" and record["parameters"] == jax_parameters
    assert parameters is None or jax_parameters == parameters
    assert record["wire_bytes"] == 0  # one process sends nothing


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_time_the_hooks_beside_jax_cgx(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(ROOT / "benchmarks" / "train_step.py"),
           "--compressors", "none", "ddp:none", "ddp:fp16", "ddp:powersgd:1", "--steps", "12", "--warmup", "1",
           "--batch-per-device", "2", "--no-progress", "--output", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = {r["compressor"]: r for r in json.loads(out.read_text())}
    assert list(records) == ["compute", "none", "ddp:none", "ddp:fp16", "ddp:powersgd:1"]
    none, plain, fp16, powersgd = (records[k] for k in ("none", "ddp:none", "ddp:fp16", "ddp:powersgd:1"))
    assert plain["wire_bytes"] == none["wire_bytes"] and abs(2 * fp16["wire_bytes"] - none["wire_bytes"]) <= 2
    assert powersgd["wire_bytes"] < fp16["wire_bytes"] / 100
    for r in (plain, fp16, powersgd):
        assert r["devices"] == 2 and r["step_ms"] > 0 and r["speedup"] == pytest.approx(none["step_ms"] / r["step_ms"])
        assert r["parameters"] == none["parameters"] and r["platform"].startswith("cpu (torch")
    assert "PyTorch DDP PowerSGD rank 1, one bucket" in proc.stdout
    # The same training (weights, batches, Adam): the losses are the mean over both processes, as JAX's.
    assert plain["final_loss"] == pytest.approx(none["final_loss"], rel=0.01)
