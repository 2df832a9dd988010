"""compressed_psum(return_residual=True): the exact error-feedback residual, on 8 virtual CPU devices.

Three properties, for SRA, the ring and hierarchical reductions:
(a) the sum is bitwise the one compressed_psum computes without the residual;
(b) summed over the ranks, residual + result == sum of the inputs, up to float32 rounding
    (tolerance: ``allreduce_cases.residual_identity_error``);
(c) every value of a rank's residual is within half a quantization step (a full step with
    stochastic rounding) of the one quantization that rank ran on it
    (``allreduce_cases.residual_bound``, from the oracles' scales).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import (
    W,
    mesh_1d,
    mesh_2d,
    oracle,
    per_device,
    reduction_groups,
    residual_bound,
    residual_grid,
    residual_identity_error,
    ring_oracle,
)
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.codec import kernels
from jax_cgx._src.exchange.hierarchical import hierarchical_shard

KEY = jax.random.key(23)


def rows(n, w=W, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (w, n), jnp.float32)
    return np.asarray((x * jnp.logspace(-2, 1, n)).astype(dtype))


def mesh_of(w):
    return jax.make_mesh((w,), ("d",), devices=jax.devices()[:w], axis_types=(jax.sharding.AxisType.Explicit,))


def assert_identity(xs, out, residual, what=""):
    err, tol = residual_identity_error(xs, out, residual)
    assert np.all(err <= tol), f"{what}: sum_r residual + out != sum_r x; max excess {np.max(err - tol)}"


def assert_within_bound(config, xs, out, residual, key):
    """(c): each rank's residual against the quantization it ran (scales from the oracle)."""
    find = ring_oracle if config.algorithm == "ring" else oracle
    expected, scales, chunk = find(xs, config, key)[:3]
    assert_same_bits(out, expected, "collective vs single-program oracle")
    bound = residual_bound(config, scales, chunk, xs.shape[1])
    rounding = 2.0**-22 * (np.abs(np.asarray(xs, np.float64)).sum(0) + np.abs(np.asarray(out, np.float64)))
    excess = np.abs(np.asarray(residual, np.float64)) - (bound * (1 + 1e-4) + rounding)
    assert np.all(excess <= 0), f"residual above half a quantization step by {excess.max()}"


CASES = [(a, b, s) for a in ("sra", "ring") for b in (2, 4, 8) for s in (False, True)]


@pytest.mark.parametrize(
    "algorithm,bits,stochastic", CASES, ids=[f"{a}-{b}bit-{'stoch' if s else 'near'}" for a, b, s in CASES]
)
def test_identity_and_bound(algorithm, bits, stochastic):
    n = 1003  # divisible by neither W nor the bucket: padding is dropped
    xs = rows(n, seed=bits)
    config = CompressionConfig(bits=bits, bucket_size=64, stochastic=stochastic, algorithm=algorithm, min_size=16)
    key = KEY if stochastic else None
    out, res, plain = residual_grid(xs, mesh_1d(), "d", config, key)
    assert_same_bits(out, plain, "(a) sum with vs without the residual")
    assert res.shape == xs.shape and res.dtype == xs.dtype
    assert_identity(xs, out[0], res, "(b)")
    assert_within_bound(config, xs, out[0], res, key)
    assert np.abs(res).max() > 0


@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_smaller_worlds(w, algorithm):
    xs = rows(700, w=w, seed=w)
    config = CompressionConfig(bits=3, bucket_size=32, algorithm=algorithm, stochastic=True, min_size=16)
    out, res, plain = residual_grid(xs, mesh_of(w), "d", config, KEY, check_vma=algorithm == "sra")
    assert_same_bits(out, plain)
    assert_identity(xs, out[0], res)
    assert_within_bound(config, xs, out[0], res, KEY)


def test_one_rank_is_exact_with_zero_residual():
    xs = rows(300, w=1)
    out, res, _ = residual_grid(xs, mesh_of(1), "d", CompressionConfig(bits=2, min_size=16))
    assert_same_bits(out, xs)
    assert not np.any(res)


@pytest.mark.parametrize("axes", [("a", "b"), "a", ("b", "a")])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_2d_mesh(axes, algorithm):
    names = ("a", "b")
    xs = np.asarray(jax.random.normal(jax.random.key(4), (4, 2, 900)))
    config = CompressionConfig(bits=4, bucket_size=64, algorithm=algorithm, min_size=16)
    out, res, plain = residual_grid(xs, mesh_2d((4, 2), names), axes, config)
    assert_same_bits(out, plain)
    for g_x, g_out, g_res in zip(*(reduction_groups(a, names, axes) for a in (xs, out, res))):
        assert_identity(g_x, g_out[0], g_res, f"axes={axes}")
        assert_within_bound(config, g_x, g_out[0], g_res, None)


@pytest.mark.parametrize("algorithm", ["sra", "ring"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_hierarchical(algorithm, stochastic):
    names = ("node", "local")
    n = 1003
    xs = np.asarray(jax.random.normal(jax.random.key(6), (4, 2, n)) * jnp.logspace(-1, 1, n))
    config = CompressionConfig(bits=2, bucket_size=64, algorithm=algorithm, stochastic=stochastic, hierarchical=True, min_size=16)
    out, res, plain = residual_grid(xs, mesh_2d((4, 2), names), names, config, KEY if stochastic else None)
    assert_same_bits(out, plain)
    assert_identity(xs.reshape(8, n), out[0, 0], res.reshape(8, n))
    # The outer exchange's residual sits on this rank's shard of the buffer, zeros elsewhere.
    shard = hierarchical_shard(n, 2, config)
    for local in range(2):
        inside = np.zeros(n, bool)
        inside[local * shard : (local + 1) * shard] = True
        assert not np.any(res[:, local, ~inside])
        assert np.any(res[:, local, inside])


def test_one_node_hierarchical_is_exact():
    names = ("node", "local")
    xs = np.asarray(jax.random.normal(jax.random.key(6), (1, 4, 500)))
    mesh = jax.make_mesh((1, 4), names, devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    out, res, plain = residual_grid(xs, mesh, names, CompressionConfig(bits=2, hierarchical=True, min_size=16))
    assert_same_bits(out, plain)
    assert not np.any(res)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_half_precision_inputs(dtype, algorithm):
    xs = rows(1000, dtype=dtype, seed=3)
    config = CompressionConfig(bits=4, bucket_size=128, algorithm=algorithm, min_size=16)
    out, res, plain = residual_grid(xs, mesh_1d(), "d", config)
    assert_same_bits(out, plain)
    assert res.dtype == xs.dtype
    assert_identity(xs, out[0], res)


def test_half_lane_residual_is_the_local_cast_error():
    xs = rows(500, seed=9)
    config = CompressionConfig(bits=16, min_size=16)
    out, res, plain = residual_grid(xs, mesh_1d(), "d", config)
    assert_same_bits(out, plain)
    cast_error = xs - np.asarray(jnp.asarray(xs).astype(jnp.bfloat16).astype(jnp.float32))
    assert_same_bits(res, cast_error)
    # The half-precision sum's own rounding is not attributable: the identity holds for the
    # bfloat16 values the ranks summed, up to bfloat16 rounding of the sum.
    np.testing.assert_allclose(out[0] + res.sum(0), xs.sum(0), rtol=2e-2, atol=2e-2)


def test_exact_lanes_and_skipped_tail_have_zero_residual():
    mesh = mesh_1d()
    xs = rows(1000, seed=2)
    for config in (CompressionConfig(bits=32), CompressionConfig(bits=4, min_size=2000)):
        out, res, plain = residual_grid(xs, mesh, "d", config)
        assert_same_bits(out, plain)
        assert not np.any(res)
    config = CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=True, min_size=16)
    out, res, plain = residual_grid(xs, mesh, "d", config)
    assert_same_bits(out, plain)
    head = 1000 // 64 * 64
    assert not np.any(res[:, head:]) and np.any(res[:, :head])
    assert_identity(xs, out[0], res)


def _tree_run(tree, config, check_vma=True):
    mesh = mesh_1d()

    def body(t):
        local = jax.tree.map(lambda v: v[0], t)
        out, res = jax_cgx.compressed_psum(local, "d", config, return_residual=True)
        plain = jax_cgx.compressed_psum(local, "d", config)
        return jax.tree.map(lambda v: v[None], (out, res, plain))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))
    return jax.tree.map(np.asarray, f(jax.tree.map(lambda v: per_device(v, mesh), tree)))


def test_pytree_with_mixed_lanes():
    tree = {
        "large": rows(3000, seed=1).reshape(W, 60, 50),
        "bf16": rows(700, dtype=jnp.bfloat16, seed=2),
        "half": rows(400, seed=3),
        "tiny": rows(5, seed=4),
        "count": np.arange(W * 3, dtype=np.int32).reshape(W, 3),
        "ring": rows(900, seed=5),
        "empty": np.zeros((W, 0), np.float32),
    }
    four = CompressionConfig(bits=4, bucket_size=64, fusion_buffer_mb=0.004, min_size=16)  # ~1000 f32 per buffer

    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        if "half" in name:
            return CompressionConfig(bits=16, min_size=16)
        if "ring" in name:
            return four.replace(algorithm="ring", stochastic=True)
        return four

    mesh = mesh_1d()

    def body(t, k):
        local = jax.tree.map(lambda v: v[0], t)
        out, res = jax_cgx.compressed_psum(local, "d", spec, key=k, return_residual=True)
        plain = jax_cgx.compressed_psum(local, "d", spec, key=k)
        return jax.tree.map(lambda v: v[None], (out, res, plain))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    out, res, plain = jax.tree.map(np.asarray, f(jax.tree.map(lambda v: per_device(v, mesh), tree), KEY))
    assert jax.tree.structure(res) == jax.tree.structure(tree)
    for name in tree:
        assert res[name].shape == tree[name].shape and res[name].dtype == tree[name].dtype, name
        assert_same_bits(out[name], plain[name], name)
    for name in ("large", "bf16", "ring"):
        w_x, w_res = tree[name].reshape(W, -1), res[name].reshape(W, -1)
        assert_identity(w_x, out[name][0].reshape(-1), w_res, name)
        assert np.any(w_res)
    for name in ("tiny", "count"):
        assert not np.any(res[name]), name
    cast_error = tree["half"] - np.asarray(jnp.asarray(tree["half"]).astype(jnp.bfloat16).astype(jnp.float32))
    assert_same_bits(res["half"], cast_error)


def test_pmean_returns_the_residual_of_the_sum():
    xs = rows(800, seed=8)
    config = CompressionConfig(bits=3, bucket_size=64, min_size=16)
    mesh = mesh_1d()
    s_out, s_res, _ = residual_grid(xs, mesh, "d", config)
    m_out, m_res, m_plain = residual_grid(xs, mesh, "d", config, mean=True)
    assert_same_bits(m_out, m_plain)
    assert_same_bits(m_out, s_out / W)
    assert_same_bits(m_res, s_res)


def test_typing_sum_invariant_residual_varying():
    """Under check_vma the sum is invariant (out_specs P()) and the residual varies per rank."""
    mesh = mesh_1d()
    xs = rows(640)
    config = CompressionConfig(bits=4, bucket_size=64, min_size=16)
    f = jax.jit(
        jax.shard_map(
            lambda x: jax_cgx.compressed_psum(x[0], "d", config, return_residual=True),
            mesh=mesh,
            in_specs=P("d"),
            out_specs=(P(), P("d")),
        )
    )
    out, res = f(per_device(xs, mesh))
    assert out.shape == (640,) and res.shape == (W * 640,)
    assert_identity(xs, np.asarray(out), np.asarray(res).reshape(W, 640))
    # An input invariant over the axis, typed varying (compressed_psum refuses it bare), is summed
    # W times, like psum; its residuals still add up.
    g = jax.jit(
        jax.shard_map(
            lambda x: jax_cgx.compressed_psum(jax.lax.pcast(x, "d", to="varying"), "d", config, return_residual=True),
            mesh=mesh,
            in_specs=P(),
            out_specs=(P(), P("d")),
        )
    )
    out, res = g(xs[0])
    assert_identity(np.broadcast_to(xs[0], (W, 640)), np.asarray(out), np.asarray(res).reshape(W, 640))


def test_vmap_over_a_non_reduced_axis():
    xs = np.asarray(jax.random.normal(jax.random.key(1), (W, 3, 500)))
    config = CompressionConfig(bits=4, bucket_size=50, algorithm="ring", min_size=16)
    mesh = mesh_1d()

    def run(f):
        body = lambda x: jax.tree.map(lambda v: v[None], f(x[0]))  # noqa: E731
        return jax.tree.map(
            np.asarray, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(per_device(xs, mesh))
        )

    reduce = lambda v: jax_cgx.compressed_psum(v, "d", config, return_residual=True)  # noqa: E731
    batched = run(jax.vmap(reduce))
    looped = run(lambda x: jax.tree.map(lambda *a: jnp.stack(a), *[reduce(x[i]) for i in range(3)]))
    assert_same_bits(batched[0], looped[0])
    assert_same_bits(batched[1], looped[1])
    for i in range(3):
        assert_identity(xs[:, i], batched[0][0, i], batched[1][:, i])


def test_vmap_over_the_reduced_axis_is_rejected():
    config = CompressionConfig(bits=4, min_size=16)
    with pytest.raises(NotImplementedError, match="vmapped axis 'i'"):
        jax.vmap(lambda v: jax_cgx.compressed_psum(v, "i", config, return_residual=True), axis_name="i")(
            jnp.ones((4, 100))
        )


def test_pmap():
    xs = rows(900, seed=4)
    config = CompressionConfig(bits=2, bucket_size=64, min_size=16)
    out, res = jax.pmap(lambda x: jax_cgx.compressed_psum(x, "i", config, return_residual=True), axis_name="i")(xs)
    out, res = np.asarray(out), np.asarray(res)
    assert_same_bits(out[0], oracle(xs, config)[0])
    assert_identity(xs, out[0], res)


def test_differentiating_raises():
    mesh = mesh_1d()
    config = CompressionConfig(bits=4, min_size=16)

    def body(x):
        return jax.grad(lambda v: jnp.sum(jax_cgx.compressed_psum(v, "d", config, return_residual=True)[1]))(x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    with pytest.raises(TypeError, match="cannot be differentiated"):
        f(per_device(rows(100).reshape(-1), mesh))


def test_nccl_backend_raises_on_cpu():
    config = CompressionConfig(bits=4, backend="nccl", min_size=16)
    with pytest.raises(NotImplementedError, match="computed by the xla backend only"):
        residual_grid(rows(100), mesh_1d(), "d", config)


@pytest.mark.skipif(not kernels.cuda_extension_available(), reason="CUDA extension not built")
def test_cuda_lowering_is_xla_and_nccl_raises(caplog):
    """Cross-lowered for CUDA: backend='auto' runs the xla program (and says why); 'nccl' raises."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.ShapeDtypeStruct((4, 1000), jnp.float32, sharding=NamedSharding(mesh, P("d")))

    def lower(backend):
        config = CompressionConfig(bits=4, backend=backend, min_size=16)
        body = lambda v: jax_cgx.compressed_psum(v[0], "d", config, return_residual=True)[1][None]  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

    with caplog.at_level("DEBUG", logger="jax_cgx"):
        hlo = lower("auto")
    assert "all_to_all" in hlo and "jax_cgx_nccl_allreduce" not in hlo
    assert "computed by the xla backend only" in caplog.text
    with pytest.raises(NotImplementedError, match="use backend='auto' or 'xla'"):
        lower("nccl")
