"""policy="auto": decisions from the cost model, static under jit, logged once, agreed by every
process; jax_cgx.explain; JAX_CGX_POLICY / JAX_CGX_LINK_GBPS (jax_cgx/_src/policy/pricing.py)."""

import dataclasses
import io
import json
import logging
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from processes import run_all, run_workers, worker_commands

import jax_cgx
from jax_cgx._src.collectives import bytes_on_wire
from jax_cgx._src.policy import calibration, cost_model, forms, pricing

W = 8
BIG = 1 << 18  # values per device of the large leaf: 1 MiB of float32


# Every test starts and ends with no measured figure and no logged decision (conftest.py's fresh_policy).
pytestmark = pytest.mark.usefixtures("fresh_policy")


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((W, BIG)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((W, 300)), jnp.float32),
        "step": jnp.arange(W, dtype=jnp.int32)[:, None],
    }


def _psum_fn(config, residual=False):
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))

    def body(t):
        t = jax.tree.map(lambda v: v[0], t)
        out = jax_cgx.compressed_psum(t, "d", config, return_residual=residual)
        return jax.tree.map(lambda v: v[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def _uses_compression(fn, x) -> bool:
    return "compressed_allreduce" in str(fn.trace(x).jaxpr)


def test_unlimited_link_reduces_with_plain_psum_and_logs_once(caplog):
    x = _tree()
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=math.inf, min_size=16)
    fn = _psum_fn(config)
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        out = fn(x)
        _psum_fn(config)(x)  # a second trace of the same reduction: no second log line
    assert not _uses_compression(fn, x)
    exact = _psum_fn(jax_cgx.CompressionConfig(bits=32))(x)  # psum leaf by leaf
    for k in x:
        assert_same_bits(np.asarray(out[k]), np.asarray(exact[k]), k)
    decisions = [r.getMessage() for r in caplog.records if "psum (uncompressed)" in r.getMessage()]
    assert len(decisions) == 1, decisions  # one buffer ("w" and "b" fused), logged once
    assert "calibrated" in caplog.text  # the codec was measured while tracing, and said so


def test_slow_link_compresses_bitwise_like_always():
    x = _tree()
    auto = _psum_fn(jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=0.1, min_size=16))
    always = _psum_fn(jax_cgx.CompressionConfig(bits=4, min_size=16))
    assert _uses_compression(auto, x)
    a, b = auto(x), always(x)
    for k in x:
        assert_same_bits(np.asarray(a[k]), np.asarray(b[k]), k)


def test_buffers_decided_one_by_one(monkeypatch):
    # Buffers of 16384 values (64 KiB) win, shorter ones lose. a, more than a quarter of a buffer,
    # is cut into buffers of its own (on CPU), b fused after it. First pricing: a[0:16384],
    # a[16384:32768] win; a's tail and b's buffer lose, so b leaves for the auto-psum lane. a alone
    # is priced again: its last buffer still loses and is psum'd in place. Every compressed buffer
    # is bitwise what "always" gives a alone.
    rng = np.random.default_rng(1)
    x = {"a": jnp.asarray(rng.standard_normal((W, 40000)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal((W, 300)), jnp.float32)}
    base = jax_cgx.CompressionConfig(bits=3, fusion_buffer_mb=1 / 16, stochastic=True, min_size=16)
    calls = []

    def fake(values, dtype, world, config, **kw):
        calls.append(values)
        return pricing.Decision(values == 16384, 1.0, 1.0)

    monkeypatch.setattr(pricing, "decide", fake)
    key = jax.random.key(7)
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))

    def run(tree, config):
        body = lambda t: jax.tree.map(  # noqa: E731
            lambda v: v[None], jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", config, key=key))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(tree)

    auto = run(x, base.replace(policy="auto"))
    always = run({"a": x["a"]}, base)
    assert calls == [16384, 16384, 40000 - 2 * 16384, 300, 16384, 16384, 40000 - 2 * 16384]
    a, ref = np.asarray(auto["a"]), np.asarray(always["a"])
    assert_same_bits(a[:, :32768], ref[:, :32768], "buffers 0 and 1 compressed")
    exact = np.asarray(x["a"]).sum(axis=0)
    np.testing.assert_allclose(a[0, 32768:], exact[32768:], rtol=1e-5, atol=1e-5)  # psum: float32 rounding only
    exact_b = _psum_fn(jax_cgx.CompressionConfig(bits=32))({"b": x["b"]})["b"]
    assert_same_bits(np.asarray(auto["b"]), np.asarray(exact_b), "b: psum leaf by leaf")
    for r in range(1, W):
        assert_same_bits(a[r], a[0], f"rank {r}")
    report = jax_cgx.explain(jax.tree.map(lambda v: v[0], x), world=W, config=base.replace(policy="auto"), file=None)
    assert {r.path: r.how for r in report.leaves} == {"['a']": "mixed (auto)", "['b']": "psum (auto)"}
    assert [b.compressed for b in report.buffers] == [True, True, False, False]  # a's three, then b's dissolved one
    assert {r.path: r.buffers for r in report.leaves} == {"['a']": (0, 1, 2), "['b']": (3,)}


def test_leaves_alone_are_charged_no_fusion_copies():
    # Buffers of 4096 values: a (5000) and c (2000) are leaves alone (>= 1024), first and in tree
    # order; b (100) is fused after them. A part of a leaf alone is joined once on the way out.
    from jax_cgx._src.collectives.plan import Group, Plan, fusion_spans

    config = jax_cgx.CompressionConfig(bits=4, fusion_buffer_mb=4096 * 4 / 2**20, min_size=16)
    group = Group(np.dtype(np.float32), config)
    plan = Plan(["quantized"] * 3, [config] * 3, {group: [0, 2, 1]}, [5000, 100, 2000], "cpu")
    assert plan.buffers(group) == [(0, 4096), (4096, 5000), (5000, 7000), (7000, 7100)]
    assert plan.copied(group) == [1.0, 1.0, 0.0, 2.0]
    fused = Plan(["quantized"] * 3, [config] * 3, {group: [0, 1, 2]}, [5000, 100, 2000], "gpu")
    assert fused.buffers(group) == [(0, 4096), (4096, 7100)] and fused.copied(group) == [2.0, 2.0]
    assert fusion_spans([], 4096, 1024) == []


def test_residual_of_an_uncompressed_buffer_is_zero():
    x = _tree()
    out, res = _psum_fn(jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=math.inf, min_size=16), residual=True)(x)
    for k in x:
        assert not np.any(np.asarray(res[k])), k


def test_measured_figures_on_virtual_devices_choose_psum():
    # 8 devices of one process share its cores and its memory: nothing to gain, and the
    # measured link says so. Measured while tracing (in a thread of its own).
    x = _tree()
    fn = _psum_fn(jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16))
    assert not _uses_compression(fn, x)
    fig = pricing.figures()
    assert fig.link_source == f"measured over {len(jax.devices())} devices"
    assert fig.link.bandwidth > 0 and fig.link.latency >= 0
    assert fig.share >= 1
    assert pricing.figures() is not fig and pricing.figures() == fig  # cached: measured once


def _tie_on_measured_link(monkeypatch, psum_s: float, exchange_s: float) -> list:
    """Every prediction a near-tie, on a measured link, and the timing of a buffer faked:
    returns the list of ``(values, backend)`` timed."""
    monkeypatch.setattr(pricing, "TIE_BAND", math.inf)
    monkeypatch.setattr(pricing, "_SETTLE_MAX_S", math.inf)
    timed = []

    def fake(devices, values, dtype, config, backend, bodies=None, inner=None, known_psum_s=None, rivals=()):
        assert len(devices) == W and config.policy == "auto" and rivals == ()
        timed.append((values, backend))
        return psum_s, exchange_s

    monkeypatch.setattr(pricing, "_time_exchange", fake)
    return timed


@pytest.mark.parametrize("tcp", [False, True], ids=["xla", "tcp"])
def test_near_tie_is_timed_on_the_backend_that_runs(monkeypatch, caplog, tcp):
    # The model says psum on these virtual devices (test above); the buffer's timing says
    # compressing is 100x faster, and wins. It is timed once, on the backend the lowering picks.
    timed = _tie_on_measured_link(monkeypatch, psum_s=1.0, exchange_s=0.01)
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    x = _tree()
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    if tcp:
        jax_cgx.tcp.setup(mesh)
    try:
        with caplog.at_level(logging.INFO, logger="jax_cgx"):
            fn = _psum_fn(config)
            assert _uses_compression(fn, x)
            out = fn(x)
            _psum_fn(config)(x)  # traced again: not timed again
        backend = "tcp" if tcp else "xla"
        assert timed == [(BIG + 300, backend)]  # "w" and "b" fused in one buffer
        always = _psum_fn(config.replace(policy="always"))(x)
        for k in x:
            assert_same_bits(np.asarray(out[k]), np.asarray(always[k]), k)
        # The timed exchange, plus the fusion buffer's copies in and out.
        assert re.search(rf"compress a .* \(measured 1\d\.?\d* ms compressed on {backend}, 1e\+03 ms psum\)",
                         caplog.text), caplog.text
        seen = {}

        def body(t):
            seen["report"] = jax_cgx.explain(jax.tree.map(lambda a: a[0], t), "d", config, file=None)
            return t["step"]

        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(x)
        (buf,) = seen["report"].buffers
        assert buf.compressed and buf.priced == f"timed on {backend}"
    finally:
        if tcp:
            jax_cgx.tcp.teardown(mesh)


def _model_compresses(config) -> bool:
    """What the model alone says for _tree()'s fused buffer, from this process's figures (measured
    on this machine, so either way: a loaded machine's link makes it compress)."""
    return pricing.decide(BIG + 300, jnp.float32, W, config, measure=False, log=False).compress


@pytest.mark.parametrize("validated", [True, False])
def test_buffers_are_timed_where_the_model_is_not_validated(monkeypatch, validated):
    # No near-tie band: on a validated platform the model decides (psum on these virtual devices, unless loaded);
    # elsewhere (a GPU) the buffer is timed whatever the model predicts, and the timing wins.
    timed = _tie_on_measured_link(monkeypatch, psum_s=1.0, exchange_s=0.01)
    monkeypatch.setattr(pricing, "TIE_BAND", 1.0)
    if not validated:
        monkeypatch.setattr(pricing, "VALIDATED_PLATFORMS", frozenset())
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    compressed = _uses_compression(_psum_fn(config), _tree())
    assert compressed == (_model_compresses(config) if validated else True)
    assert timed == ([] if validated else [(BIG + 300, "xla")])


def test_buffers_too_slow_to_time_are_not_timed_anywhere(monkeypatch):
    # Off the validated platforms the limit is the psum's predicted time alone: above it, the model decides.
    timed = _tie_on_measured_link(monkeypatch, psum_s=1.0, exchange_s=0.01)
    monkeypatch.setattr(pricing, "VALIDATED_PLATFORMS", frozenset())
    monkeypatch.setattr(pricing, "_SETTLE_MAX_S", 1e-9)
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    assert _uses_compression(_psum_fn(config), _tree()) == _model_compresses(config)
    assert timed == []


def test_given_link_rates_are_never_timed(monkeypatch):
    timed = _tie_on_measured_link(monkeypatch, psum_s=1.0, exchange_s=0.01)
    fn = _psum_fn(jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=math.inf, min_size=16))
    assert not _uses_compression(fn, _tree()) and timed == []


def test_explain_and_bytes_on_wire_never_time(monkeypatch, caplog):
    # Timing is collective, and one process alone may call these: they use earlier timings only.
    timed = _tie_on_measured_link(monkeypatch, psum_s=1.0, exchange_s=0.01)
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    report = jax_cgx.explain(jax.tree.map(lambda v: v[0], _tree()), world=W, config=config, file=None)
    bytes_on_wire(jax.tree.map(lambda v: v[0], _tree()), W, config)
    assert timed == [] and all(b.priced == "model" for b in report.buffers)
    monkeypatch.setattr(pricing, "_SETTLE_MAX_BUFFERS", 0)  # and past the cap, the model decides
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        assert _uses_compression(_psum_fn(config), _tree()) == _model_compresses(config)
    assert timed == [] and "buffer sizes timed already; the cost model decides" in caplog.text


def test_timing_a_buffer_over_tcp_leaves_no_communicators():
    devices = jax.devices()[:W]
    psum_s, exchange_s = pricing._time_exchange(devices, 4096, np.float32, jax_cgx.CompressionConfig(bits=4, min_size=16), "tcp")
    assert psum_s > 0 and exchange_s > 0
    assert jax_cgx.tcp.communicators() == []


def test_link_from_environment(monkeypatch):
    monkeypatch.setenv("JAX_CGX_LINK_GBPS", "2.5")
    fig = pricing.figures(jax_cgx.CompressionConfig(policy="auto", min_size=16))
    assert fig.link.bandwidth == 2.5e9 / 8 and fig.link_source == "JAX_CGX_LINK_GBPS"
    fig = pricing.figures(jax_cgx.CompressionConfig(policy="auto", link_gbps=10.0, min_size=16))  # the config wins
    assert fig.link.bandwidth == 10e9 / 8 and fig.link_source == "CompressionConfig.link_gbps"
    monkeypatch.setenv("JAX_CGX_LINK_GBPS", "fast")
    with pytest.raises(ValueError, match="JAX_CGX_LINK_GBPS='fast' is not a number"):
        pricing.figures(jax_cgx.CompressionConfig(policy="auto", min_size=16))


@pytest.mark.parametrize("value, message", [
    ("sometimes", "JAX_CGX_POLICY='sometimes' must be always or auto"),
])
def test_bad_policy_variable(value, message):
    with pytest.raises(ValueError, match=message):
        jax_cgx.CompressionConfig.from_env({"JAX_CGX_POLICY": value})


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1gbit"])
def test_bad_link_variable(value):
    with pytest.raises(ValueError, match=f"JAX_CGX_LINK_GBPS='{value}'"):
        jax_cgx.CompressionConfig.from_env({"JAX_CGX_LINK_GBPS": value})


def test_policy_from_environment():
    c = jax_cgx.CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "4", "JAX_CGX_POLICY": "AUTO",
                                            "JAX_CGX_LINK_GBPS": "inf"})
    assert c.policy == "auto" and c.link_gbps == math.inf
    assert jax_cgx.CompressionConfig.from_env({}).policy == "always"


@pytest.mark.parametrize("kwargs, error", [
    (dict(policy="sometimes"), ValueError),
    (dict(link_gbps=0), ValueError),
    (dict(link_gbps=-1.0), ValueError),
    (dict(link_gbps=math.nan), ValueError),
    (dict(link_gbps="1"), TypeError),
    (dict(link_gbps=True), TypeError),
])
def test_bad_config_fields(kwargs, error):
    with pytest.raises(error, match="CompressionConfig: (policy|link_gbps)"):
        jax_cgx.CompressionConfig(**kwargs)


def test_bytes_on_wire_follows_the_decisions():
    x = {"w": jax.ShapeDtypeStruct((BIG,), jnp.float32)}
    plain = bytes_on_wire(x, W, jax_cgx.CompressionConfig(bits=32))
    unlimited = jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=math.inf, min_size=16)
    slow = unlimited.replace(link_gbps=0.1)
    assert bytes_on_wire(x, W, unlimited) == plain
    assert bytes_on_wire(x, W, slow) == bytes_on_wire(x, W, slow.replace(policy="always")) < plain / 4


def test_explain_prints_every_leaf():
    x = {"w": jax.ShapeDtypeStruct((BIG,), jnp.float32), "n": jax.ShapeDtypeStruct((4,), jnp.int32),
         "h": jax.ShapeDtypeStruct((1000,), jnp.bfloat16)}
    configs = {"w": jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=math.inf, min_size=16), "n": None,
               "h": jax_cgx.CompressionConfig(bits=16, min_size=16)}
    text = io.StringIO()
    report = jax_cgx.explain(x, config=configs, world=W, file=text)
    how = {r.path: r.how for r in report.leaves}
    assert how == {"['w']": "psum (auto)", "['n']": "exact", "['h']": "half"}
    (buf,) = report.buffers
    assert [r.buffers for r in report.leaves] == [(), (), (0,)]  # h, n: their own lanes; w: the dissolved buffer
    assert not buf.compressed and buf.psum_ms < buf.compressed_ms * pricing.MIN_SPEEDUP and buf.values == BIG
    assert "psum (auto)" in text.getvalue() and "unlimited" in text.getvalue()
    always = jax_cgx.explain(x, config=jax_cgx.CompressionConfig(bits=4, link_gbps=0.1, min_size=16), world=W, file=None)
    assert [r.how for r in always.leaves] == ["compressed", "exact", "compressed"]  # h, n, w
    assert all(b.compressed and b.policy == "always" for b in always.buffers)


def test_explain_inside_shard_map_and_its_errors():
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    seen = {}

    def body(v):
        seen["report"] = jax_cgx.explain(v, "d", jax_cgx.CompressionConfig(bits=4, link_gbps=0.1, min_size=16), file=None)
        return lax.psum(v, "d")

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))(jnp.ones((W * 4096,)))
    assert seen["report"].world == W and seen["report"].leaves[0].how == "compressed"
    with pytest.raises(ValueError, match="give axis_name .* or world="):
        jax_cgx.explain({"a": jnp.ones(3)}, file=None)
    with pytest.raises(ValueError, match="world must be a positive int"):
        jax_cgx.explain({"a": jnp.ones(3)}, world=0, file=None)


def test_cost_model_share_slows_compute_only():
    rates = cost_model.CodecRates(quantize=2e9, dequantize=3e9, add=5e9)
    link = cost_model.LinkModel(1e8, 0.0)
    one = cost_model.predict(2**24, 4, 4, 512, link, rates)
    four = cost_model.predict(2**24, 4, 4, 512, link, rates, share=4.0)
    assert four["wire"] == one["wire"] and math.isclose(four["codec"], 4 * one["codec"])


@pytest.mark.multiprocess
def test_processes_agree_on_figures_and_decisions(tmp_path):
    nproc = 2
    run_workers("policy_worker.py", nproc, tmp_path)
    records = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(nproc)]
    assert records[0]["figures"] == records[1]["figures"]  # each measured its own; they agreed
    assert records[0]["slow_link_compresses"] and records[1]["slow_link_compresses"]
    assert records[0]["compressed_in_jaxpr"] == records[1]["compressed_in_jaxpr"]
    assert records[0]["timed"] == records[1]["timed"] and min(records[0]["timed"]) > 0  # agreed
    assert records[0]["tcp_left"] == records[1]["tcp_left"] == 0  # the probe's communicators are gone
    assert_same_bits(np.asarray(records[0]["result"], np.float32), np.asarray(records[1]["result"], np.float32),
                     "process 1 vs process 0")


@pytest.mark.multiprocess
@pytest.mark.parametrize("first", ["--figures-only", "--calibrate-only"])
def test_processes_given_different_link_rates_fail_clearly(tmp_path, first):
    """JAX_CGX_LINK_GBPS on one process only: that one would skip the link probe the other runs
    collectively (a hang, or mismatched programs). Both raise at the first calibration instead,
    also when that is jax_cgx.calibrate(), which measures the link whatever the variable says."""
    nproc = 2
    commands = worker_commands("policy_worker.py", nproc, tmp_path, first)
    env = {k: v for k, v in os.environ.items() if k != "JAX_CGX_LINK_GBPS"}
    for returncode, log in run_all(commands, timeout=300, envs=[env, {**env, "JAX_CGX_LINK_GBPS": "2.5"}]):
        assert returncode == 0, log[-4000:]
    for i in range(nproc):
        error = json.loads((tmp_path / f"process{i}.json").read_text()).get("error", "")
        assert "disagree on the link rate (not given (measured) on one, 2.5 Gbit/s on another" in error, error
        assert ("compared: JAX_CGX_LINK_GBPS" if first == "--calibrate-only" else "the rate each uses here") in error
        assert "on every process, or on none" in error


@pytest.mark.multiprocess
def test_a_malformed_link_rate_on_one_process_fails_everywhere(tmp_path):
    """A bad JAX_CGX_LINK_GBPS on one process: it raises after the agreement the others wait in
    (before, it raised first and left them blocked there), and the others say why."""
    nproc = 2
    commands = worker_commands("policy_worker.py", nproc, tmp_path, "--calibrate-only")
    env = {k: v for k, v in os.environ.items() if k != "JAX_CGX_LINK_GBPS"}
    for returncode, log in run_all(commands, timeout=300, envs=[env, {**env, "JAX_CGX_LINK_GBPS": "fast"}]):
        assert returncode == 0, log[-4000:]
    errors = [json.loads((tmp_path / f"process{i}.json").read_text()).get("error", "") for i in range(nproc)]
    assert "a malformed JAX_CGX_LINK_GBPS on one" in errors[0], errors
    assert "JAX_CGX_LINK_GBPS='fast' is not a number" in errors[1], errors


def test_bytes_on_wire_alone_never_measures_collectively(monkeypatch):
    """bytes_on_wire may run on one process: with several processes and nothing measured yet,
    policy='auto' would start a collective probe the others never join (a hang): a clear error."""
    pricing.reset()
    monkeypatch.setattr(pricing.jax, "process_count", lambda: 2)
    tree = {"w": jax.ShapeDtypeStruct((1 << 16,), jnp.float32)}
    auto = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    for op in ("psum", "psum_scatter", "all_gather"):
        with pytest.raises(RuntimeError, match="one process cannot do it alone. Call jax_cgx.calibrate"):
            bytes_on_wire(tree, 8, auto, op=op)
    assert bytes_on_wire(tree, 8, jax_cgx.CompressionConfig(bits=4, min_size=16)) > 0  # "always" needs no figures
    pricing.reset()


@pytest.mark.parametrize("op", ["psum", "psum_scatter"])
def test_explain_measures_nothing_for_a_policy_that_does_not_decide(monkeypatch, op):
    # Before: explain(config=CompressionConfig(policy="always", min_size=16)) calibrated "auto" anyway (3.7 s).
    tree = {"w": jax.ShapeDtypeStruct((W * 4096,), jnp.float32)}
    config = jax_cgx.CompressionConfig(bits=4, policy="always", min_size=16)
    calls = []
    real = calibration._calibrate_platform
    monkeypatch.setattr(calibration, "_calibrate_platform", lambda *a: calls.append(a) or real(*a))
    tiled = {"tiled": True} if op == "psum_scatter" else {}
    report = jax_cgx.explain(tree, world=W, config=config, op=op, file=None, **tiled)
    assert not calls and [b.priced for b in report.buffers] == ["not priced"]
    assert "not priced: the policy is not 'auto'" in str(report)
    jax_cgx.calibrate()  # measured now: the same report is priced, with nothing more measured
    calls.clear()
    report = jax_cgx.explain(tree, world=W, config=config, op=op, file=None, **tiled)
    assert not calls and report.buffers[0].priced == "model" and report.buffers[0].psum_ms > 0


def test_gpu_codec_probe_times_batches_of_large_calls(monkeypatch):
    """Off the CPU the codec rates come from batches of calls on a large buffer (single small calls
    measured dispatch and a shared GPU's turns: a copy at 1.8 GB/s on an H100); on the CPU from
    single calls on 4 MiB, as validated there."""
    from jax_cgx._src.policy import probes

    calls = []
    assert probes._batched(lambda: calls.append(1) or len(calls), 4)() == 4 and len(calls) == 4

    seen = []

    def fake_put(x, device):
        seen.append(x.size)
        return x

    class Device:
        def __init__(self, platform):
            self.platform = platform

    batches = []
    monkeypatch.setattr(probes, "_GPU_CODEC_PROBE_VALUES", 4096)
    monkeypatch.setattr(probes.jax, "device_put", fake_put)
    monkeypatch.setattr(probes, "_batched", lambda fn, n: batches.append(n) or fn)
    gpu = probes.measure_rates(Device("gpu"))
    cpu = probes.measure_rates(Device("cpu"))
    assert seen == [4096, probes._CODEC_PROBE_VALUES]
    assert batches == [probes._GPU_CODEC_BATCH] * 3 + [1] * 3
    assert all(r > 0 for r in (gpu.quantize, gpu.dequantize, gpu.add, cpu.quantize, cpu.dequantize, cpu.add))


# ------------------------------------------------------------------ forms over nodes (issue 48)

_MEASURED = "measured over 8 devices"


def _figures(link_gbps: float) -> pricing.Figures:
    rates = cost_model.CodecRates(quantize=20e9, dequantize=30e9, add=10e9)
    return pricing.Figures(cost_model.LinkModel(link_gbps * 1e9 / 8, 1e-4), rates, "cpu", _MEASURED)


def _fake_machine(monkeypatch, *, link_gbps, inside_gbps, across_gbps, timed=None):
    """Figures, per-level links and (optionally) timings by form, all faked: nothing is measured."""
    fig = _figures(link_gbps)
    monkeypatch.setattr(pricing, "figures", lambda config=None, platform=None: fig)
    monkeypatch.setattr(pricing, "levels",
                        lambda fig, inner, measure=True: (inside_gbps * 1e9 / 8, across_gbps * 1e9 / 8))
    settled = []

    def settle(values, dtype, world, config, backend, fig, measure=True, op="psum", bodies=None, inner_world=None,
               rivals=()):
        if timed is None:
            return None
        settled.append((pricing.form_name(config), inner_world))
        return timed["psum"], timed[pricing.form_name(config)]

    monkeypatch.setattr(pricing, "_settle", settle)
    return settled


def test_forms_over_one_axis_and_over_nodes():
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    assert forms.forms(c, 8, None) == [c] and forms.forms(c, 8, 8) == [c] and forms.forms(c, 8, 1) == [c]
    over_nodes = forms.forms(c.replace(algorithm="ring"), 8, 4)
    assert over_nodes[0] == c.replace(algorithm="ring")  # the configured form first
    assert {pricing.form_name(f) for f in over_nodes} == {"sra", "ring", "hierarchical sra", "hierarchical ring"}
    # error feedback keeps the configured level
    assert {pricing.form_name(f) for f in forms.forms(c, 8, 4, residual=True)} == {"sra", "ring"}


def test_the_fastest_timed_form_is_chosen_and_logged(monkeypatch, caplog):
    times = {"psum": 0.800, "sra": 0.166, "ring": 0.154, "hierarchical sra": 0.183, "hierarchical ring": 0.190}
    settled = _fake_machine(monkeypatch, link_gbps=1, inside_gbps=11, across_gbps=0.5, timed=times)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        chosen = forms.choose_form([16 << 20], np.float32, 4, c, inner_world=2)
    assert pricing.form_name(chosen) == "ring" and chosen.policy == "auto" and chosen.bits == 4
    assert sorted(settled) == sorted((f, 2) for f in times if f != "psum")  # every form timed, on the nodes
    assert re.search(r"policy='auto': ring for 1 buffer.*nodes of 2.*sra \d.* ms measured.*hierarchical ring",
                     caplog.text)
    # within SWITCH_SPEEDUP of the configured form: the configured one stays
    times.update(ring=0.166 / 1.04)
    pricing.reset()
    assert forms.choose_form([16 << 20], np.float32, 4, c, inner_world=2) == c
    # no form compresses: the configured one stays (every buffer is psum'd anyway)
    times.update(psum=0.1)
    assert forms.choose_form([16 << 20], np.float32, 4, c, inner_world=2) == c


@pytest.mark.parametrize("fastest", ["hierarchical sra", "ring"])
def test_bytes_on_wire_over_nodes_count_the_form_auto_chose(monkeypatch, fastest):
    # What the all-reduce benchmark reports beside each timing: with inner_world given, the bytes
    # of the form the step runs (flat or hierarchical), not of a flat psum-or-not from the model.
    times = {"psum": 0.800, "sra": 0.3, "ring": 0.3, "hierarchical sra": 0.3, "hierarchical ring": 0.3, fastest: 0.1}
    _fake_machine(monkeypatch, link_gbps=1, inside_gbps=11, across_gbps=0.5, timed=times)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    chosen = forms.choose_form([1 << 20], np.float32, 4, c, inner_world=2)
    assert pricing.form_name(chosen) == fastest
    like = jax.ShapeDtypeStruct((1 << 20,), jnp.float32)
    always = chosen.replace(policy="always")
    assert bytes_on_wire(like, 4, c, inner_world=2) == bytes_on_wire(like, 4, always, inner_world=2)
    assert (bytes_on_wire(like, 4, always, inner_world=2) == bytes_on_wire(like, 4, c.replace(policy="always"))) == (
        fastest == "ring")  # the ring sends SRA's bytes; the hierarchical form sends more


@pytest.mark.parametrize("inside_gbps, expected", [(800, "hierarchical"), (2, "flat")])
def test_the_model_weighs_the_inside_of_a_node(monkeypatch, inside_gbps, expected):
    """Untimed (the model alone): a fast inside of a node (NVLink) makes hierarchical the fastest
    form across a 10 Gbit/s network; an inside as slow as the network makes it the slowest."""
    _fake_machine(monkeypatch, link_gbps=10, inside_gbps=inside_gbps, across_gbps=10 / 8)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    chosen = forms.choose_form([64 << 20], np.float32, 64, c, inner_world=8, measure=False)
    assert chosen.hierarchical == (expected == "hierarchical")
    hier = pricing.decide(64 << 20, np.float32, 64, c.replace(hierarchical=True), inner_world=8, measure=False,
                          log=False)
    flat = pricing.decide(64 << 20, np.float32, 64, c, inner_world=8, measure=False, log=False)
    assert (hier.compressed_s < flat.compressed_s) == (expected == "hierarchical")


def test_the_chosen_form_is_what_runs(monkeypatch):
    """make_plan re-keys an auto group to the chosen form: the reduction runs it, bitwise as the same
    form configured with policy='always'."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"))
    monkeypatch.setattr(forms, "choose_form",
                        lambda sizes, dtype, world, config, **kw: config.replace(algorithm="ring", hierarchical=True))
    monkeypatch.setattr(pricing, "decide", lambda values, dtype, world, config, **kw: pricing.Decision(True, 1.0, 0.1))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 5000)), jnp.float32)

    def run(config):
        body = lambda v: jax_cgx.compressed_psum(v[0], ("node", "local"), config)[None]  # noqa: E731
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("node", "local")),
                                                out_specs=P(("node", "local"))))(x))

    auto = run(jax_cgx.CompressionConfig(bits=4, bucket_size=64, policy="auto", min_size=16))
    assert_same_bits(auto, run(jax_cgx.CompressionConfig(bits=4, bucket_size=64, algorithm="ring", hierarchical=True, min_size=16)))
    assert not np.array_equal(auto, run(jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)))  # not flat SRA's bits
    # explain shows the form each buffer runs in
    report = jax_cgx.explain({"w": jnp.ones((5000,))}, config=jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16),
                             world=8, inner_world=4, file=None)
    assert [b.form for b in report.buffers] == ["hierarchical ring"] and "hierarchical ring" in str(report)


def test_forms_over_nodes_time_the_psum_once(monkeypatch):
    """Each form's compressed exchange is timed; the buffer's psum only with the first (the same op)."""
    fig = _figures(1)
    monkeypatch.setattr(pricing, "figures", lambda config=None, platform=None: fig)
    monkeypatch.setattr(pricing, "levels", lambda fig, inner, measure=True: (10e9 / 8, 0.5e9 / 8))
    calls = []

    def timing(devices, values, dtype, config, backend, bodies=None, inner=None, psum_s=None, rivals=()):
        calls.append((pricing.form_name(config), inner, psum_s))
        return (0.8 if psum_s is None else psum_s), 0.2

    monkeypatch.setattr(pricing, "_time_exchange", timing)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    forms.choose_form([1 << 16], np.float32, 8, c, inner_world=4)
    assert [f for f, _, _ in calls] == ["sra", "ring", "hierarchical sra", "hierarchical ring"]
    assert [(inner, psum) for _, inner, psum in calls] == [(4, None)] + [(4, 0.8)] * 3


def test_forms_of_one_buffer_share_its_psum_and_rivals_are_timed_together(monkeypatch, caplog):
    """Over one axis too, a second form of a timed buffer reuses its psum timing; forms a choice
    weighs (``rivals``) are timed in one interleaved call, each kept for its own lookup."""
    fig = _figures(1)
    calls = []

    def timing(devices, values, dtype, config, backend, bodies=None, inner=None, psum_s=None, rivals=()):
        calls.append((pricing.form_name(config), psum_s, [pricing.form_name(r) for r in rivals]))
        return (0.8 if psum_s is None else psum_s), 0.2, *(0.1 * (i + 1) for i in range(len(rivals)))

    monkeypatch.setattr(pricing, "_time_exchange", timing)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    one, ring = c.replace(pipeline_segments=1), c.replace(algorithm="ring")
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        assert pricing._settle(1 << 16, np.float32, W, c, "xla", fig, rivals=(c, one, one)) == (0.8, 0.2)
    assert calls == [("sra", None, ["sra, 1 message"])]  # itself and duplicates dropped from the rivals
    assert "compressed exchange on xla: sra 200 ms; sra, 1 message 100 ms)" in caplog.text
    assert pricing._settle(1 << 16, np.float32, W, one, "xla", fig, rivals=(c, one)) == (0.8, 0.1)  # kept
    assert len(calls) == 1
    assert pricing._settle(1 << 16, np.float32, W, ring, "xla", fig) == (0.8, 0.2)
    assert calls[1] == ("ring", 0.8, [])  # the psum of the same buffer, timed once
    assert pricing._settle(1 << 17, np.float32, W, ring, "xla", fig)[0] == 0.8 and calls[2][1] is None  # not another


def test_rival_forms_are_timed_in_the_same_runs():
    # The real probe over the 8 CPU devices: one psum and both compressed forms, each a positive time.
    devices = jax.devices()[:W]
    c = jax_cgx.CompressionConfig(bits=4, min_size=16)
    times = pricing._time_exchange(devices, 1 << 15, np.float32, c, "xla", rivals=(c.replace(pipeline_segments=1),))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert pricing._time_exchange(devices, 1 << 15, np.float32, c, "xla", psum_s=1.0,
                                  rivals=(c.replace(algorithm="ring"),))[0] == 1.0


def test_a_given_link_still_measures_the_inside_of_a_node(monkeypatch):
    # The user's rate is the network's: the inside of a node (loopback TCP between CPU processes,
    # NVLink on GPUs) is measured, once, without crossing the network, and prices the hierarchical
    # form. Here an inside as slow as 2 Gbit/s makes the flat form the choice (the 2x2 CPU machine
    # at 10 Gbit/s: hierarchical 90-115 ms, flat 54-64 ms, docs/multinode.md).
    from jax_cgx._src.policy import probes

    calls = []

    def fake(devices, inner, rates, share, across=True):
        calls.append((inner, across))
        return 2e9 / 8, (1e9 / 8 if across else None)

    monkeypatch.setattr(probes, "measure_levels", fake)
    given = dataclasses.replace(_figures(10), link_source="CompressionConfig.link_gbps")
    assert pricing.levels(given, 2, measure=False) is None
    assert pricing.levels(given, 2) == (2e9 / 8, None) and calls == [(2, False)]
    assert pricing.levels(given, 2) == (2e9 / 8, None) and calls == [(2, False)]  # measured once
    monkeypatch.setattr(pricing, "figures", lambda config=None, platform=None: given)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", link_gbps=10, min_size=16)
    assert not forms.choose_form([64 << 20], np.float32, 4, c.replace(hierarchical=True), inner_world=2).hierarchical


@pytest.fixture
def gloo_messages(monkeypatch):
    """Messages cut as on CPU with several processes (256 KiB), here where one process runs."""
    monkeypatch.setattr(forms._wire, "message_cap", lambda platforms, link_gbps=None: 256 * 1024)


@pytest.mark.parametrize("one_s, expected", [(0.052, 1), (0.143, 0)])
def test_auto_times_one_message_against_the_default_cut(monkeypatch, caplog, gloo_messages, one_s, expected):
    # The 2x2 CPU nodes at 10 Gbit/s: 9 messages of at most 256 KiB 95 ms, one 52 ms; at 1 Gbit/s on
    # 2 processes 16 messages 90 ms, one 143 (docs/multinode.md). The model does not price gloo's
    # large messages, so only a timing of both moves a group to one message.
    settled = _fake_machine(monkeypatch, link_gbps=10, inside_gbps=11, across_gbps=5,
                            timed={"psum": 0.8, "sra": 0.095, "sra, 1 message": one_s})
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        chosen = forms.choose_form([1 << 20, 16 << 20], np.float32, 4, c)
    assert chosen == c.replace(pipeline_segments=expected) and chosen.pipeline_segments == expected
    assert [f for f, _ in settled] == ["sra", "sra, 1 message"]  # the largest buffer, both ways
    what = "one message per collective" if expected else "messages cut by size"
    assert re.search(rf"policy='auto': {what} for a 64 MiB float32 buffer over 4 ranks \(sra: timed 95 ms in "
                     rf"messages of at most 256 KiB, {one_s * 1e3:.3g} ms in one", caplog.text)


def test_one_message_only_where_the_default_cut_is_unsure(monkeypatch, gloo_messages):
    times = {"psum": 0.8, "sra": 0.095, "sra, 1 message": 0.05, "ring, 1 message": 0.04,
             "hierarchical sra, 1 message": 0.2, "hierarchical ring, 1 message": 0.2}
    settled = _fake_machine(monkeypatch, link_gbps=10, inside_gbps=11, across_gbps=5, timed=times)
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    for kept in [c.replace(link_gbps=10.0), c.replace(pipeline_segments=4)]:  # sized to the link, or by the user
        assert forms.choose_form([16 << 20], np.float32, 4, kept) == kept
    assert forms.choose_form([1 << 12], np.float32, 4, c) == c  # one message already
    assert forms.choose_form([16 << 20], np.float32, 4, c, backend="tcp") == c  # its own segments
    assert settled == []
    monkeypatch.setattr(forms._wire, "message_cap", lambda platforms, link_gbps=None: None)  # one process, GPU
    assert forms.choose_form([16 << 20], np.float32, 4, c) == c and settled == []
    # over nodes: the messages (timed on the configured form), then the fastest form sent so
    monkeypatch.setattr(forms._wire, "message_cap", lambda platforms, link_gbps=None: 256 * 1024)
    settled.clear()
    assert forms.choose_form([16 << 20], np.float32, 4, c, inner_world=2) == c.replace(algorithm="ring",
                                                                                      pipeline_segments=1)
    assert [f for f, _ in settled] == ["sra", "sra, 1 message", "sra, 1 message", "ring, 1 message",
                                       "hierarchical sra, 1 message", "hierarchical ring, 1 message"]
    # cut, no form beats psum; in one message it does (2x2 at 10 Gbit/s, 8 bits: psum 134 ms, cut 168,
    # one message 75): the messages are timed whatever the cut form's price
    times.update(psum=0.134, sra=0.168, **{"sra, 1 message": 0.075, "ring, 1 message": 0.075})
    pricing.reset()
    chosen = forms.choose_form([16 << 20], np.float32, 4, c.replace(bits=8), inner_world=2)
    assert chosen == c.replace(bits=8, pipeline_segments=1)
    assert pricing.decide(16 << 20, np.float32, 4, chosen, inner_world=2, log=False).compress


def test_messages_are_not_timed_where_a_timing_would_take_too_long(monkeypatch, gloo_messages):
    # A buffer whose psum is predicted at a second or more (here 1 GiB at 1 Gbit/s) is not timed
    # twice more for its messages: the default cut stays.
    settled = _fake_machine(monkeypatch, link_gbps=1, inside_gbps=11, across_gbps=1,
                            timed={"psum": 20.0, "sra": 2.0, "sra, 1 message": 1.0})
    c = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)
    assert forms.choose_messages([1 << 28], np.float32, 4, c) == c and settled == []
