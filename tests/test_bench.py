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
