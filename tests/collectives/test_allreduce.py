"""compressed_psum / compressed_pmean on 8 virtual CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import (
    W,
    exact_psum,
    half_psum_bound,
    mesh_1d,
    oracle,
    per_device,
    psum_1d,
    psum_1d_jit,
    sra_bound,
    sra_window_bound,
)
from bitwise import assert_same_bits
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx import CompressionConfig

KEY = jax.random.key(7)


def rows(n, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (W, n), jnp.float32)
    return (x * jnp.logspace(-2, 1, n)).astype(dtype)


def assert_replicas_identical(out):
    out = np.asarray(out)
    for i in range(1, out.shape[0]):
        assert_same_bits(out[i], out[0], f"replica {i} vs replica 0")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_replicas_identical_oracle_and_bound(bits, stochastic):
    n = 1000 + 3  # divisible by neither W nor the bucket
    xs = rows(n, seed=bits)
    config = CompressionConfig(bits=bits, bucket_size=64, stochastic=stochastic, min_size=16)
    mesh = mesh_1d()
    out = psum_1d(per_device(xs, mesh), KEY, config)
    assert_replicas_identical(out)
    expected, scales, chunk = oracle(xs, config, KEY if stochastic else None)
    assert_same_bits(out[0], expected, "collective vs single-program oracle")
    err, bound = sra_bound(xs, out[0], config)  # scales from the data
    assert np.all(err <= bound), f"bits={bits}: max excess {np.max(err - bound)}"


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_rounding_to_nearest_draws_no_seeds_from_a_given_key(op):
    """A key passed with stochastic=False leaves no PRNG in the program (the seeds are zeros, which
    nearest rounding never reads); with stochastic=True the key's seeds are drawn. The bytes are
    the keyless run's: test_replicas_identical_oracle_and_bound passes the key to nearest rounding
    and compares with the keyless oracle."""
    call = {"psum": lambda x, c, k: jax_cgx.compressed_psum(x, "d", c, key=k),
            "psum_scatter": lambda x, c, k: jax_cgx.compressed_psum_scatter(x, "d", c, tiled=True, key=k),
            "all_gather": lambda x, c, k: jax_cgx.compressed_all_gather(x, "d", c, key=k)}[op]
    xs = per_device(rows(W * 256), mesh_1d())
    for stochastic in (False, True):
        config = CompressionConfig(bits=4, bucket_size=64, min_size=16, stochastic=stochastic)
        body = jax.shard_map(lambda x, k, c=config: call(x[0], c, k)[None], mesh=mesh_1d(),
                             in_specs=(P("d"), P()), out_specs=P("d"))
        text = jax.jit(body).lower(xs, KEY).as_text()
        assert ("threefry" in text) == stochastic, f"{op} stochastic={stochastic}"


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_kernel_and_reference_backends_agree(impl):
    xs = rows(4099)
    config = CompressionConfig(bits=3, bucket_size=128, min_size=16)
    mesh = mesh_1d()
    out = psum_1d(per_device(xs, mesh), KEY, config, impl=impl)
    assert_same_bits(out[0], oracle(xs, config)[0])


@pytest.mark.parametrize("check_vma", [True, False])
def test_pmean_is_psum_over_world(check_vma):
    xs = rows(777)
    config = CompressionConfig(bits=4, bucket_size=32, min_size=16)
    mesh = mesh_1d()
    s = psum_1d(per_device(xs, mesh), KEY, config, check_vma=check_vma)
    m = psum_1d(per_device(xs, mesh), KEY, config, check_vma=check_vma, mean=True)
    assert_same_bits(m, s / W)
    assert_replicas_identical(m)


@pytest.mark.parametrize("world", [3, 6])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_pmean_divides_in_the_decode_as_jit_divides(world, algorithm):
    """compressed_pmean divides where the sum is decoded: bitwise ``jit(psum / W)`` for float32
    (XLA multiplies by float32(1/W)), and for bfloat16/float16 the float32 quotient rounded once
    (the same values summed as float32 give the unrounded sum). Worlds that are not powers of two,
    where 1/W is inexact. A skipped tail and an exact leaf are ``lax.pmean``'s: the 16-bit psum
    divided in its dtype. (The reference decode scales as the kernel does: tests/codec/test_codec.py.)"""
    mesh = jax.make_mesh((world,), ("d",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    config = CompressionConfig(bits=3, bucket_size=64, algorithm=algorithm, min_size=0,
                               skip_incomplete_buckets=True)
    x = jax.random.normal(jax.random.key(world), (world, 4099)) * jnp.logspace(-3, 2, 4099)

    def run(fn, values):
        tree = {"q": values, "exact": values[:, :5]}
        configs = {"q": config, "exact": None}
        body = lambda t: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], t), "d", configs))  # noqa: E731
        sharded = jax.device_put(tree, jax.sharding.NamedSharding(mesh, P("d")))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(sharded)

    divide = jax.jit(lambda t: jax.tree.map(lambda v: v / world, t))
    head = 4099 // 64 * 64  # the skipped tail's values follow
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        values = x.astype(dtype)
        mean = run(jax_cgx.compressed_pmean, values)
        after_psum = divide(run(jax_cgx.compressed_psum, values))  # in the leaves' dtype
        in_decode = jax.tree.map(lambda v: v.astype(dtype), divide(run(jax_cgx.compressed_psum,
                                                                      values.astype(jnp.float32))))
        what = np.dtype(dtype).name
        assert_replicas_identical(mean["q"])
        assert_same_bits(mean["q"][:, :head], in_decode["q"][:, :head], f"{what}: the compressed values")
        assert_same_bits(mean["q"][:, head:], after_psum["q"][:, head:], f"{what}: the skipped tail")
        assert_same_bits(mean["exact"], after_psum["exact"], f"{what}: the exact leaf")


def test_bits_32_is_exactly_psum_and_bits_16_is_half_psum():
    """Same program as lax.psum (and as a bfloat16 psum), not merely close to it."""
    mesh = mesh_1d()
    xs = per_device(rows(300), mesh)

    def jaxpr(f):
        body = lambda x: f(x[0])[None]  # noqa: E731
        return str(jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(xs))

    exact = lambda v: jax.lax.psum(v, "d")  # noqa: E731
    half = lambda v: jax.lax.psum(v.astype(jnp.bfloat16), "d").astype(v.dtype)  # noqa: E731
    assert jaxpr(lambda v: jax_cgx.compressed_psum(v, "d", CompressionConfig(bits=32))) == jaxpr(exact)
    assert jaxpr(lambda v: jax_cgx.compressed_psum(v, "d", CompressionConfig(bits=16, min_size=16))) == jaxpr(half)
    out = psum_1d(xs, KEY, CompressionConfig(bits=16, min_size=16))
    assert_replicas_identical(out)
    # Each value cast to bfloat16, summed in bfloat16: the bound from the data (its worst case,
    # W roundings of sum |x|, is above the old empirical tolerance at the largest sums, which stays).
    err, bound = half_psum_bound(rows(300), out[0], jnp.bfloat16)
    assert np.all(err <= bound), float(np.max(err - bound))
    np.testing.assert_allclose(out[0], np.asarray(rows(300), np.float64).sum(0), rtol=0.02, atol=0.05)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_bits_16_half_dtype(half):
    """bits=16 with half_dtype: lax.psum of the values cast to that dtype, to the bit (which pins the
    dtype: float16 and bfloat16 sums differ), and within that dtype's rounding bound."""
    mesh = mesh_1d()
    xs = rows(300)
    dtype = jnp.dtype(half)
    out = psum_1d(per_device(xs, mesh), KEY, CompressionConfig(bits=16, half_dtype=half, min_size=16))
    assert out.dtype == np.float32
    assert_replicas_identical(out)
    body = lambda x: jax.lax.psum(x[0].astype(dtype), "d").astype(jnp.float32)[None]  # noqa: E731
    ref = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(per_device(xs, mesh))
    assert_same_bits(out, np.asarray(ref), f"bits=16 in {half}")
    err, bound = half_psum_bound(xs, out[0], dtype)
    assert np.all(err <= bound), float(np.max(err - bound))
    # A float16 leaf too: the result keeps the leaf's dtype.
    out16 = psum_1d(per_device(xs.astype(jnp.float16), mesh), KEY, CompressionConfig(bits=16, half_dtype=half, min_size=16))
    assert out16.dtype == np.float16
    err, bound = half_psum_bound(np.asarray(xs.astype(jnp.float16)), out16[0], dtype)
    assert np.all(err <= bound + 2.0**-11 * np.abs(out16[0].astype(np.float64))), float(np.max(err - bound))


def test_deterministic_across_runs():
    xs = rows(5000)
    mesh = mesh_1d()
    config = CompressionConfig(bits=2, bucket_size=100, stochastic=True, min_size=16)
    a = psum_1d(per_device(xs, mesh), KEY, config)
    b = psum_1d(per_device(xs, mesh), KEY, config)
    assert_same_bits(a, b)
    c = psum_1d(per_device(xs, mesh), jax.random.key(8), config)
    assert not np.array_equal(np.asarray(a), np.asarray(c)), "another key rounds differently"


def test_skip_incomplete_buckets_reduces_the_tail_exactly():
    xs = rows(1000)
    config = CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=True, min_size=16)
    mesh = mesh_1d()
    out = psum_1d(per_device(xs, mesh), KEY, config)
    assert_replicas_identical(out)
    tail = 1000 % 64
    exact_tail = np.asarray(exact_psum(per_device(xs, mesh)))[-tail:]
    np.testing.assert_allclose(out[0, -tail:], exact_tail, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- transforms


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_like_psum(check_vma):
    xs = rows(640)
    config = CompressionConfig(bits=8, bucket_size=64, min_size=16)
    mesh = mesh_1d()
    weights = jnp.linspace(-1, 1, 640)

    def loss(reduce, x):
        return jnp.sum(reduce(x) * weights)

    def grads(reduce):
        body = lambda x: jax.grad(lambda v: loss(reduce, v))(x[0])[None]  # noqa: E731
        return np.asarray(
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))(
                per_device(xs, mesh)
            )
        )

    g = grads(lambda v: jax_cgx.compressed_psum(v, "d", config))
    g_ref = grads(lambda v: jax.lax.psum(v, "d"))
    assert g.shape == g_ref.shape
    if check_vma:
        # The cotangent of an invariant sum flows back unchanged (pvary), exactly as for psum.
        assert_same_bits(g, g_ref)
    else:
        # Without vma typing psum transposes to psum of the cotangents; ours to a compressed one.
        # Every rank's cotangent is `weights`: SRA's bound for W copies of it (was: atol 0.16).
        err, bound = sra_bound(np.tile(np.asarray(weights), (W, 1)), g[0], config)
        assert np.all(err <= bound), float(np.max(err - bound))
        assert_replicas_identical(g)


def test_vmap_over_a_non_reduced_axis():
    xs = jax.random.normal(jax.random.key(1), (W, 3, 500))
    config = CompressionConfig(bits=4, bucket_size=50, min_size=16)
    mesh = mesh_1d()

    def run(f):
        return np.asarray(
            jax.jit(jax.shard_map(lambda x: f(x[0])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
                per_device(xs, mesh)
            )
        )

    batched = run(jax.vmap(lambda v: jax_cgx.compressed_psum(v, "d", config)))
    looped = run(lambda x: jnp.stack([jax_cgx.compressed_psum(x[i], "d", config) for i in range(3)]))
    assert_same_bits(batched, looped)


def test_vmap_over_the_reduced_axis_is_rejected():
    config = CompressionConfig(bits=4, min_size=16)
    with pytest.raises(NotImplementedError, match="vmapped axis 'i'"):
        jax.vmap(lambda v: jax_cgx.compressed_psum(v, "i", config), axis_name="i")(jnp.ones((4, 100)))


def test_pmap():
    xs = rows(900)
    config = CompressionConfig(bits=5, bucket_size=64, min_size=16)
    out = np.asarray(jax.pmap(lambda x: jax_cgx.compressed_psum(x, "i", config), axis_name="i")(xs))
    assert_replicas_identical(out)
    assert_same_bits(out[0], oracle(xs, config)[0])


def test_scan_and_cond():
    xs = rows(256)
    config = CompressionConfig(bits=4, bucket_size=64, min_size=16)
    mesh = mesh_1d()

    def body(x):
        x = x[0]

        def step(carry, _):
            return jax_cgx.compressed_pmean(carry, "d", config), None

        scanned, _ = jax.lax.scan(step, x, None, length=3)
        branched = jax.lax.cond(x[0] > 100, lambda v: v, lambda v: jax_cgx.compressed_psum(v, "d", config), x)
        return jnp.stack([scanned, branched])[None]

    out = np.asarray(
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))(
            per_device(xs, mesh)
        )
    )
    assert_replicas_identical(out)
    assert_same_bits(out[0, 1], oracle(xs, config)[0])


# ------------------------------------------------------------- 2-D meshes


@pytest.mark.parametrize("axes", ["data", ("data", "model"), ("model", "data")])
def test_2d_mesh_one_axis_and_both(axes):
    mesh = device_mesh((4, 2), ("data", "model"))
    xs = jax.random.normal(jax.random.key(2), (4, 2, 1000))
    config = CompressionConfig(bits=4, bucket_size=64, min_size=16)
    f = jax.jit(
        jax.shard_map(
            lambda x: jax_cgx.compressed_psum(x[0, 0], axes, config)[None, None],
            mesh=mesh,
            in_specs=P("data", "model"),
            out_specs=P("data", "model"),
        )
    )
    out = np.asarray(f(jax.device_put(xs, jax.NamedSharding(mesh, P("data", "model")))))
    if axes == "data":
        for m in range(2):
            group = np.asarray(xs[:, m])
            for d in range(4):
                assert_same_bits(out[d, m], out[0, m])
            assert_same_bits(out[0, m], oracle(group, config)[0], f"model column {m}")
    else:
        flat = out.reshape(8, -1)
        assert_replicas_identical(flat)
        # Ranks are numbered like lax.axis_index(axes): row-major over the listed axes.
        order = np.asarray(xs) if axes == ("data", "model") else np.asarray(xs).transpose(1, 0, 2)
        assert_same_bits(flat[0], oracle(order.reshape(8, -1), config)[0])


# ---------------------------------------------------------------- pytrees


def test_pytree_of_mixed_leaves():
    mesh = mesh_1d()
    tree = {
        "scalar": jnp.arange(W, dtype=jnp.float32),
        "tiny": jnp.ones((W, 5)),
        "large": jax.random.normal(jax.random.key(3), (W, 64, 33)),
        "bf16": jax.random.normal(jax.random.key(4), (W, 700)).astype(jnp.bfloat16),
        "count": jnp.arange(W * 3, dtype=jnp.int32).reshape(W, 3),
        "nested": [jax.random.normal(jax.random.key(5), (W, 100)), jnp.zeros((W, 0))],
    }
    config = CompressionConfig(bits=4, bucket_size=64, fusion_buffer_mb=0.004, min_size=16)  # ~1000 f32 per buffer
    body = lambda t: jax.tree.map(lambda v: v[None], jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", config))  # noqa: E731
    out = jax.tree.map(
        np.asarray,
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
            jax.tree.map(lambda v: per_device(v, mesh), tree)
        ),
    )
    exact = jax.tree.map(lambda v: np.asarray(v).astype(np.float64).sum(0), tree)
    for leaf in jax.tree.leaves(out):
        assert_replicas_identical(leaf)
    # Small and integer leaves are exact; scalars too.
    assert np.asarray(out["scalar"])[0] == exact["scalar"]
    np.testing.assert_array_equal(np.asarray(out["tiny"][0]), exact["tiny"])
    np.testing.assert_array_equal(np.asarray(out["count"][0]), exact["count"])
    assert out["count"].dtype == np.int32 and out["bf16"].dtype == jnp.bfloat16
    assert out["nested"][1].shape == (W, 0)
    # The quantized leaves of one dtype are one stream cut into buffers (tree order: large, then
    # nested[0]); each bucket lies within the 2B-1 values around an element (was: only 0.35 of the
    # max, which stays as well: the a-priori bound at the largest sums may lie above it).
    for stream in (lambda t: [t["large"], t["nested"][0]], lambda t: [t["bf16"]]):
        values, result = (np.concatenate([np.asarray(a).reshape(W, -1) for a in stream(t)], 1) for t in (tree, out))
        err, bound = sra_window_bound(values, result[0], config)
        assert np.all(err <= bound), float(np.max(err - bound))
        assert err.max() < 0.35 * np.abs(values.astype(np.float64).sum(0)).max()


def test_fusion_buffer_sizes_do_not_change_correctness():
    xs = rows(3000)
    mesh = mesh_1d()
    small = CompressionConfig(bits=4, bucket_size=64, fusion_buffer_mb=0.002, min_size=16)  # 524 values < the leaf
    large = CompressionConfig(bits=4, bucket_size=64, fusion_buffer_mb=64, min_size=16)
    a = psum_1d(per_device(xs, mesh), KEY, small)
    b = psum_1d(per_device(xs, mesh), KEY, large)
    assert_replicas_identical(a)
    assert_same_bits(b[0], oracle(xs, large)[0])
    # Small buffers: each bucket within the 2B-1 values around an element; one buffer: its own
    # buckets (was: only 0.2 of the max for both, which stays: the a-priori bound of the largest
    # sums lies above it).
    exact = np.asarray(xs, np.float64).sum(0)
    for (err, bound), what in ((sra_window_bound(xs, a[0], small), "small"), (sra_bound(xs, b[0], large), "large")):
        assert np.all(err <= bound), (what, float(np.max(err - bound)))
        assert err.max() < 0.2 * np.abs(exact).max(), what


def test_per_leaf_configs_pytree_and_callable():
    mesh = mesh_1d()
    tree = {"w": rows(2000, seed=1), "b": rows(2000, seed=2)}
    four = CompressionConfig(bits=4, bucket_size=64, min_size=16)

    def run(config):
        body = lambda t: jax.tree.map(  # noqa: E731
            lambda v: v[None], jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", config)
        )
        return jax.tree.map(
            np.asarray,
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
                jax.tree.map(lambda v: per_device(v, mesh), tree)
            ),
        )

    by_tree = run({"w": four, "b": None})
    by_fn = run(lambda path, leaf: None if "b" in jax.tree_util.keystr(path) else four)
    for out in (by_tree, by_fn):
        # Reduced uncompressed: equal to psum up to float32 summation order.
        exact_b = np.asarray(exact_psum(per_device(tree["b"], mesh)))
        np.testing.assert_allclose(out["b"][0], exact_b, rtol=1e-5, atol=1e-6)
        assert_same_bits(out["w"][0], oracle(tree["w"], four)[0])


# ------------------------------------------------------------------- HLO


def test_hlo_has_codec_calls_and_no_f32_all_reduce():
    xs = rows(4096)
    mesh = mesh_1d()
    config = CompressionConfig(bits=4, bucket_size=512, min_size=16)
    hlo = psum_1d_jit.lower(per_device(xs, mesh), KEY, config, impl="kernel").compile().as_text()
    for target in ("jax_cgx_quantize", "jax_cgx_dequantize_sum_requantize", "jax_cgx_dequantize"):
        assert target in hlo
    assert "all-to-all" in hlo and "all-gather" in hlo
    assert not re.search(r"f32\[[^\]]*\][^\n]*all-reduce\(", hlo), "compressed leaves must not use an f32 all-reduce"


# ----------------------------------------------------------------- errors


def test_clear_errors():
    mesh = mesh_1d()
    xs = per_device(rows(100), mesh)

    def run(f, check_vma=True):
        return jax.jit(jax.shard_map(lambda x: f(x[0])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))(xs)

    with pytest.raises(NameError, match="axis name 'batch' is not bound"):
        run(lambda v: jax_cgx.compressed_psum(v, "batch", CompressionConfig(min_size=16)))
    with pytest.raises(NameError, match="axis name 'batch' is not bound"):
        jax_cgx.compressed_psum(jnp.ones(4), "batch", CompressionConfig(min_size=16))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        run(lambda v: jax_cgx.compressed_psum(v, "d", CompressionConfig(stochastic=True, min_size=16)))
    with pytest.raises(TypeError, match="complex64, which cannot"):
        run(lambda v: jax_cgx.compressed_psum(v.astype(jnp.complex64), "d", CompressionConfig(min_size=16)).real)
    with pytest.raises(TypeError, match="must be a CompressionConfig or None"):
        run(lambda v: jax_cgx.compressed_psum(v, "d", lambda p, leaf: 4))
    with pytest.raises(ValueError, match="impl must be one of"):
        run(lambda v: jax_cgx.compressed_psum(v, "d", CompressionConfig(min_size=16), impl="gpu"))


def test_config_none_reads_the_environment(monkeypatch):
    xs = rows(1000)
    mesh = mesh_1d()
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "3")
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "128")
    f = jax.shard_map(lambda x: jax_cgx.compressed_psum(x[0], "d")[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    out = np.asarray(jax.jit(f)(per_device(xs, mesh)))
    assert_same_bits(out[0], oracle(xs, CompressionConfig(bits=3, bucket_size=128, min_size=16))[0])


@pytest.mark.parametrize("world", [1, W])
def test_pmean_of_integer_leaves_is_lax_pmean(world):
    """An integer leaf (exact lane) comes back as lax.pmean returns it, float, whatever the world size."""
    mesh = jax.make_mesh((world,), ("d",), devices=jax.devices()[:world])
    x = jax.device_put(jnp.arange(world * 6, dtype=jnp.int32).reshape(world, 6),
                       jax.sharding.NamedSharding(mesh, P("d")))

    def body(v):
        return jax_cgx.compressed_pmean(v[0], "d", CompressionConfig(bits=4, min_size=16))[None], jax.lax.pmean(v[0], "d")[None]

    got, want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    assert got.dtype == want.dtype == jnp.float32
    assert_same_bits(got, want)
