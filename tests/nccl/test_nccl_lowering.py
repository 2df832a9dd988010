"""The CUDA lowering of compressed_psum: the nccl backend's custom call, checked by
cross-lowering on a machine without a GPU (the custom call itself runs in
tests/nccl/test_nccl_gpu.py)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig, nccl
from jax_cgx._src import backends, extensions
from jax_cgx._src.nccl import backend as nccl_backend

pytestmark = pytest.mark.skipif(
    not (extensions.cuda_extension_available() and extensions.cuda().nccl_compiled()),
    reason="CUDA extension with the nccl backend not built",
)


def _lower(config, n=10_001, rows=None, monkeypatch=None, key=None):
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])

    def body(v):
        if rows is None:
            return jax_cgx.compressed_psum(v[0], "d", config, key=key)[None]
        return jax.vmap(lambda r: jax_cgx.compressed_psum(r, "d", config, key=key))(v[0])[None]

    shape = (4, n) if rows is None else (4, rows, n)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("d")))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def cuda_mesh(monkeypatch):
    """Pretend the mesh's CPU devices are GPUs: the nccl backend accepts them while tracing
    (the programs are then cross-lowered for CUDA)."""
    monkeypatch.setattr(backends.get("nccl"), "platforms", frozenset({"cuda", "cpu"}))


@pytest.fixture
def communicators(cuda_mesh, monkeypatch):
    """...and pretend jax_cgx.nccl.setup ran for them: every lookup finds family key 1234."""
    monkeypatch.setattr(nccl_backend.registry.connected, "find", lambda mesh, axes: (1234, ""))


def test_nccl_backend_lowers_to_one_custom_call_per_buffer(communicators):
    hlo = _lower(CompressionConfig(bits=4, bucket_size=64, pipeline_segments=3, backend="nccl", min_size=16))
    calls = re.findall(r"custom_call @jax_cgx_nccl_allreduce\(", hlo)
    assert len(calls) == 1, hlo
    assert "comm_key = 1234" in hlo and "segments = 3" in hlo and "world = 4" in hlo
    assert "has_side_effect = true" in hlo  # a collective: never dropped or merged by XLA
    # no XLA collective carries the buffer
    assert "all_to_all" not in hlo and "all_gather" not in hlo


def test_vmapped_rows_are_one_call_each(communicators):
    hlo = _lower(CompressionConfig(bits=8, backend="nccl", min_size=16), rows=3)
    assert len(re.findall(r"custom_call @jax_cgx_nccl_allreduce\(", hlo)) == 3


def test_xla_backend_and_auto_without_communicators_use_collectives(communicators):
    hlo = _lower(CompressionConfig(bits=4, backend="xla", min_size=16))
    assert "jax_cgx_nccl_allreduce" not in hlo and "all_to_all" in hlo


def test_auto_takes_the_communicators(communicators):
    """Where jax_cgx.nccl.setup connected the axes, auto runs the nccl backend (level with the xla
    backend on an H100 since one segment: docs/gpu-results.md)."""
    hlo = _lower(CompressionConfig(bits=4, backend="auto", min_size=16))
    assert len(re.findall(r"custom_call @jax_cgx_nccl_allreduce\(", hlo)) == 1
    assert "all_to_all" not in hlo


def test_auto_passing_a_backend_over_warns_once(communicators, monkeypatch, caplog):
    """A backend that auto passes over (Backend.passed_over_by_auto) runs xla even where its
    communicators exist, and says so once per axes (a user who called setup learns why it is unused)."""
    from jax_cgx._src.backends import protocol

    monkeypatch.setattr(protocol, "_warned", set())
    monkeypatch.setattr(backends.get("nccl"), "passed_over_by_auto", "measured slower here")
    with caplog.at_level("WARNING", logger="jax_cgx"):
        hlo = _lower(CompressionConfig(bits=4, backend="auto", min_size=16))
        _lower(CompressionConfig(bits=8, backend="auto", min_size=16))
    assert "jax_cgx_nccl_allreduce" not in hlo and "all_to_all" in hlo
    warnings = [r.getMessage() for r in caplog.records if "backend='auto' runs the xla backend" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "axes 'd'" in warnings[0] and "measured slower here" in warnings[0] and "backend='nccl'" in warnings[0]


def test_auto_without_communicators_is_xla_and_nccl_raises(cuda_mesh):
    assert "jax_cgx_nccl_allreduce" not in _lower(CompressionConfig(bits=4, backend="auto", min_size=16))
    with pytest.raises(nccl.NcclError, match=r"jax_cgx\.nccl\.setup"):
        _lower(CompressionConfig(bits=4, backend="nccl", min_size=16))


def test_nccl_backend_on_cpu_raises():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", CompressionConfig(backend="nccl", min_size=16))[None],
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    with pytest.raises(Exception, match="CUDA GPUs only"):
        f.lower(jax.ShapeDtypeStruct((4, 1000), jnp.float32, sharding=NamedSharding(mesh, P("d"))))


@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_workspace_plan(algorithm):
    # 64 MiB f32 over 4 ranks at 4 bits: every region of the plan fits, segments by size
    n = 16 << 20
    chunk = n // 4
    ws, segments = nccl_backend.workspace_bytes(n, 4, chunk, 4, 512, jnp.float32, algorithm, 0)
    assert segments == 1  # 16 MiB chunks: one 16 MiB segment each
    encoded = chunk // 2 + (chunk // 512) * 8  # payload + metadata of one chunk
    slots = (4 + 4 + 4) if algorithm == "sra" else (2 + 1 + 4)
    assert slots * encoded <= ws <= slots * encoded + 64 * 1024 + 4 * 4 * chunk
    ws3, s3 = nccl_backend.workspace_bytes(n, 4, chunk, 4, 512, jnp.float32, algorithm, 3)
    assert s3 == 3
    with pytest.raises(RuntimeError, match="bits must be in 1..8"):
        nccl_backend.workspace_bytes(n, 4, chunk, 9, 512, jnp.float32, algorithm, 0)
    with pytest.raises(RuntimeError, match="does not cut"):
        nccl_backend.workspace_bytes(n, 4, chunk - 1, 4, 512, jnp.float32, algorithm, 0)


def test_nccl_library_loads_where_installed():
    """CI installs nvidia-nccl-cu13: the library loads (no GPU needed to dlopen it)."""
    try:
        version = nccl.load()
    except nccl.NcclNotFoundError as err:
        pytest.skip(f"NCCL not installed here: {err}")
    assert version >= 21300


# ------------------------------------------------------------ reduce-scatter and all-gather

def _lower_sharded(op, config, m=2_500, rows=None, key=None, return_residual=False):
    """compressed_psum_scatter (tiled, each rank's [4 * m] -> [m]) or compressed_all_gather
    ([m] -> [4, m]) over 4 devices, cross-lowered for CUDA."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])

    def one(v):
        if op == "psum_scatter":
            out = jax_cgx.compressed_psum_scatter(v, "d", config, tiled=True, key=key, return_residual=return_residual)
            return out[0] if return_residual else out
        return jax_cgx.compressed_all_gather(v, "d", config, key=key)

    def body(v):
        return (one(v[0]) if rows is None else jax.vmap(one)(v[0]))[None]

    n = 4 * m if op == "psum_scatter" else m
    shape = (4, n) if rows is None else (4, rows, n)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("d")))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


_TARGETS = {"psum_scatter": "jax_cgx_nccl_reduce_scatter", "all_gather": "jax_cgx_nccl_all_gather"}


@pytest.mark.parametrize("op", ["psum_scatter", "all_gather"])
def test_sharded_collectives_lower_to_one_custom_call_per_buffer(communicators, op):
    hlo = _lower_sharded(op, CompressionConfig(bits=4, bucket_size=64, pipeline_segments=3, backend="nccl", min_size=16))
    assert len(re.findall(rf"custom_call @{_TARGETS[op]}\(", hlo)) == 1, hlo
    assert "comm_key = 1234" in hlo and "segments = 3" in hlo and "world = 4" in hlo
    assert "has_side_effect = true" in hlo
    assert "all_to_all" not in hlo and "all_gather\"" not in hlo and "stablehlo.all_gather" not in hlo
    # vmapped rows: one call each; backend="xla": XLA's collectives, no custom call
    rows = _lower_sharded(op, CompressionConfig(bits=8, backend="nccl", min_size=16), rows=3)
    assert len(re.findall(rf"custom_call @{_TARGETS[op]}\(", rows)) == 3
    assert _TARGETS[op] not in _lower_sharded(op, CompressionConfig(bits=4, backend="xla", min_size=16))
    assert _TARGETS[op] in _lower_sharded(op, CompressionConfig(bits=4, backend="auto", min_size=16))  # auto takes them


@pytest.mark.parametrize("op", ["psum_scatter", "all_gather"])
def test_sharded_collectives_without_communicators(cuda_mesh, op):
    assert _TARGETS[op] not in _lower_sharded(op, CompressionConfig(bits=4, backend="auto", min_size=16))
    with pytest.raises(nccl.NcclError, match=r"jax_cgx\.nccl\.setup"):
        _lower_sharded(op, CompressionConfig(bits=4, backend="nccl", min_size=16))


def test_reduce_scatter_residual_is_xla_only(communicators, monkeypatch):
    # auto takes the communicators here: the residual alone sends it to xla.
    hlo = _lower_sharded("psum_scatter", CompressionConfig(bits=4, min_size=16), return_residual=True)
    assert "jax_cgx_nccl_reduce_scatter" not in hlo and "all_to_all" in hlo
    with pytest.raises(NotImplementedError, match="xla backend only"):
        _lower_sharded("psum_scatter", CompressionConfig(bits=4, backend="nccl", min_size=16), return_residual=True)


@pytest.mark.parametrize("op", ["psum_scatter", "all_gather"])
def test_sharded_nccl_backend_on_cpu_raises(op):
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    cfg = CompressionConfig(bits=4, backend="nccl", min_size=16)
    if op == "psum_scatter":
        fn = lambda v: jax_cgx.compressed_psum_scatter(v[0], "d", cfg, tiled=True)[None]  # noqa: E731
    else:
        fn = lambda v: jax_cgx.compressed_all_gather(v[0], "d", cfg)[None]  # noqa: E731
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    with pytest.raises(Exception, match="CUDA GPUs only"):
        f.lower(jax.ShapeDtypeStruct((4, 4000), jnp.float32, sharding=NamedSharding(mesh, P("d"))))


def test_sharded_workspace_plan():
    # 64 MiB f32 reduce-scattered over 4 ranks at 4 bits: W sent and W received slots of a 4 MiB-value block
    m = (16 << 20) // 4
    encoded = m // 2 + (m // 512) * 8
    ws, segments = nccl_backend.sharded_workspace_bytes("psum_scatter", m, 4, 4, 512, jnp.float32, 0)
    assert segments == 1 and 8 * encoded <= ws <= 8 * encoded + 64 * 1024
    ws, segments = nccl_backend.sharded_workspace_bytes("all_gather", m, 4, 4, 512, jnp.float32, 5)
    assert segments == 5 and 4 * encoded <= ws <= 4 * encoded + 64 * 1024
    with pytest.raises(RuntimeError, match="bits must be in 1..8"):
        nccl_backend.sharded_workspace_bytes("all_gather", m, 4, 0, 512, jnp.float32, 0)
    with pytest.raises(RuntimeError, match="world must be >= 2"):
        nccl_backend.sharded_workspace_bytes("psum_scatter", m, 1, 4, 512, jnp.float32, 0)
