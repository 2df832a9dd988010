"""The tcp backend in one process: 8 virtual CPU devices, each with its own communicator
(TCP over loopback), bitwise against the xla backend. tests/tcp/test_tcp_processes.py runs
it across processes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src import extensions
from jax_cgx.tcp import TcpError

TARGET = "jax_cgx_tcp_allreduce"


@pytest.fixture(scope="module")
def mesh2d():
    mesh = device_mesh((2, 4), ("a", "b"))
    families = jax_cgx.tcp.setup(mesh)
    assert set(families) == {("a",), ("b",), ("a", "b")}
    yield mesh
    assert jax_cgx.tcp.teardown(mesh) == 3 * 8
    assert jax_cgx.tcp.lookup(mesh, "a") is None


def _reduce(mesh, axes, config, x, key=None, rows=False):
    spec = P(tuple(mesh.axis_names))

    def body(v):
        if rows:
            return jax.vmap(lambda r: jax_cgx.compressed_psum(r, axes, config, key=key))(v[0])[None]
        return jax_cgx.compressed_psum(v[0], axes, config, key=key)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(x, NamedSharding(mesh, spec))
    return f.lower(x).as_text(), np.asarray(f(x))


CASES = [
    # n, dtype, bits, bucket, stochastic, segments, axes
    (100_003, jnp.float32, 4, 512, False, 0, ("a", "b")),
    (100_003, jnp.float32, 4, 512, True, 7, ("a", "b")),
    (1, jnp.float32, 8, 512, True, 0, "b"),                 # chunks of padding only
    (1000, jnp.bfloat16, 3, 100, True, 5, "b"),           # tail chunks staged, short last bucket
    (77_777, jnp.float16, 2, 64, False, 64, "a"),
    (2_000_000, jnp.float32, 1, 1024, True, 0, ("a", "b")),  # by size: several segments
]


@pytest.mark.parametrize("n,dtype,bits,bucket,stochastic,segments,axes", CASES)
def test_bitwise_equal_to_xla_backend(mesh2d, n, dtype, bits, bucket, stochastic, segments, axes):
    x = jax.random.normal(jax.random.key(n), (8, n)).astype(dtype)
    config = CompressionConfig(bits=bits, bucket_size=bucket, stochastic=stochastic, pipeline_segments=segments,
                               min_size=0)
    key = jax.random.key(3) if stochastic else None
    hlo_xla, want = _reduce(mesh2d, axes, config.replace(backend="xla"), x, key)
    hlo_tcp, got = _reduce(mesh2d, axes, config.replace(backend="tcp"), x, key)
    assert TARGET not in hlo_xla and TARGET in hlo_tcp
    assert_same_bits(got, want, f"tcp vs xla, n={n}")
    hlo_auto, auto = _reduce(mesh2d, axes, config, x, key)  # set up: auto picks tcp
    assert TARGET in hlo_auto
    assert_same_bits(auto, want, "auto vs xla")


def test_rows_and_fusion_buffers(mesh2d):
    """vmapped rows: one custom call per row; several fusion buffers; every replica equal."""
    x = jax.random.normal(jax.random.key(0), (8, 3, 50_000))
    config = CompressionConfig(bits=4, bucket_size=256, stochastic=True, min_size=16)
    hlo, got = _reduce(mesh2d, ("a", "b"), config, x, jax.random.key(1), rows=True)
    assert hlo.count(f"@{TARGET}") >= 3
    _, want = _reduce(mesh2d, ("a", "b"), config.replace(backend="xla"), x, jax.random.key(1), rows=True)
    assert_same_bits(got, want, "rows")
    for i in range(1, 8):
        assert_same_bits(got[i], got[0], f"replica {i}")

    tree = {"w": jax.random.normal(jax.random.key(2), (8, 300_000)), "b": jnp.ones((8, 300))}
    spec = P(("a", "b"))
    small = CompressionConfig(bits=4, fusion_buffer_mb=0.5, min_size=16)  # three buffers for w

    def run(config):
        f = jax.jit(jax.shard_map(lambda t: jax.tree.map(lambda v: v[None], jax_cgx.compressed_pmean(
            jax.tree.map(lambda v: v[0], t), ("a", "b"), config)), mesh=mesh2d, in_specs=spec, out_specs=spec))
        x = jax.device_put(tree, NamedSharding(mesh2d, spec))
        return f.lower(x).as_text(), jax.tree.map(np.asarray, f(x))

    hlo, got = run(small)
    want = run(small.replace(backend="xla"))[1]
    for k in tree:
        assert_same_bits(got[k], want[k], k)
    # Chained: only the first call's `after` operand is the placeholder (4096 flops, so that XLA:CPU
    # never runs the program inline: a failure would then be a ValueError), and every call has its own site.
    calls = [line for line in hlo.splitlines() if f"@{TARGET}_start(" in line]
    assert len(calls) >= 3
    assert sum("tensor<4096xf32>) ->" in line for line in calls) == 1
    sites = [re.search(r"site = (\d+)", line).group(1) for line in calls]
    assert len(set(sites)) == len(sites)


def test_many_calls_pending_at_once(mesh2d):
    """40 reductions started before the first is done (as a backward pass over 40 layers does):
    each gets its own call record, and the results are the xla backend's."""
    spec = P(("a", "b"))
    leaves = [jax.random.normal(jax.random.key(i), (8, 3000 + 17 * i)) for i in range(40)]

    def run(config):
        def body(*vs):
            return tuple(jax_cgx.compressed_psum(v[0], ("a", "b"), config)[None] for v in vs)

        f = jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=spec, out_specs=spec))
        return [np.asarray(o) for o in f(*jax.device_put(leaves, NamedSharding(mesh2d, spec)))]

    for i, (got, want) in enumerate(zip(run(CompressionConfig(backend="tcp", min_size=16)), run(CompressionConfig(backend="xla", min_size=16)))):
        assert_same_bits(got, want, f"leaf {i}")


def test_gradient_through_the_tcp_backend(mesh2d):
    """The transpose of compressed_psum is compressed_psum: grad runs the custom call too."""
    spec = P(("a", "b"))
    x = jax.device_put(jax.random.normal(jax.random.key(5), (8, 4096)), NamedSharding(mesh2d, spec))

    def grad_of(config):
        def body(v):
            g = jax.grad(lambda u: jnp.sum(jnp.sin(jax_cgx.compressed_psum(u, ("a", "b"), config))))(v[0])
            return g[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=spec, out_specs=spec))
        return f.lower(x).as_text(), np.asarray(f(x))

    hlo, got = grad_of(CompressionConfig(bits=5, min_size=16))
    assert TARGET in hlo  # (forward and transpose may share one lowered function)
    assert_same_bits(got, grad_of(CompressionConfig(bits=5, backend="xla", min_size=16))[1], "gradient")


def test_auto_uses_xla_where_tcp_cannot_run(mesh2d):
    x = jax.random.normal(jax.random.key(0), (8, 10_000))
    hlo, _ = _reduce(mesh2d, ("a", "b"), CompressionConfig(algorithm="ring", min_size=16), x)
    assert TARGET not in hlo  # the ring runs on the xla backend
    hlo, _ = _reduce(device_mesh((8,), ("d",)), "d", CompressionConfig(min_size=16), x)  # a mesh nobody set up
    assert TARGET not in hlo
    with pytest.raises(TcpError, match="ring algorithm"):
        _reduce(mesh2d, ("a", "b"), CompressionConfig(algorithm="ring", backend="tcp", min_size=16), x)
    with pytest.raises(TcpError, match=r"jax_cgx\.tcp\.setup\(mesh\)"):
        _reduce(device_mesh((8,), ("d",)), "d", CompressionConfig(backend="tcp", min_size=16), x)


def test_error_feedback_residuals_run_on_xla(mesh2d):
    spec = P(("a", "b"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 10_000)), NamedSharding(mesh2d, spec))

    def lowered(config):
        body = lambda v: jax.tree.map(lambda o: o[None], jax_cgx.compressed_psum(  # noqa: E731
            v[0], ("a", "b"), config, return_residual=True))
        return jax.jit(jax.shard_map(body, mesh=mesh2d, in_specs=spec, out_specs=spec)).lower(x).as_text()

    assert TARGET not in lowered(CompressionConfig(min_size=16))
    with pytest.raises(NotImplementedError, match="error feedback"):
        lowered(CompressionConfig(backend="tcp", min_size=16))


def test_a_call_after_teardown_fails_instead_of_hanging():
    mesh = device_mesh((4,), ("d",)) if False else jax.make_mesh((4,), ("d",), devices=jax.devices()[4:],
                                                          axis_types=(jax.sharding.AxisType.Explicit,))
    jax_cgx.tcp.setup(mesh, timeout_s=30)
    assert {c.rank for c in jax_cgx.tcp.communicators() if c.key == jax_cgx.tcp.lookup(mesh, "d")} == {0, 1, 2, 3}
    x = jax.device_put(jnp.ones((4, 5000)), NamedSharding(mesh, P("d")))
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", CompressionConfig(backend="tcp", min_size=16))[None],
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    np.testing.assert_array_equal(np.asarray(f(x)), 4.0)
    assert jax_cgx.tcp.teardown(mesh) == 4
    with pytest.raises(Exception, match=r"no jax_cgx tcp communicator.*jax_cgx\.tcp\.setup"):
        jax.block_until_ready(f(x))
    jax_cgx.tcp.setup(mesh)  # again: a new generation of connections
    np.testing.assert_array_equal(np.asarray(f(x)), 4.0)
    assert jax_cgx.tcp.teardown(mesh) == 4


def test_segments_by_size_and_bad_arguments():
    segments = extensions.cpu().tcp_segments
    # 4 MiB of float32 input per chunk: 1 MiB segments; a tiny chunk: one.
    assert segments(8 << 20, 2, 4 << 20, 4, 512, 4, 0) == 16
    assert segments(1000, 2, 512, 4, 512, 4, 0) == 1
    assert segments(1 << 30, 2, 1 << 29, 4, 512, 4, 0) == 64
    assert segments(100_000, 2, 50_000, 4, 512, 4, 7) == 7
    assert segments(1000, 2, 512, 4, 512, 4, 9) == 1  # at most one per bucket
    with pytest.raises(ValueError, match="world must be >= 2"):
        segments(1000, 1, 1000, 4, 512, 4, 0)
    with pytest.raises(ValueError, match="segments must be in 0..64"):
        segments(1000, 2, 512, 4, 512, 4, 65)


def test_setup_checks_its_arguments(monkeypatch):
    mesh = device_mesh((8,), ("d",))
    with pytest.raises(ValueError, match="timeout must be > 0"):
        jax_cgx.tcp.setup(mesh, timeout_s=0)
    monkeypatch.setenv("JAX_CGX_TCP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAX_CGX_TCP_TIMEOUT_S='soon' is not a number"):
        jax_cgx.tcp.setup(mesh)
    for endless in ("inf", "nan", "1e300"):  # milliseconds of these overflow an int64
        monkeypatch.setenv("JAX_CGX_TCP_TIMEOUT_S", endless)
        with pytest.raises(ValueError, match="timeout must be > 0 and at most 1e\\+09 seconds"):
            jax_cgx.tcp.setup(mesh)
    monkeypatch.delenv("JAX_CGX_TCP_TIMEOUT_S")
    with pytest.raises(ValueError, match="not axes of the mesh"):
        jax_cgx.tcp.setup(mesh, "model", timeout_s=5)
    assert jax_cgx.tcp.setup(device_mesh((1,), ("d",)) if False else jax.make_mesh(
        (1,), ("d",), devices=jax.devices()[:1]), timeout_s=5) == {}  # one device: nothing to connect


def test_hierarchical_runs_its_outer_exchange_on_tcp(mesh2d):
    x = jax.random.normal(jax.random.key(4), (8, 100_000))
    config = CompressionConfig(bits=4, hierarchical=True, min_size=16)
    hlo, got = _reduce(mesh2d, ("a", "b"), config, x)
    assert f"@{TARGET}_start(" in hlo
    assert_same_bits(got, _reduce(mesh2d, ("a", "b"), config.replace(backend="xla"), x)[1], "hierarchical")


def test_pmap_over_a_mesh_that_was_set_up():
    """pmap lowers inside a mesh of its devices and axis name: set that mesh up and pmap uses tcp."""
    devices = jax.devices()
    jax_cgx.tcp.setup(jax.sharding.Mesh(np.array(devices), ("i",)))
    try:
        y = np.random.default_rng(0).standard_normal((8, 5000)).astype(np.float32)

        def run(backend):
            config = CompressionConfig(bits=4, backend=backend, min_size=16)
            return np.asarray(jax.pmap(lambda v: jax_cgx.compressed_psum(v, "i", config), axis_name="i")(y))

        assert_same_bits(run("tcp"), run("xla"), "pmap")
    finally:
        jax_cgx.tcp.teardown(jax.sharding.Mesh(np.array(devices), ("i",)))


def test_a_loopback_route_to_the_coordinator_is_not_published(monkeypatch):
    """On the coordinator's host its name may resolve to 127.0.1.1 (Debian's /etc/hosts); peers on
    other hosts cannot reach that: the default route's interface is published instead."""
    from jax._src import distributed as jax_distributed

    from jax_cgx._src.tcp import lifecycle

    monkeypatch.delenv("JAX_CGX_TCP_HOST", raising=False)
    monkeypatch.setattr(lifecycle.jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax_distributed.global_state, "coordinator_address", "node0:1234")
    routes = {"node0": "127.0.1.1", "192.0.2.1": "10.1.2.3"}
    monkeypatch.setattr(lifecycle, "_route_to", routes.get)
    assert lifecycle.host_address() == "10.1.2.3"
    routes["node0"] = "10.9.9.9"  # another host's coordinator: the route to it, as before
    assert lifecycle.host_address() == "10.9.9.9"
    monkeypatch.setattr(jax_distributed.global_state, "coordinator_address", "127.0.0.1:1234")
    routes["127.0.0.1"] = "127.0.0.1"  # a coordinator on loopback: every process is on this host
    assert lifecycle.host_address() == "127.0.0.1"
