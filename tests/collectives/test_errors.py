"""Bounds and error messages (issue 14, item 4): each error names what was wrong and the fix."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, mesh_1d, per_device, sra_bound
from codec_cases import error_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.collectives import bytes_on_wire
from jax_cgx._src.config import MAX_FUSION_BUFFERS, MIN_FUSION_BUFFER_MB


def _spec(shape, dtype=jnp.float32):
    """Row i on device i, as a shape only (tracing needs no data)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh_1d(), P("d")))


def _trace_psum(xs, config, **kwargs):
    """Trace (not compile) compressed_psum over 'd' of row i on device i, for a pytree of rows."""

    def body(t):
        out = jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", config, **kwargs)
        return jax.tree.map(lambda v: v[None], out)

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("d"), out_specs=P("d")))
    return f.trace(jax.tree.map(lambda v: v if isinstance(v, jax.ShapeDtypeStruct) else per_device(v, mesh_1d()), xs))


# ------------------------------------------------------------ fusion buffers


def test_too_many_fusion_buffers_name_fusion_buffer_mb():
    # 0.001 MiB buffers of a 4 MiB leaf: 4003 buffers, which used to compile for minutes.
    xs = _spec((W, 2**20))
    with pytest.raises(ValueError, match=r"fusion_buffer_mb=0.001 .* 4003 fusion buffers.*fusion_buffer_mb >= "):
        _trace_psum(xs, CompressionConfig(fusion_buffer_mb=0.001, min_size=16))


def test_fusion_buffer_limit_is_inclusive_and_counts_every_group():
    per = int(MIN_FUSION_BUFFER_MB * 2**20) // 4  # float32 values per buffer
    config = CompressionConfig(fusion_buffer_mb=MIN_FUSION_BUFFER_MB, min_size=16)
    _trace_psum(_spec((W, MAX_FUSION_BUFFERS * per)), config)
    with pytest.raises(ValueError, match=f"{MAX_FUSION_BUFFERS + 1} fusion buffers"):
        _trace_psum(_spec((W, MAX_FUSION_BUFFERS * per + 1)), config)
    # two groups (float32 and bfloat16 leaves), half the limit each, plus one more buffer
    half = MAX_FUSION_BUFFERS // 2 * per
    _trace_psum({"a": _spec((W, half)), "b": _spec((W, 2 * half), jnp.bfloat16)}, config)
    with pytest.raises(ValueError, match=f"{MAX_FUSION_BUFFERS + 1} fusion buffers"):
        _trace_psum({"a": _spec((W, half)), "b": _spec((W, 2 * half + 1), jnp.bfloat16)}, config)


def test_suggested_fusion_buffer_size_fits():
    xs = _spec((W, 2**20))
    with pytest.raises(ValueError) as err:
        _trace_psum(xs, CompressionConfig(fusion_buffer_mb=0.001, min_size=16))
    suggested = float(str(err.value).split("fusion_buffer_mb >= ")[1].split(" ")[0])
    _trace_psum(xs, CompressionConfig(fusion_buffer_mb=suggested, min_size=16))


def test_suggested_fusion_buffer_size_fits_leaves_alone():
    # On CPUs a leaf of at least a quarter of a buffer is a buffer of its own: 1200 leaves of half a
    # 1 MiB buffer need 1200 buffers, not 600. The suggestion must count that way (2 MiB would not do).
    xs = [_spec((W, 2**17)) for _ in range(1200)]
    with pytest.raises(ValueError, match=r"into 1200 fusion buffers") as err:
        _trace_psum(xs, CompressionConfig(fusion_buffer_mb=1, min_size=16))
    suggested = float(str(err.value).split("fusion_buffer_mb >= ")[1].split(" ")[0])
    assert suggested == 4
    _trace_psum(xs, CompressionConfig(fusion_buffer_mb=suggested, min_size=16))


def test_huge_fusion_buffers_plan():
    # Any finite size is accepted (test_config): the rule for leaves alone must not overflow a float.
    _trace_psum(_spec((W, 4096)), CompressionConfig(fusion_buffer_mb=1e308, min_size=16))


# ------------------------------------------------------------ empty leaves


@pytest.mark.parametrize("residual", [False, True])
def test_empty_leaf_with_min_size_zero(residual):
    config = CompressionConfig(min_size=0)
    xs = {"empty": jnp.zeros((W, 0)), "full": jnp.arange(W * 64, dtype=jnp.float32).reshape(W, 64)}

    def body(t):
        out = jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", config, return_residual=residual)
        return jax.tree.map(lambda v: v[None], out)

    mesh = mesh_1d()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    out = f(jax.tree.map(lambda v: per_device(v, mesh), xs))
    summed = out[0] if residual else out
    assert summed["empty"].shape == (W, 0)
    full = np.asarray(summed["full"])
    assert np.all(full == full[0])
    err, bound = sra_bound(np.asarray(xs["full"]), full[0], config)  # was: rtol 0.05, atol 1
    assert np.all(err <= bound), float(np.max(err - bound))
    if residual:
        assert out[1]["empty"].shape == (W, 0)
    only = jax.jit(jax.shard_map(lambda x: jax_cgx.compressed_psum(x[0], "d", config)[None], mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d")))(per_device(xs["empty"], mesh))
    assert only.shape == (W, 0)
    assert bytes_on_wire(jax.ShapeDtypeStruct((0,), jnp.float32), W, config) == 0


# ------------------------------------------------------------ keys


@pytest.mark.parametrize("key", [0, 7, np.int64(3), "seed", 1.5])
def test_non_key_is_a_clear_type_error(key):
    config = CompressionConfig(stochastic=True, min_size=16)
    with pytest.raises(TypeError, match=r"quantize: key must be a PRNG key from jax.random.key"):
        jax_cgx.quantize(jnp.ones(1024), config, key=key)
    q = jax.vmap(lambda v: jax_cgx.quantize(v, config, key=jax.random.key(1)))(jnp.ones((2, 1024)))
    with pytest.raises(TypeError, match=r"dequantize_sum_requantize: key must be a PRNG key"):
        jax_cgx.dequantize_sum_requantize(q, stochastic=True, key=key)
    with pytest.raises(TypeError, match=r"compressed_psum: key must be a PRNG key"):
        _trace_psum(jnp.ones((W, 1024)), config, key=key)
    body = lambda x: jax_cgx.compressed_pmean(x[0], "d", config, key=key)[None]  # noqa: E731
    with pytest.raises(TypeError, match=r"compressed_pmean: key must be a PRNG key"):
        jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("d"), out_specs=P("d"))).trace(
            per_device(jnp.ones((W, 1024)), mesh_1d())
        )


def test_integer_key_message_shows_the_fix():
    with pytest.raises(TypeError, match=r"got the integer 0; pass key=jax.random.key\(0\)"):
        jax_cgx.quantize(jnp.ones(1024), CompressionConfig(stochastic=True, min_size=16), key=0)


def test_valid_keys_still_work():
    config = CompressionConfig(stochastic=True, min_size=16)
    typed = jax_cgx.quantize(jnp.arange(1024.0), config, key=jax.random.key(3))
    legacy = jax_cgx.quantize(jnp.arange(1024.0), config, key=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(typed.payload, legacy.payload)
    with pytest.raises(TypeError, match="key must be a single PRNG key"):
        jax_cgx.quantize(jnp.ones(1024), config, key=jax.random.split(jax.random.key(0), 3))


# ------------------------------------------------------------ tampered Quantized


def _quantized(skip: bool, stacked: bool):
    config = CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=skip, min_size=16)
    x = jnp.linspace(-1, 1, 1000, dtype=jnp.float32)
    if stacked:
        return jax.vmap(lambda v: jax_cgx.quantize(v, config, impl="reference"))(jnp.stack([x, -x]))
    return jax_cgx.quantize(x, config, impl="reference")


_TAMPERED = {
    "dtype": (dict(dtype=np.dtype(np.float16)), "dtype=float16 but the tail holds float32"),
    "dtype_int": (dict(dtype=np.dtype(np.int32)), "dtype=int32, expected float32, bfloat16 or float16"),
    "bits": (dict(bits=8), "bits=8, bucket_size=64 take"),
    "bits_range": (dict(bits=9), "bits=9, expected 1..8"),
    "bucket_size": (dict(bucket_size=32), "(bits=4, bucket_size=32 take|in buckets of 32 leave)"),
    "bucket_size_zero": (dict(bucket_size=0), "bucket_size=0, expected an int >= 1"),
    "shape": (dict(shape=(900,)), "(900 quantized values|900 values)"),
}


@pytest.mark.parametrize("field", sorted(_TAMPERED))
@pytest.mark.parametrize("skip", [False, True])
def test_tampered_quantized_same_error_from_kernel_and_reference(field, skip):
    changes, match = _TAMPERED[field]
    calls = {
        "dequantize": (False, lambda q, impl: jax_cgx.dequantize(q, impl=impl)),
        "dequantize_sum": (True, lambda q, impl: jax_cgx.dequantize_sum(q, impl=impl)),
        "dequantize_sum_requantize": (True, lambda q, impl: jax_cgx.dequantize_sum_requantize(q, impl=impl)),
    }
    for name, (stacked, call) in calls.items():
        q = dataclasses.replace(_quantized(skip, stacked), **changes)
        messages = []
        for impl in ("kernel", "reference"):
            with pytest.raises(ValueError, match=f"{name}: inconsistent Quantized: .*{match}") as err:
                call(q, impl)
            messages.append(str(err.value))
        assert messages[0] == messages[1]


@pytest.mark.parametrize(
    "changes, match",
    [
        (lambda q: dict(payload=q.payload[:-1]), "payload has 499 bytes"),
        (lambda q: dict(meta=q.meta[:-1]), "meta 15 buckets"),
        (lambda q: dict(payload=q.payload.astype(jnp.float32)), "payload is float32, expected uint8"),
        (lambda q: dict(meta=q.meta.astype(jnp.float16)), "meta is float16, expected float32"),
        (lambda q: dict(tail=jnp.zeros((0,), jnp.float16)), "dtype=float32 but the tail holds float16"),
        (lambda q: dict(tail=jnp.zeros((3,), jnp.float32)), "tail holds 3 values"),
        (lambda q: dict(meta=q.meta.reshape(-1)), "meta has shape"),
    ],
)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_tampered_arrays(changes, match, impl):
    q = _quantized(skip=False, stacked=False)
    with pytest.raises(ValueError, match=match):
        jax_cgx.dequantize(dataclasses.replace(q, **changes(q)), impl=impl)


@pytest.mark.parametrize("skip", [False, True])
def test_untampered_quantized_passes(skip):
    x = jnp.linspace(-1, 1, 1000, dtype=jnp.float32)
    q = jax_cgx.quantize(x, CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=skip, min_size=16))
    m = 960 if skip else 1000
    err, bound = error_bound(np.asarray(x), np.asarray(jax_cgx.dequantize(q)), m, 64, 4, False)  # was: atol 0.1
    assert np.all(err <= bound), float(np.max(err - bound))
    np.testing.assert_array_equal(np.asarray(jax_cgx.dequantize(q))[m:], np.asarray(x)[m:])
    qs = _quantized(skip, stacked=True)
    summed, value = jax_cgx.dequantize_sum_requantize(qs)
    assert jax_cgx.dequantize(summed).shape == value.shape == (1000,)
    assert jax_cgx.dequantize_sum(qs).shape == (1000,)


# ------------------------------------------------------------ vmap axes


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axes", [("v", "d"), ("v",)])
def test_vmapped_axis_is_a_clear_error(check_vma, axes):
    mesh = mesh_1d()

    def body(x):
        return jax.vmap(lambda r: jax_cgx.compressed_psum(r, axes, CompressionConfig(min_size=16)), axis_name="v")(x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, "d"), check_vma=check_vma))
    with pytest.raises(NotImplementedError, match="compressed_psum over the vmapped axis 'v' is not supported"):
        f.trace(per_device(jnp.ones((3, W * 64)), mesh, P(None, "d")))


def test_vmap_over_another_axis_still_works():
    mesh = mesh_1d()

    def body(x):
        return jax.vmap(lambda r: jax_cgx.compressed_psum(r, "d", CompressionConfig(bits=8, min_size=16)))(x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, None)))
    out = f(per_device(jnp.ones((3, W * 64)), mesh, P(None, "d")))
    # A constant input sums exactly (docs/algorithm.md, SRA step 1; was: rtol 1e-2).
    np.testing.assert_array_equal(np.asarray(out), np.full((3, 64), W, np.float32))


@pytest.mark.parametrize("op", ["psum", "psum_hierarchical", "all_gather", "psum_scatter"])
def test_buffers_past_int32_counts_are_refused(op):
    """A buffer of 2^31 values or more per rank: the kernels' int32 real-value counts would wrap
    and the buffer decode to zeros. Lowered only (nothing is allocated): a clear error instead."""
    n = 2**31 + 64
    big = CompressionConfig(bits=4, fusion_buffer_mb=16384, min_size=16)
    mesh = jax.make_mesh((2, 2), ("o", "i"), devices=jax.devices()[:4])
    calls = {
        "psum": (lambda v: jax_cgx.compressed_psum(v, "o", big), (n,)),
        "psum_hierarchical": (lambda v: jax_cgx.compressed_psum(v, ("o", "i"), big.replace(hierarchical=True)), (n,)),
        "all_gather": (lambda v: jax_cgx.compressed_all_gather(v, "o", big, tiled=True), (n,)),
        "psum_scatter": (lambda v: jax_cgx.compressed_psum_scatter(v, "o", big, tiled=True), (2 * n,)),
    }
    fn, shape = calls[op]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    with pytest.raises(ValueError, match=r"a compressed buffer of \d+ values per rank is more than the kernels "
                                         r"can count \(2147483647, int32\)"):
        f.lower(jax.ShapeDtypeStruct(shape, jnp.float32))


@pytest.mark.parametrize("world, inner, message", [
    (0, None, "world must be a positive int"), (-4, None, "world must be a positive int"),
    (8.5, None, "world must be a positive int"), ("8", None, "world must be a positive int"),
    (True, None, "world must be a positive int"), (8, 3, "inner_world=3 must divide world=8"),
    (8, 0, "inner_world must be a positive int"),
])
def test_rank_counts_are_checked(world, inner, message):
    tree = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    config = CompressionConfig(bits=4, min_size=16)
    for op in ("psum", "psum_scatter", "all_gather"):
        with pytest.raises(ValueError, match=f"bytes_on_wire: {message}"):
            bytes_on_wire(tree, world, config, inner_world=inner, op=op)
    with pytest.raises(ValueError, match=f"explain: {message}"):
        jax_cgx.explain(tree, config=config, world=world, inner_world=inner, file=None)
    assert bytes_on_wire(tree, np.int64(8), config) == bytes_on_wire(tree, 8, config)  # numpy ints are ints


def test_explain_over_one_rank_and_the_scatter_refusals():
    tree = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "odd": jax.ShapeDtypeStruct((7,), jnp.float32)}
    # one rank: nothing moves, every leaf exact (before: ZeroDivisionError while printing)
    report = jax_cgx.explain(tree, world=1, config=CompressionConfig(bits=4, min_size=16), file=None)
    assert [r.how for r in report.leaves] == ["exact", "exact"] and report.buffers == []
    assert "over 1 ranks" in str(report)
    # what compressed_psum_scatter refuses, explain refuses with its words (before: a plan was printed)
    with pytest.raises(ValueError, match=r"leaf \['odd'\] has 7 entries along scatter_dimension 0, not divisible"):
        jax_cgx.explain(tree, world=4, op="psum_scatter", tiled=True, file=None)
    with pytest.raises(ValueError, match=r"with tiled=False it must equal the number of ranks, 4"):
        jax_cgx.explain({"w": tree["w"]}, world=4, op="psum_scatter", file=None)
    report = jax_cgx.explain({"w": tree["w"]}, world=4, op="psum_scatter", tiled=True, file=None)
    assert report.leaves[0].how == "compressed"
    # Inside a shard_map every op's report names the axes it reduces over (the sharded ops' dropped them).
    seen = {}

    def body(x):
        for op in ("psum", "psum_scatter", "all_gather"):
            seen[op] = jax_cgx.explain({"w": x[0]}, "d", CompressionConfig(bits=4, min_size=16), op=op, tiled=True,
                                       file=None)
        return x

    jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("d"), out_specs=P("d"))).trace(
        per_device(jnp.zeros((W, 64, 64)), mesh_1d()))
    for op, report in seen.items():
        assert report.axes == ("d",) and f"over ('d',) ({W} ranks)" in str(report), (op, str(report))


def test_a_float64_leaf_is_refused_with_a_fix_that_works_for_config_none():
    # x64 is a process-wide flag: a process of its own. config=None means the default config, which
    # compresses: the message must not tell such a caller to pass config=None.
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        import jax_cgx
        mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        for config in (None, jax_cgx.CompressionConfig(bits=4, min_size=16)):
            f = lambda v: jax_cgx.compressed_pmean(jax.lax.pcast(v, "data", to="varying"), "data", config)
            try:
                jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())({"w": jnp.zeros((4096,), jnp.float64)})
            except TypeError as err:
                print("refused:", err)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_ENABLE_X64": "1"})
    said = [line for line in run.stdout.splitlines() if line.startswith("refused:")]
    assert len(said) == 2, run.stdout + run.stderr[-2000:]
    for line in said:
        assert "compressed_pmean: leaf ['w'] has dtype float64, which cannot be compressed" in line, line
        assert "giving it None in a config pytree" in line and "config=None" not in line, line
