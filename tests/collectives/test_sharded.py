"""compressed_psum_scatter and compressed_all_gather (jax_cgx/_src/collectives/{reduce_scatter,all_gather}.py):
bits=32 is lax to the bit, the error stays within the analytic bound from the data's own buckets,
all_gather's replicas are identical, gradients are lax's, vmap and jit/scan, bytes_on_wire."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import half_psum_bound
from bitwise import assert_same_bits
from codec_cases import bucket_scales
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from meshes import device_mesh
from processes import run_workers
from sharded_worker import inputs, programs

import jax_cgx

W = 8
BUCKET = 64


def _run(fn, xs, check_vma=True):
    """``fn`` on device i's ``xs[i]``; returns every device's result stacked."""
    body = lambda v: jax.tree.map(lambda o: o[None], fn(jax.tree.map(lambda a: a[0], v)))  # noqa: E731
    mesh = device_mesh((W,), ("d",), AxisType.Auto)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))(xs)
    return jax.tree.map(np.asarray, out)


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-3, 3, size=(W, 1) + (1,) * (len(shape) - 1)))  # ranks of different magnitudes
    return (rng.standard_normal((W, *shape)) * scale).astype(np.float32)


def _scales(values: np.ndarray, config) -> np.ndarray:
    """A bound of the scale of the bucket holding each value of ``values`` (1-D, one block or shard,
    its buckets from its start), from the data: the bucket's range over 2^bits - 1 levels."""
    return bucket_scales(values, values.size, config.bucket_size, config.bits)


# ----------------------------------------------------------------- bits=32 is lax

CASES = [(False, 0, (W, 40, 24)), (True, 0, (2 * W, 40, 24)), (False, 1, (40, W, 24)), (True, 1, (40, 3 * W, 24))]


@pytest.mark.parametrize("tiled, dim, shape", CASES, ids=["untiled-0", "tiled-0", "untiled-1", "tiled-1"])
def test_psum_scatter_bits32_is_lax(tiled, dim, shape):
    xs = _data(shape)
    exact = jax_cgx.CompressionConfig(bits=32)
    ours = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", exact, scatter_dimension=dim, tiled=tiled), xs)
    ref = _run(lambda v: lax.psum_scatter(v, "d", scatter_dimension=dim, tiled=tiled), xs)
    assert_same_bits(ours, ref, "bits=32")
    for half_dtype in ("bfloat16", "float16"):
        half = jax_cgx.CompressionConfig(bits=16, half_dtype=half_dtype, min_size=16)
        ours = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", half, scatter_dimension=dim, tiled=tiled), xs)  # noqa: B023
        ref = _run(lambda v: lax.psum_scatter(v.astype(half_dtype), "d", scatter_dimension=dim,  # noqa: B023
                                              tiled=tiled).astype(jnp.float32), xs)
        assert_same_bits(ours, ref, f"bits=16 in {half_dtype}")
        if not tiled:  # within the half-precision bound of the exact sum (values far inside float16's range)
            blocks = np.moveaxis(xs, dim + 1, 1)  # [rank, block, ...]: rank o gets the sum of block o
            for o in range(W):
                err, bound = half_psum_bound(blocks[:, o], ours[o], jnp.dtype(half_dtype))
                assert np.all(err <= bound), (half_dtype, o, float(np.max(err - bound)))


@pytest.mark.parametrize("tiled, axis", [(False, 0), (True, 0), (False, 1), (True, 1), (False, 2)])
def test_all_gather_bits32_is_lax(tiled, axis):
    xs = _data((40, 24))
    for bits, cast in ((32, jnp.float32), (16, jnp.bfloat16), (16, jnp.float16)):
        cfg = jax_cgx.CompressionConfig(bits=bits, half_dtype=np.dtype(cast).name if bits == 16 else "bfloat16", min_size=16)
        ours = _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg, axis=axis, tiled=tiled), xs)  # noqa: B023
        ref = _run(lambda v: lax.all_gather(v.astype(cast), "d", axis=axis, tiled=tiled).astype(jnp.float32), xs)  # noqa: B023
        assert_same_bits(ours, ref, f"bits={bits}")


# ----------------------------------------------------------------- the error bound

@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_psum_scatter_error_within_the_bound(bits, stochastic):
    # Block o of the result: the owner's block exact, each peer's quantized once.
    m = 1000  # values per block: not a multiple of the bucket (a short last bucket) nor of 16 (padding)
    xs = _data((W, m), seed=bits)
    cfg = jax_cgx.CompressionConfig(bits=bits, bucket_size=BUCKET, stochastic=stochastic, min_size=16)
    key = jax.random.key(bits) if stochastic else None
    out = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, key=key), xs)  # [W(owner), m]
    x64 = xs.astype(np.float64)
    factor = 1.0 if stochastic else 0.5
    for o in range(W):
        exact = x64[:, o].sum(0)
        peers = sum(_scales(xs[r, o], cfg) for r in range(W) if r != o)
        rounding = 2.0**-22 * np.abs(x64[:, o]).sum(0) * W
        err = np.abs(out[o] - exact)
        bound = peers * (factor + 1e-4) + rounding
        assert np.all(err <= bound), (o, float(np.max(err - bound)))
    assert np.any(out != _run(lambda v: lax.psum_scatter(v, "d"), xs))  # it was compressed


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_all_gather_error_within_the_bound_and_replicas_identical(bits, stochastic):
    m = 1000
    xs = _data((m,), seed=bits)
    cfg = jax_cgx.CompressionConfig(bits=bits, bucket_size=BUCKET, stochastic=stochastic, min_size=16)
    key = jax.random.key(bits) if stochastic else None
    out = _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg, key=key), xs)  # [W(replica), W(shard), m]
    for r in range(1, W):
        assert_same_bits(out[r], out[0], f"replica {r}")
    factor = 1.0 if stochastic else 0.5
    for s in range(W):
        err = np.abs(out[0, s].astype(np.float64) - xs[s])
        bound = _scales(xs[s], cfg) * (factor + 1e-4) + 2.0**-23 * np.abs(xs[s])
        assert np.all(err <= bound), (s, float(np.max(err - bound)))
    assert np.any(out[0] != xs)


# ----------------------------------------------------------------- pytrees, lanes, fusion

def test_pytrees_lanes_and_fusion():
    rng = np.random.default_rng(5)
    tree = {"w": rng.standard_normal((W, 2 * W, 300)).astype(np.float32),
            "v": rng.standard_normal((W, W, 50)).astype(np.float32),
            "small": rng.standard_normal((W, W)).astype(np.float32),  # < min_size: exact
            "n": np.arange(W * W * 3, dtype=np.int32).reshape(W, W, 3)}
    cfg = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, min_size=16)
    out = _run(lambda t: jax_cgx.compressed_psum_scatter(t, "d", cfg, tiled=True), tree)
    ref = _run(lambda t: jax.tree.map(lambda a: lax.psum_scatter(a, "d", tiled=True), t), tree)
    for k in ("small", "n"):
        assert_same_bits(out[k], ref[k], k)
    for k in ("w", "v"):
        assert out[k].shape == ref[k].shape and np.any(out[k] != ref[k])
    # Per-leaf configs: w exact, the rest compressed.
    per_leaf = {"w": None, "v": cfg, "small": cfg, "n": None}
    out = _run(lambda t: jax_cgx.compressed_psum_scatter(t, "d", per_leaf, tiled=True), tree)
    assert_same_bits(out["w"], ref["w"], "w: config None")
    gathered = _run(lambda t: jax_cgx.compressed_all_gather(jax.tree.map(lambda a: a[0], t), "d", cfg), tree)
    exact = _run(lambda t: jax.tree.map(lambda a: lax.all_gather(a[0], "d"), t), tree)
    assert_same_bits(gathered["n"], exact["n"], "n")
    assert gathered["w"].shape == exact["w"].shape


def test_bytes_on_wire_ops():
    x = {"w": jax.ShapeDtypeStruct((W, 4096), jnp.float32), "n": jax.ShapeDtypeStruct((W, 4), jnp.int32)}
    plain = jax_cgx.CompressionConfig(bits=32)
    assert jax_cgx.bytes_on_wire(x, W, plain, op="psum_scatter") == (W - 1) * (4096 + 4) * 4
    assert jax_cgx.bytes_on_wire(x, W, plain, op="all_gather") == (W - 1) * W * (4096 + 4) * 4
    four = jax_cgx.CompressionConfig(bits=4, bucket_size=512, min_size=16)
    packed = 4096 // 2 + 8 * 8  # 4096 values at 4 bits, 8 buckets of (min, scale)
    assert jax_cgx.bytes_on_wire(x, W, four, op="psum_scatter") == (W - 1) * (packed + 4 * 4)
    with pytest.raises(ValueError, match="op must be one of 'psum', 'psum_scatter', 'all_gather'"):
        jax_cgx.bytes_on_wire(x, W, four, op="reduce_scatter")


# ----------------------------------------------------------------- JAX transformations

def test_gradients_are_lax_gradients():
    # A linear loss: the cotangent does not depend on the (compressed) value, so the gradient
    # must be lax's to the bit (quantization is the identity to differentiation).
    xs = _data((2 * W, 30))
    cfg = jax_cgx.CompressionConfig(bits=3, bucket_size=BUCKET, min_size=16)
    weights = np.random.default_rng(1).standard_normal((W, 2, 30)).astype(np.float32)

    def loss(xs, scatter):
        out = jax.shard_map(lambda v: scatter(v[0])[None], mesh=device_mesh((W,), ("d",), AxisType.Auto),
                            in_specs=P("d"), out_specs=P("d"))(xs)
        return jnp.sum(out * weights)

    ours = jax.grad(loss)(xs, lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, tiled=True))
    ref = jax.grad(loss)(xs, lambda v: lax.psum_scatter(v, "d", tiled=True))
    assert_same_bits(np.asarray(ours), np.asarray(ref), "psum_scatter")

    shards = _data((30,))
    g_weights = np.random.default_rng(2).standard_normal((W, W, 30)).astype(np.float32)

    def gather_loss(xs, gather):
        out = jax.shard_map(lambda v: gather(v[0])[None], mesh=device_mesh((W,), ("d",), AxisType.Auto),
                            in_specs=P("d"), out_specs=P("d"))(xs)
        return jnp.sum(out * g_weights)

    ours = jax.grad(gather_loss)(shards, lambda v: jax_cgx.compressed_all_gather(v, "d", cfg))
    ref = jax.grad(gather_loss)(shards, lambda v: lax.all_gather(v, "d"))
    assert_same_bits(np.asarray(ours), np.asarray(ref), "all_gather")


def test_vmap_scan_and_no_check_vma():
    xs = _data((3, W, 200))  # a vmapped leading axis of 3
    cfg = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, min_size=16)
    one = lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg)  # noqa: E731
    vmapped = _run(jax.vmap(one), xs)
    looped = _run(lambda v: jnp.stack([one(v[i]) for i in range(3)]), xs)
    assert_same_bits(vmapped, looped, "vmap = rows")
    scanned = _run(lambda v: lax.scan(lambda c, row: (c, one(row)), 0, v)[1], xs)
    assert_same_bits(scanned, looped, "scan")
    unchecked = _run(lambda v: jnp.stack([one(v[i]) for i in range(3)]), xs, check_vma=False)
    assert_same_bits(unchecked, looped, "check_vma=False")
    gathered = _run(jax.vmap(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg)), xs[:, :, 0])
    assert gathered.shape == (W, 3, W, 200)


def test_errors():
    xs = _data((W + 1, 10))
    cfg = jax_cgx.CompressionConfig(bits=4, min_size=16)
    with pytest.raises(ValueError, match=r"has 9 entries along scatter_dimension 0; with tiled=False it must equal"):
        _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg), xs)
    with pytest.raises(ValueError, match="not divisible by the 8 ranks"):
        _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, tiled=True), xs)
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key"):
        _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg.replace(stochastic=True)), xs)
    with pytest.raises(ValueError, match="hierarchical=True applies to all-reduces only"):
        _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg.replace(hierarchical=True)), xs)
    with pytest.raises(NotImplementedError, match="backend='tcp' runs all-reduces only"):
        _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg.replace(backend="tcp")), xs)
    with pytest.raises(jax_cgx.nccl.NcclError, match="backend='nccl' runs on CUDA GPUs only"):
        _run(lambda v: jax_cgx.compressed_psum_scatter(v[:W], "d", cfg.replace(backend="nccl")), xs)
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg, axis=3), xs)
    with pytest.raises(NameError, match="axis name 'x' is not bound"):
        jax_cgx.compressed_psum_scatter(jnp.ones((W, 4)), "x", cfg)


def test_settings_that_do_not_apply_are_logged_once(caplog, monkeypatch):
    from jax_cgx._src.collectives import scatter_gather

    monkeypatch.setattr(scatter_gather, "_logged", set())  # whatever earlier tests logged
    xs = _data((W, 100))
    cfg = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, algorithm="ring", skip_incomplete_buckets=True, min_size=16)
    with caplog.at_level("INFO", logger="jax_cgx"):
        for _ in range(2):
            _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg), xs[:, 0])
    for note in ("compressed_all_gather: algorithm='ring' does not apply",
                 "compressed_all_gather: skip_incomplete_buckets=True does not apply"):
        assert caplog.text.count(note) == 1, caplog.text


def test_pmap():
    xs = _data((W, 100))
    cfg = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, min_size=16)
    ours = jax.pmap(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg), axis_name="d")(xs)
    in_shard_map = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg), xs)
    assert_same_bits(np.asarray(ours), in_shard_map, "pmap = shard_map")
    gathered = jax.pmap(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg), axis_name="d")(xs[:, 0])
    assert_same_bits(np.asarray(gathered), _run(lambda v: jax_cgx.compressed_all_gather(v, "d", cfg), xs[:, 0]),
                     "all_gather: pmap = shard_map")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_two_devices_each(tmp_path):
    # The same programs over 2 processes x 2 devices (gloo) and over 4 devices of this process:
    # the same bytes, stochastic rounding included.
    nproc = 2
    run_workers("sharded_worker.py", nproc, tmp_path)
    results = {}
    for i in range(nproc):
        results.update(np.load(tmp_path / f"process{i}.npz"))
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    xs = inputs(4)
    for name, fn in programs(mesh).items():
        local = np.asarray(fn(xs))
        for d in range(4):
            assert_same_bits(results[f"{name}/device{d}"], local[d], f"{name}: device {d}")
        # policy="auto" on the processes' measured link: one decision for all, lax's bits or the compressed ones.
        # (lax's sums may round differently over gloo: close, where compressing is 3 bits off.)
        exact = xs.sum(axis=0) if name == "psum_scatter" else np.broadcast_to(xs[:, 0], (4, *xs[:, 0].shape))
        auto = [results[f"{name}_auto/device{d}"] for d in range(4)]
        compressed = [np.array_equal(a.view(np.uint32), local[d].view(np.uint32)) for d, a in enumerate(auto)]
        uncompressed = [np.allclose(a, exact[d], rtol=1e-5, atol=1e-5) for d, a in enumerate(auto)]
        assert all(compressed) or all(uncompressed), f"{name}: the processes decided differently"


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_residuals_add_up_to_the_error(stochastic):
    xs = _data((W, 1000), seed=9)
    cfg = jax_cgx.CompressionConfig(bits=3, bucket_size=BUCKET, stochastic=stochastic, min_size=16)
    key = jax.random.key(4) if stochastic else None
    out, res = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, key=key, return_residual=True), xs)
    plain = _run(lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, key=key), xs)
    assert_same_bits(out, plain, "the sums do not depend on return_residual")
    assert res.shape == xs.shape  # [rank, block, m]: like each rank's input
    x64, r64 = xs.astype(np.float64), res.astype(np.float64)
    for o in range(W):
        assert not np.any(res[o, o])  # the owner's own block enters exactly
        lost = x64[:, o].sum(0) - out[o]
        np.testing.assert_allclose(r64[:, o].sum(0), lost, rtol=0, atol=2.0**-20 * np.abs(x64[:, o]).sum(0).max() * W)
    with pytest.raises(TypeError, match="return_residual=True\\) cannot be differentiated"):
        jax.grad(lambda x: jnp.sum(_run(lambda v: jax_cgx.compressed_psum_scatter(
            v, "d", cfg.replace(stochastic=False), return_residual=True)[0], x)))(jnp.asarray(xs))


def test_one_rank_is_exact():
    # Nothing moves over one rank, so nothing is quantized (as compressed_psum).
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    x = np.random.default_rng(0).standard_normal((1, 300)).astype(np.float32)
    cfg = jax_cgx.CompressionConfig(bits=2, bucket_size=BUCKET, min_size=16)
    for fn in (lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, tiled=True),
               lambda v: jax_cgx.compressed_all_gather(v, "d", cfg, tiled=True),
               lambda v: jax_cgx.compressed_psum_scatter(v, "d", cfg, tiled=True, return_residual=True)[0]):
        out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
        assert_same_bits(np.asarray(out), x, "one rank")


# ----------------------------------------------------------------- policy="auto"

_SHARDED_OPS = {
    "psum_scatter": (lambda v, c: jax_cgx.compressed_psum_scatter(v, "d", c, tiled=True),
                     lambda v: lax.psum_scatter(v, "d", tiled=True), (W * 4096,), "compressed_reduce_scatter"),
    "all_gather": (lambda v, c: jax_cgx.compressed_all_gather(v, "d", c, tiled=True),
                   lambda v: lax.all_gather(v, "d", tiled=True), (4096,), "compressed_all_gather"),
}


def _traced(fn, xs) -> str:
    body = lambda v: fn(v[0])[None]  # noqa: E731
    mesh = device_mesh((W,), ("d",), AxisType.Auto)
    return str(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(xs).jaxpr)


def _fixed_codec_rates(pricing) -> None:
    """The codec's rates fixed (a copy at memory speed, 40 GB/s): measured ones make an unlimited
    link a near tie for the sharded collectives on a loaded 2-core machine (copy ~5-12 GB/s), where
    the all-gather compressed once in CI. With a given link nothing else is measured."""
    from jax_cgx._src.policy import calibration
    from jax_cgx._src.policy.cost_model import CodecRates

    calibration._measured_rates[jax.default_backend()] = CodecRates(quantize=20e9, dequantize=30e9, add=40e9)


@pytest.mark.parametrize("op", list(_SHARDED_OPS))
def test_policy_auto_prices_the_sharded_collectives(op, fresh_policy, caplog):
    """An unlimited link: lax itself, to the bit, logged once; a slow one: compressed, bitwise
    what policy="always" gives; bytes_on_wire follows the decisions."""
    _fixed_codec_rates(fresh_policy)
    ours, theirs, shape, primitive = _SHARDED_OPS[op]
    xs = _data(shape)
    fast = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, policy="auto", link_gbps=float("inf"), min_size=16)
    with caplog.at_level("INFO", logger="jax_cgx"):
        got = _run(lambda v: ours(v, fast), xs)
        _run(lambda v: ours(v, fast), xs)  # traced again: logged once
    assert primitive not in _traced(lambda v: ours(v, fast), xs)
    assert_same_bits(got, _run(theirs, xs), f"{op}: uncompressed")
    size = "0.125" if op == "psum_scatter" else "0.01562"  # each rank's input
    assert caplog.text.count(f"{op}: lax (uncompressed) a {size} MiB float32 buffer over 8 ranks") == 1, caplog.text
    assert f"ms lax.{op})" in caplog.text
    slow = fast.replace(link_gbps=0.1)
    assert primitive in _traced(lambda v: ours(v, slow), xs)
    assert_same_bits(_run(lambda v: ours(v, slow), xs), _run(lambda v: ours(v, slow.replace(policy="always")), xs),
                     f"{op}: compressed as always")
    one = jax.ShapeDtypeStruct(shape, jnp.float32)
    exact = jax_cgx.bytes_on_wire(one, W, jax_cgx.CompressionConfig(bits=32), op=op)
    assert jax_cgx.bytes_on_wire(one, W, fast, op=op) == exact
    assert jax_cgx.bytes_on_wire(one, W, slow, op=op) < exact / 4


@pytest.mark.parametrize("op", list(_SHARDED_OPS))
def test_policy_auto_times_a_sharded_near_tie_with_its_own_collectives(op, fresh_policy, monkeypatch):
    """On a measured link a near-tie is timed, with the collective's own lax and compressed
    programs (they run here for real), and the timing decides."""
    ours, _, shape, primitive = _SHARDED_OPS[op]
    pricing = fresh_policy
    monkeypatch.setattr(pricing, "TIE_BAND", float("inf"))
    monkeypatch.setattr(pricing, "_SETTLE_MAX_S", float("inf"))
    real, timed = pricing._time_exchange, []

    def timing(devices, values, dtype, config, backend, bodies=None, inner=None, psum_s=None, rivals=()):
        timed.append((values, backend))
        lax_s, compressed_s = real(devices, values, dtype, config, backend, bodies)
        assert lax_s > 0 and compressed_s > 0
        return 1.0, 0.01  # compressing wins by far

    monkeypatch.setattr(pricing, "_time_exchange", timing)
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, policy="auto", min_size=16)
    assert primitive in _traced(lambda v: ours(v, config), _data(shape))
    assert timed == [(shape[0], "xla")]


@pytest.mark.parametrize("op", list(_SHARDED_OPS))
def test_explain_shows_the_sharded_decisions(op, fresh_policy):
    _fixed_codec_rates(fresh_policy)
    tree = {"w": jax.ShapeDtypeStruct((W * 4096,), jnp.float32), "i": jax.ShapeDtypeStruct((W,), jnp.int32)}
    fast = jax_cgx.CompressionConfig(bits=4, bucket_size=BUCKET, policy="auto", link_gbps=float("inf"), min_size=16)
    tiled = {"tiled": True} if op == "psum_scatter" else {}  # as compressed_psum_scatter would need
    report = jax_cgx.explain(tree, world=W, config=fast, op=op, file=None, **tiled)
    assert {r.path: r.how for r in report.leaves} == {"['w']": "lax (auto)", "['i']": "exact"}
    (buf,) = report.buffers
    assert not buf.compressed and buf.values == W * 4096 and buf.priced == "model"
    assert str(report).startswith(f"compressed_{op} over {W} ranks") and "lax ms" in str(report)
    slow = jax_cgx.explain(tree, world=W, config=fast.replace(link_gbps=0.1), op=op, file=None, **tiled)
    assert slow.buffers[0].compressed and slow.leaves[1].how == "compressed"
    with pytest.raises(ValueError, match="op must be one of"):
        jax_cgx.explain(tree, world=W, op="psum_gather")
