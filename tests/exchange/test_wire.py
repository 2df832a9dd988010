"""The xla backend's messages cut into segments (jax_cgx._src.exchange.wire): same bytes, same results."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import mesh_2d, psum_grid, residual_grid
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.exchange import wire

KEY = jax.random.key(5)


def test_count_rules():
    assert wire.count(0, 10 * 2**20, None) == 1  # no cap: one message
    assert wire.count(0, 256 * 1024, 256 * 1024) == 1
    assert wire.count(0, 256 * 1024 + 1, 256 * 1024) == 2
    assert wire.count(0, 2**30, 256 * 1024) == wire.MAX_SEGMENTS
    assert wire.count(5, 2**20, None) == 5  # asked for: exactly, cap or not
    assert wire.count(5, 3, 256 * 1024) == 3  # never an empty message
    assert wire.count(7, 0, None) == 1


@pytest.mark.parametrize("length,k", [(10, 1), (10, 3), (7, 7), (1000, 64)])
def test_cuts_cover_the_row(length, k):
    cuts = wire._cuts(length, k)
    assert len(cuts) == k and cuts[0][0] == 0 and cuts[-1][1] == length
    assert all(a < b for a, b in cuts) and all(b == a2 for (_, b), (a2, _) in zip(cuts, cuts[1:]))


def test_message_cap_by_platform(monkeypatch):
    assert wire.message_cap(["cuda"]) is None
    assert wire.message_cap(["cpu"]) is None  # one process: virtual devices share memory
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert wire.message_cap(["cpu"]) == wire.CPU_MESSAGE_BYTES
    assert wire.message_cap(["cpu", "cuda"]) is None


def test_message_cap_follows_a_given_link(monkeypatch):
    # 2 ms of the link: 250 kB at 1 Gbit/s, 2.5 MB at 10 (one message for a 2 MiB chunk); never
    # below 64 KiB; unlimited: one message. GPUs and one process: no cap, whatever the link.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert wire.message_cap(["cpu"], 1.0) == 250_000
    assert wire.message_cap(["cpu"], 10.0) == 2_500_000
    assert wire.count(0, 2 * 2**20 + 65536, wire.message_cap(["cpu"], 10.0)) == 1
    assert wire.message_cap(["cpu"], 0.01) == wire.MIN_MESSAGE_BYTES
    assert wire.message_cap(["cpu"], float("inf")) is None
    assert wire.message_cap(["cuda"], 1.0) is None
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert wire.message_cap(["cpu"], 1.0) is None


def test_the_given_link_reaches_every_primitive(monkeypatch):
    # config.link_gbps, else JAX_CGX_LINK_GBPS (a malformed one is ignored here: check_environment
    # warns, policy='auto' raises), is a parameter of each compressed primitive.
    from jax_cgx._src.config import given_link_gbps

    monkeypatch.delenv("JAX_CGX_LINK_GBPS", raising=False)
    assert given_link_gbps(CompressionConfig(min_size=16)) is None
    monkeypatch.setenv("JAX_CGX_LINK_GBPS", "10")
    assert given_link_gbps(CompressionConfig(min_size=16)) == 10.0
    assert given_link_gbps(CompressionConfig(link_gbps=1, min_size=16)) == 1.0
    monkeypatch.setenv("JAX_CGX_LINK_GBPS", "fast")
    assert given_link_gbps(CompressionConfig(min_size=16)) is None
    mesh = mesh_2d((8, 1))
    config = CompressionConfig(bits=4, min_size=16, link_gbps=25)  # the all-gather's 64 values compressed

    def body(v):
        v = v[0]
        return (jax_cgx.compressed_psum(v, "a", config)[None], jax_cgx.compressed_psum_scatter(v, "a", config, tiled=True)[None],
                jax_cgx.compressed_all_gather(v[:64], "a", config, tiled=True)[None])

    spec = P("a")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec))
    x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, spec))
    text = str(jax.jit(f).trace(x).jaxpr)
    assert text.count("link_gbps=25.0") == 3, text


@pytest.mark.parametrize("k", [1, 2, 5])
def test_segmented_collectives_move_the_same_bytes(k):
    mesh = mesh_2d((4, 2))
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (8, 1, 4, 37), dtype=np.uint8)  # [device, R, W, L] for W = 4 over "a"
    perm = [(i, (i + 1) % 4) for i in range(4)]

    def body(v):
        v = v[0]
        return (
            wire.all_to_all(v, "a", k)[None],
            wire.all_gather(v[:, 0], "a", k)[None],
            wire.ppermute(v, "a", perm, k)[None],
        )

    spec = P(("a", "b"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec)))
    got = f(jax.device_put(rows, NamedSharding(mesh, spec)))
    ref = jax.jit(jax.shard_map(lambda v: tuple(
        o[None] for o in (
            jax.lax.all_to_all(v[0], "a", 1, 1, tiled=True),
            jax.lax.all_gather(v[0][:, 0], "a", axis=1, tiled=False),
            jax.lax.ppermute(v[0], "a", perm),
        )), mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec)))(jax.device_put(rows, NamedSharding(mesh, spec)))
    for a, b in zip(got, ref):
        assert_same_bits(a, b, f"segments={k}")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_results_do_not_depend_on_segments(algorithm, stochastic):
    """Bitwise the same sums and residuals whether each message goes whole or in 3 or 64 pieces."""
    mesh = mesh_2d((4, 2))
    xs = np.asarray(jax.random.normal(jax.random.key(1), (4, 2, 3000)) * 3, np.float32)
    key = KEY if stochastic else None
    outs, residuals = [], []
    for segments in (1, 3, 64):
        config = CompressionConfig(bits=3, bucket_size=64, stochastic=stochastic, algorithm=algorithm,
                                   pipeline_segments=segments, min_size=0, backend="xla")
        outs.append(psum_grid(xs, mesh, ("a", "b"), config, key))
        residuals.append(residual_grid(xs, mesh, ("a", "b"), config, key)[1])
    for segments, out, res in zip((3, 64), outs[1:], residuals[1:]):
        assert_same_bits(out, outs[0], f"{algorithm} sum, segments={segments}")
        assert_same_bits(res, residuals[0], f"{algorithm} residual, segments={segments}")


def test_segments_in_the_program():
    """pipeline_segments=3 on the xla backend: three all-to-alls and three all-gathers."""
    mesh = mesh_2d((8,), ("d",))
    config = CompressionConfig(bits=4, pipeline_segments=3, min_size=0, backend="xla")
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config)[None], mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    hlo = f.lower(jax.ShapeDtypeStruct((8, 40000), jnp.float32, sharding=NamedSharding(mesh, P("d")))).as_text()
    assert len(re.findall(r"stablehlo\.all_to_all", hlo)) == 3
    assert len(re.findall(r"stablehlo\.all_gather", hlo)) == 3
