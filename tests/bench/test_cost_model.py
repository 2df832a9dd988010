"""The all-reduce cost model (jax_cgx/bench/model.py): units and limits."""

import argparse
import json

import pytest

from jax_cgx import CompressionConfig
from jax_cgx._src.exchange.chunks import wire_bytes_per_rank
from jax_cgx.bench.model import CodecRates, LinkModel, encoded_chunk_bytes, parse_rate, predict

RATES = CodecRates(quantize=2e9, dequantize=3e9, add=5e9)


def test_parse_rate_follows_tc_units():
    assert parse_rate("1gbit") == 125e6 and parse_rate("10gbit") == 1.25e9
    assert parse_rate("125mbps") == 125e6 and parse_rate("8000") == 1000
    assert parse_rate("unlimited") == float("inf")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rate("fast")


@pytest.mark.parametrize("world, bits", [(2, 4), (4, 8), (8, 2)])
def test_wire_bytes_match_the_algorithm(world, bits):
    size = 64 * 2**20
    model = 2 * (world - 1) * encoded_chunk_bytes(size, world, bits, 512)
    actual = wire_bytes_per_rank(size // 4, world, bits, 512, False)
    assert model == pytest.approx(actual, rel=1e-3)


def test_limits():
    size, world = 64 * 2**20, 4
    free = predict(size, world, 4, 512, LinkModel(float("inf"), 0.0), RATES)
    assert free["wire"] == 0 and free["psum"] == pytest.approx(3 / 4 * size / RATES.add)
    # On a slower and slower link the speedup tends to the ratio of bytes sent.
    slow = predict(size, world, 4, 512, LinkModel(1e3, 0.0), RATES)
    byte_ratio = (2 * 3 / 4 * size) / (2 * 3 * encoded_chunk_bytes(size, world, 4, 512))
    assert slow["speedup"] == pytest.approx(byte_ratio, rel=1e-3)
    speedups = [predict(size, world, 4, 512, LinkModel(bw, 2e-4), RATES)["speedup"] for bw in (1e10, 1e9, 1e8)]
    assert speedups == sorted(speedups)
    assert predict(size, 1, 4, 512, LinkModel(1e8), RATES)["compressed"] == 0


def test_rates_from_codec_json(tmp_path):
    path = tmp_path / "codec.json"
    path.write_text(json.dumps([
        dict(bits=4, size_mib=16, quantize_gbps=1.0, dequantize_gbps=2.0, copy_gbps=5.0),
        dict(bits=4, size_mib=64, quantize_gbps=1.5, dequantize_gbps=2.5, copy_gbps=6.0),
    ]))
    rates = CodecRates.from_codec_json(str(path), 4)
    assert (rates.quantize, rates.dequantize, rates.add) == (1.5e9, 2.5e9, 6e9)
    assert CodecRates.from_codec_json(str(path), 4, size_mib=16).quantize == 1e9
    with pytest.raises(ValueError, match="no rows for bits=8"):
        CodecRates.from_codec_json(str(path), 8)


def test_ranks_sharing_a_host_slow_compute_not_wire():
    size, link = 64 * 2**20, LinkModel(125e6, 2e-4)
    own = predict(size, 4, 4, 512, link, RATES)
    shared = predict(size, 4, 4, 512, link, RATES, host_cores=2)
    assert shared["wire"] == own["wire"]
    assert shared["codec"] == pytest.approx(2 * own["codec"]) and shared["copies"] == pytest.approx(2 * own["copies"])
    assert predict(size, 2, 4, 512, link, RATES, host_cores=2)["compressed"] == predict(size, 2, 4, 512, link, RATES)["compressed"]


def test_measured_reduce_rate_replaces_the_estimate():
    size, link = 64 * 2**20, LinkModel(125e6)
    slow_reduce = CodecRates(quantize=2e9, dequantize=3e9, add=5e9, reduce=1e9)
    assert predict(size, 2, 4, 512, link, slow_reduce)["codec"] == pytest.approx(size / 2e9 + size / 1e9 + size / 3e9)


def test_nodes_share_their_link():
    # 2 nodes of 2 ranks: flat SRA's all_to_all sends m(W - m) chunks over each node's link, its
    # all_gather ring (W - 1); hierarchical sends S/m over the nodes, the m ranks sharing each link.
    from jax_cgx._src.policy.cost_model import encoded_chunk_bytes, predict_nodes

    size, link = 64 * 2**20, LinkModel(125e6, 0.0)  # 1 Gbit/s
    one_per_node = predict(size, 4, 4, 512, link, RATES)
    assert predict_nodes(size, 4, 1, 4, 512, link, RATES) == one_per_node
    flat = predict_nodes(size, 2, 2, 4, 512, link, RATES)
    enc = encoded_chunk_bytes(size, 4, 4, 512)
    assert flat["wire"] == pytest.approx(one_per_node["wire"] - 6 * enc / 125e6 + (2 * 2 + 3) * enc / 125e6)
    assert flat["codec"] == one_per_node["codec"] and flat["psum"] == one_per_node["psum"]
    hier = predict_nodes(size, 2, 2, 4, 512, link, RATES, hierarchical=True)
    cross = predict(size / 2, 2, 4, 512, LinkModel(62.5e6, 0.0), RATES)
    assert hier["compressed"] == pytest.approx(cross["compressed"] + 2 * (1 / 2) * size / RATES.add)
    # the link is the bottleneck: hierarchical sends fewer bytes over it than flat
    slow = LinkModel(1e6, 0.0)
    assert predict_nodes(size, 2, 2, 4, 512, slow, RATES, hierarchical=True)["compressed"] < \
        predict_nodes(size, 2, 2, 4, 512, slow, RATES)["compressed"]


def test_the_ring_crosses_a_node_link_once_a_step():
    # A flat ring over nodes of consecutive ranks: at each of its 2(W - 1) steps one rank per node
    # sends across, so the node's link carries what one rank's own link would; SRA's all_to_all
    # sends m(W - m) chunks over it. Both pay one latency per message and step.
    from jax_cgx._src.policy.cost_model import predict_nodes

    size, lat = 64 * 2**20, 1e-3
    link = LinkModel(125e6, lat)
    ring = predict_nodes(size, 2, 4, 4, 512, link, RATES, algorithm="ring", segments=3)
    assert ring == predict(size, 8, 4, 512, link, RATES, segments=3, algorithm="ring")
    sra = predict(size, 8, 4, 512, link, RATES, segments=3)
    assert ring["wire"] - sra["wire"] == pytest.approx(3 * (2 * 7 - 8) * lat)  # 14 steps against 8, 3 messages
    assert ring["codec"] == sra["codec"] and ring["psum"] == sra["psum"]
    assert ring["compressed"] < predict_nodes(size, 2, 4, 4, 512, link, RATES, segments=3)["compressed"]
    with pytest.raises(ValueError, match="algorithm must be one of"):
        predict(size, 8, 4, 512, link, RATES, algorithm="tree")


def test_a_measured_inside_is_not_slowed_again_by_shared_cores():
    # inner_bandwidth is measured as the job runs (every node at once, on cores as shared):
    # ranks sharing a core slow the codec and memory-speed copies, not that rate a second time.
    from jax_cgx._src.policy.cost_model import predict_nodes

    size, link = 64 * 2**20, LinkModel(125e6, 0.0)

    def inside(**kw):
        hier = predict_nodes(size, 2, 4, 4, 512, link, RATES, hierarchical=True, share=4.0, **kw)
        cross = predict(size / 4, 2, 4, 512, LinkModel(125e6 / 4, 0.0), RATES, share=4.0)
        return hier["compressed"] - cross["compressed"]

    assert inside(inner_bandwidth=0.5e9) == pytest.approx(2 * 3 / 4 * size / 0.5e9)
    assert inside() == pytest.approx(4.0 * 2 * 3 / 4 * size / RATES.add)  # memory speed, shared


def test_the_scale_table(tmp_path, capsys):
    # python -m jax_cgx.bench scale: the model's table past this machine, with the exact psum's two
    # forms; a slow link between nodes of 8 GPUs makes the hierarchical form the fastest.
    import json

    from jax_cgx.bench.__main__ import main

    out = tmp_path / "scale.json"
    main(["scale", "--nodes", "2", "128", "--gbps", "10", "400", "--bits", "4", "--output", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["gbps"], r["nodes"]) for r in rows] == [(10, 2), (10, 128), (400, 2), (400, 128)]
    for r in rows:
        assert r["gpus"] == 8 * r["nodes"] and r["hierarchical_s"] < r["flat_s"]
        best = min(r["psum_ring_s"], r["psum_hierarchical_s"])
        assert r["hierarchical_speedup"] == pytest.approx(best / r["hierarchical_s"])
    assert "predicted all-reduce of 1e+09 float32 values" in capsys.readouterr().out


def test_bench_model_compares_each_algorithm_with_its_own_runs(tmp_path, capsys):
    # python -m jax_cgx.bench model --measured: a row per algorithm, each against the runs of that
    # form only (flat "sra" and "ring"; the hierarchical and auto rows of the same file left aside).
    from jax_cgx._src.policy.cost_model import predict_nodes
    from jax_cgx.bench.__main__ import main

    codec = tmp_path / "codec.json"
    codec.write_text(json.dumps([dict(bits=4, size_mib=64, quantize_gbps=1.0, dequantize_gbps=2.0, copy_gbps=4.0)]))
    row = dict(devices=8, mesh="2x4", size_mib=64.0, bits=4, psum_ms=1000.0, speedup=1.0)
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([dict(row, algorithm="sra", compressed_ms=111.0),
                                dict(row, algorithm="ring", compressed_ms=222.0),
                                dict(row, algorithm="hierarchical ring", compressed_ms=333.0),
                                dict(row, algorithm="auto", compressed_ms=444.0)]))
    main(["model", "--codec-json", str(codec), "--world", "8", "--per-node", "4", "--sizes-mib", "64", "--bits", "4",
          "--link", "1gbit", "--latency-ms", "0", "--measured", str(runs)])
    lines = {line.split("│")[4].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") > 8}
    rates = CodecRates.from_codec_json(str(codec), 4)
    for algorithm, measured in [("sra", "111.0"), ("ring", "222.0")]:
        predicted = predict_nodes(64 * 2**20, 2, 4, 4, CompressionConfig.bucket_size, LinkModel(125e6, 0.0), rates, algorithm=algorithm)
        cells = [c.strip() for c in lines[algorithm].split("│")]
        assert cells[6] == f"{predicted['compressed'] * 1e3:.1f}" and cells[9].startswith(measured + " (")
    assert "333.0" not in str(lines) and "444.0" not in str(lines)
