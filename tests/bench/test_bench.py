"""python -m jax_cgx.bench allreduce: size parsing, the sweep, and the table's arithmetic."""

import argparse
import json

import pytest

from jax_cgx.bench import allreduce
from jax_cgx.bench.__main__ import main


def test_parse_bytes_and_sweep():
    assert allreduce.parse_bytes("64M") == 64 * 2**20
    assert allreduce.parse_bytes("256k") == 256 * 2**10
    assert allreduce.parse_bytes("1G") == 2**30 and allreduce.parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        allreduce.parse_bytes("lots")
    args = argparse.Namespace(sizes_mib=None, minbytes=2**20, maxbytes=64 * 2**20, stepfactor=4)
    assert allreduce.sizes_in_bytes(args) == [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20]
    args.sizes_mib = [0.5, 2]
    assert allreduce.sizes_in_bytes(args) == [2**19, 2**21]
    args = argparse.Namespace(sizes_mib=None, minbytes=1, maxbytes=8, stepfactor=1.5)  # int(1 * 1.5) == 1
    assert allreduce.sizes_in_bytes(args) == [1, 2, 3, 4, 6]


@pytest.mark.parametrize("argv, message", [
    (["allreduce", "-b", "0"], "argument -b/--minbytes: '0' is less than one byte"),
    (["allreduce", "-b=-1K"], "argument -b/--minbytes: '-1K' is less than one byte"),
    (["allreduce", "-f", "1"], "argument -f/--stepfactor: must be a finite number > 1"),
    (["allreduce", "--bits", "16"], "argument --bits: invalid choice: 16"),
    (["codec", "--world", "0"], "argument --world: must be at least 1, got 0"),
    (["codec", "--bits", "9"], "argument --bits: invalid choice: 9"),
    (["model", "--codec-json", "x.json", "--link", "0gbit"], "argument --link: '0gbit' is not a tc rate (e.g. 1gbit"),
    (["model", "--codec-json", "x.json", "--latency-ms", "-1"], "argument --latency-ms: must be a finite number >= 0"),
    (["model", "--codec-json", "x.json", "--world", "0"], "argument --world: must be at least 1"),
])
def test_bad_arguments_are_refused_before_measuring(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_tiny_runs_of_what_used_to_crash(capsys):
    # Stochastic rounding in the codec bench (its reduce column had no key); an all-reduce
    # over one device (no bytes on the wire: the ratio column divided by zero).
    main(["codec", "--sizes-mib", "0.01", "--bits", "4", "--repeats", "1", "--world", "2", "--stochastic"])
    main(["allreduce", "--sizes-mib", "0.01", "--bits", "4", "-n", "1", "--no-progress"])
    assert "psum" in capsys.readouterr().out


def test_small_sweep_writes_consistent_records(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    main(["allreduce", "-b", "64K", "-e", "128K", "-f", "2", "--bits", "4", "8", "-n", "2",
          "--output", str(out), "--plot", str(png), "--no-progress"])
    records = json.loads(out.read_text())
    assert [(r["size_bytes"], r["bits"]) for r in records] == [(65536, 4), (65536, 8), (131072, 4), (131072, 8)]
    world = records[0]["devices"]
    for r in records:
        assert r["count"] * 4 == r["size_bytes"] and r["backend"] == "xla"
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (world - 1) / world)
        assert r["algbw_gbs"] == pytest.approx(r["size_bytes"] / (r["compressed_ms"] / 1e3) / 1e9)
        assert r["speedup"] == pytest.approx(r["psum_ms"] / r["compressed_ms"])
        assert r["compressed_wire_mib"] < r["psum_wire_mib"] / 3
        assert 0 < r["max_abs_error"] < r["max_abs_sum"]
    assert png.stat().st_size > 10_000
    assert "busbw GB/s" in capsys.readouterr().out


def test_reduce_scatter_and_all_gather_rows(tmp_path):
    out = tmp_path / "r.json"
    main(["allreduce", "--sizes-mib", "0.25", "--bits", "4", "-n", "2", "--ops", "psum_scatter", "all_gather",
          "--backends", "xla", "tcp", "--output", str(out), "--no-progress"])
    records = json.loads(out.read_text())
    assert [(r["op"], r["backend"]) for r in records] == [("psum_scatter", "xla"), ("all_gather", "xla")]  # xla only
    world = records[0]["devices"]
    for r in records:
        assert r["size_bytes"] == 2**18  # the larger side: the scatter's input, the gather's output
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * (world - 1) / world)  # nccl-tests' factor
        assert r["compressed_wire_mib"] < r["psum_wire_mib"] / 3
        assert 0 < r["max_abs_error"] < r["max_abs_sum"]


@pytest.mark.multiprocess
def test_allreduce_phases_on_two_processes(tmp_path):
    """benchmarks/allreduce_phases.py: every phase timed, on 2 CPU processes under jax_cgx.launch."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "phases.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    proc = subprocess.run(
        [sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(root / "benchmarks" / "allreduce_phases.py"),
         "--size-mib", "0.25", "--repeats", "1", "--segments", "3", "--output", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert [r["phase"] for r in records] == ["quantize", "all_to_all", "dequantize_sum_requantize", "all_gather",
                                             "decode", "sum of phases", "compressed_psum", "psum", "x * 2"]
    assert all(r["ms"] > 0 and r["devices"] == 2 and r["messages"] == 3 for r in records)
    assert records[5]["ms"] == pytest.approx(sum(r["ms"] for r in records[:5]))


@pytest.mark.multiprocess
def test_hierarchical_phases_on_two_processes(tmp_path):
    """``allreduce_phases.py --two-level``: the hierarchical form's parts, the whole forms and the
    inside's rate, on 2 nodes of 2 devices (one process each, the inside through the ppermutes)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "phases.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_cgx.launch", "-n", "2", "--devices-per-process", "2",
         str(root / "benchmarks" / "allreduce_phases.py"), "--two-level", "--per-node", "2",
         "--size-mib", "0.25", "--repeats", "1", "--output", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(out.read_text())
    assert [r["phase"] for r in records] == [
        "inside: reduce-scatter", "across: compressed_psum of the shard", "inside: all_gather", "sum of phases",
        "hierarchical compressed_psum", "flat compressed_psum", "psum", "inside: psum (policy='auto' probes it)",
        "across: psum of the shard"]
    assert all(r["ms"] > 0 and r["nodes"] == 2 and r["per_node"] == 2 and r["inside_gbs"] > 0 for r in records)
    assert records[3]["ms"] == pytest.approx(sum(r["ms"] for r in records[:3]))


def test_codec_bench_times_gpu_calls_in_batches(monkeypatch):
    """The GPU path of ``bench codec`` (run on CPU here): one warm-up, then ``repeats`` batches of
    back-to-back calls, blocked once per batch, the median per-call time."""
    import jax.numpy as jnp

    from jax_cgx.bench import codec

    calls = []
    blocked = []
    monkeypatch.setattr(codec.jax, "block_until_ready", lambda x: blocked.append(x) or x)

    def fn():
        calls.append(1)
        return jnp.zeros(1)

    t = codec._time(fn, "gpu", repeats=3)
    assert t > 0
    assert len(calls) == 1 + 3 * codec._CALLS and len(blocked) == 1 + 3  # blocked per batch, not per call
    calls.clear()
    blocked.clear()
    codec._time(fn, "cpu", repeats=3)
    assert len(calls) == 1 + 3 and len(blocked) == 1 + 3  # on CPU each call is timed alone
