"""The collectives against tests/support/numpy_oracle.py, written from docs/format.md and docs/algorithm.md
alone (8 virtual CPU devices): fusion buffers and their seeds under stochastic rounding, the
reduce-scatter and all-gather, and jax_cgx.testing's simulators. The all-reduce's other bitwise
checks (tests/collectives/test_allreduce.py, tests/exchange/test_ring.py, test_hierarchical.py, ...) reach the
same oracle through allreduce_cases.oracle / ring_oracle.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle
from allreduce_cases import W, mesh_1d, per_device, seed_rows
from bitwise import assert_same_bits
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig

KEY = jax.random.key(36)


def rows(n, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (W, n), jnp.float32)
    return np.asarray((x * jnp.logspace(-2, 1, n)).astype(dtype))


def _replicas_identical(out):
    for i in range(1, out.shape[0]):
        assert_same_bits(out[i], out[0], f"replica {i} vs replica 0")
def test_fusion_buffers_under_stochastic_rounding_equal_the_numpy_oracle():
    """A pytree over several fusion buffers and groups, stochastic: every buffer draws its own seeds
    (fold_in(fold_in(key, rank), buffer)), bitwise what docs/algorithm.md says (numpy_oracle.psum_tree).
    Buffer 0 and buffer 6 hold the same values: only their seeds tell them apart."""
    mesh = mesh_1d()
    a = np.asarray(rows(1200, seed=1))
    tree = {
        # On CPU every leaf here but "small" is a quarter of a buffer or more: each is cut into buffers
        # of its own (docs/algorithm.md, "Lanes").
        "a": a,  # buffers 0..2 (524 values each, the last short)
        "b": np.asarray(rows(900, seed=2)),  # buffers 3, 4
        "c": np.asarray(rows(700, jnp.bfloat16, seed=3)),  # its own group (dtype): buffer 5
        "d": np.concatenate([a[:, :524], np.asarray(rows(300, seed=4))], axis=1),  # own group (skip config): 6, 7
        "small": np.asarray(rows(10, seed=5)),  # < min_size: exact
    }
    stoch = CompressionConfig(bits=3, bucket_size=64, stochastic=True, fusion_buffer_mb=0.002, min_size=16)  # 524 f32 values
    skip = stoch.replace(skip_incomplete_buckets=True, fusion_buffer_mb=0.002 - 1e-9)  # another group
    configs = {"a": stoch, "b": stoch, "c": stoch, "d": skip, "small": stoch}
    body = lambda t, k: jax.tree.map(  # noqa: E731
        lambda v: v[None], jax_cgx.compressed_psum(jax.tree.map(lambda v: v[0], t), "d", configs, key=k))
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))(
        jax.tree.map(lambda v: per_device(v, mesh), tree), KEY)
    out = jax.tree.map(np.asarray, out)
    names = sorted(tree)  # tree order
    want = dict(zip(names, numpy_oracle.psum_tree([tree[k] for k in names], [configs[k] for k in names], KEY)))
    for name in ("a", "b", "c"):
        _replicas_identical(out[name])
        assert_same_bits(out[name][0], want[name], f"leaf {name}")
    # d: buffers of 524 values (8 whole buckets and 12 skipped) and 300 (4 and 44): heads compressed, tails exact.
    heads = np.r_[0:512, 524:524 + 256]
    assert_same_bits(out["d"][0][heads], want["d"][heads], "leaf d: compressed heads")
    np.testing.assert_allclose(out["d"][0], want["d"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["small"][0], want["small"], rtol=1e-5, atol=1e-6)
    # Buffer 0 (a[:524]) and d's first buffer hold the same values but round with different seeds.
    assert not np.array_equal(out["a"][0][:512], out["d"][0][:512])


def test_testing_simulate_equals_the_numpy_oracle():
    """jax_cgx.testing.simulate / simulate_ring, the user's single-program tools, agree bit for bit
    with the oracle written from the documents."""
    from jax_cgx import testing

    xs = np.asarray(rows(1003, seed=6))
    for algorithm, simulate in (("sra", testing.simulate), ("ring", testing.simulate_ring)):
        config = CompressionConfig(bits=3, bucket_size=64, stochastic=True, algorithm=algorithm, min_size=16)
        seeds = seed_rows(KEY, config, W)
        find = numpy_oracle.sra if algorithm == "sra" else numpy_oracle.ring
        want = find(xs, np.asarray(seeds), bits=3, bucket_size=64, stochastic=True)
        got, scales = jax.jit(functools.partial(simulate, chunk=want.chunk, bits=3, bucket_size=64, stochastic=True,
                                                impl="kernel"))(jnp.asarray(xs), seeds)
        assert_same_bits(np.asarray(got), want.out, algorithm)
        for name, s in scales.items():
            s, w = np.array(s), np.array(want.scales[name])
            if name == "quantized":  # [owner, rank, bucket]: the owner's own chunk is never sent
                s[np.arange(W), np.arange(W)] = w[np.arange(W), np.arange(W)] = 0
            assert_same_bits(s, w, f"{algorithm}: scales {name}")


def _run(fn, tree, key):
    """``fn(tree_on_rank, key)`` on device i's ``tree[...][i]``; every device's result stacked."""
    body = lambda t, k: jax.tree.map(lambda o: o[None], fn(jax.tree.map(lambda a: a[0], t), k))  # noqa: E731
    out = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("d"), P()), out_specs=P("d")))(
        jax.tree.map(lambda v: per_device(v, mesh_1d()), tree), key)
    return jax.tree.map(np.asarray, out)


def test_psum_scatter_and_all_gather_equal_the_numpy_oracle():
    """Stochastic, several fusion buffers of whole leaves (one holding two leaves): each buffer one
    exchange with its own seeds, bitwise docs/algorithm.md's reduce-scatter and all-gather."""
    rng = np.random.default_rng(36)
    cfg = CompressionConfig(bits=3, bucket_size=16, stochastic=True, fusion_buffer_mb=0.002, min_size=16)  # 65 values per block
    data = lambda *shape: (rng.standard_normal((W, *shape)) * np.exp(rng.uniform(-2, 2, (W,) + (1,) * len(shape)))  # noqa: E731
                           ).astype(np.float32)
    tree = {"a": data(W * 40), "b": data(W * 20), "c": data(W * 30, 3)}  # buffers [a, b], [c]
    out = _run(lambda t, k: jax_cgx.compressed_psum_scatter(t, "d", cfg, tiled=True, key=k), tree, KEY)
    want = numpy_oracle.psum_scatter_tree([tree[k] for k in "abc"], cfg, KEY)
    for name, w in zip("abc", want):
        assert_same_bits(out[name], w, f"psum_scatter {name}")
    shards = {"a": data(30), "b": data(10, 2), "c": data(100)}  # buffers [a, b], [c]
    out = _run(lambda t, k: jax_cgx.compressed_all_gather(t, "d", cfg, key=k), shards, KEY)
    want = numpy_oracle.all_gather_tree([shards[k] for k in "abc"], cfg, KEY)
    for name, w in zip("abc", want):
        for r in range(W):
            assert_same_bits(out[name][r], w, f"all_gather {name} on replica {r}")
