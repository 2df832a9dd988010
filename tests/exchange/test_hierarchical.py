"""hierarchical=True: uncompressed intra-node reduce-scatter, compressed cross-node exchange, intra-node all-gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import hierarchical_bound, mesh_2d, oracle, psum_grid, ring_oracle
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.collectives import bytes_on_wire
from jax_cgx._src.exchange.hierarchical import hierarchical_shard

KEY = jax.random.key(5)
NAMES = ("node", "local")
AXES = ("node", "local")  # outer (cross-node) first, inner (intra-node) last


def grid(shape, n, seed=0):
    x = jax.random.normal(jax.random.key(seed), (*shape, n), jnp.float32)
    return np.asarray(x * jnp.logspace(-2, 1, n))


def hierarchical_oracle(xs, config, key=None):
    """The exact inner (per-node) sums, then the compressed algorithm's oracle over each outer group.

    ``xs[nodes, local, n]``. Returns ``expected`` for the compressed values (the head; with
    ``skip_incomplete_buckets`` the tail is reduced exactly): the result the collective gives
    when its intra-node sums equal numpy's float32 sums (in order ``local = 0, 1, ...``).
    (The error bound, from the data: allreduce_cases.hierarchical_bound.)
    """
    nodes, local, n = xs.shape
    head_n = (n // config.bucket_size) * config.bucket_size if config.skip_incomplete_buckets else n
    inner = xs[:, 0].astype(np.float32)
    for j in range(1, local):
        inner = inner + xs[:, j]
    shard_n = hierarchical_shard(head_n, local, config)
    padded = np.zeros((nodes, local * shard_n), np.float32)
    padded[:, :head_n] = inner[:, :head_n]
    expected = []
    for j in range(local):
        x_g = padded[:, j * shard_n : (j + 1) * shard_n]  # shard j of every node's sum
        ranks = [i * local + j for i in range(nodes)]  # each rank folds in its index over all axes
        if config.algorithm == "ring":
            out_j = ring_oracle(x_g, config, key, ranks)[0]
        else:
            out_j = oracle(x_g, config, key, ranks)[0]
        expected.append(np.asarray(out_j))
    return np.concatenate(expected)[:head_n]


def check(shape, config, n=1003, seed=0):
    xs = grid(shape, n, seed)
    key = KEY if config.stochastic else None
    out = psum_grid(xs, mesh_2d(shape, NAMES), AXES, config, key).reshape(-1, n)
    for r in range(1, out.shape[0]):
        assert_same_bits(out[r], out[0], f"replica {r} vs replica 0")
    expected = hierarchical_oracle(xs, config, key)
    head = expected.size
    exact = xs.astype(np.float64).sum((0, 1))
    err, bound = hierarchical_bound(xs, out[0], config)  # scales from the data
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"
    if shape[1] == 2:
        # A sum of two float32 values is the same in any order: the intra-node sums are
        # numpy's, bit for bit, and so is the compressed result.
        assert_same_bits(out[0, :head], expected, "collective vs oracle")
    if head < n:
        np.testing.assert_allclose(out[0, head:], exact[head:], rtol=1e-5, atol=1e-5)
    return out


CONFIGS = {
    "sra-nearest": CompressionConfig(bits=4, bucket_size=64, hierarchical=True, min_size=16),
    "sra-stochastic": CompressionConfig(bits=3, bucket_size=64, stochastic=True, hierarchical=True, min_size=16),
    "ring-nearest": CompressionConfig(bits=5, bucket_size=32, algorithm="ring", hierarchical=True, min_size=16),
    "ring-stochastic": CompressionConfig(bits=2, bucket_size=64, stochastic=True, algorithm="ring", hierarchical=True, min_size=16),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_replicas_identical_and_bound(shape, config):
    check(shape, config, seed=config.bits)


def test_skip_incomplete_buckets():
    """The head is cut into whole buckets per shard; the tail is reduced exactly."""
    config = CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=True, hierarchical=True, min_size=16)
    check((4, 2), config, n=1003)


def test_one_node_is_an_exact_psum():
    xs = grid((1, 8), 500)
    out = psum_grid(xs, mesh_2d((1, 8), NAMES), AXES, CompressionConfig(bits=2, hierarchical=True, min_size=16))
    np.testing.assert_allclose(out[0, 0], xs.astype(np.float64).sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_single_axis_raises():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    config = CompressionConfig(bits=4, hierarchical=True, min_size=16)
    f = jax.shard_map(lambda x: jax_cgx.compressed_psum(x[0], "d", config)[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    xs = jax.device_put(jnp.ones((8, 100)), NamedSharding(mesh, P("d")))
    with pytest.raises(ValueError, match=r"hierarchical=True needs a reduction over \(cross-node axes"):
        jax.jit(f)(xs)


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_like_psum_and_invariant_result(check_vma):
    shape, n = (2, 4), 640
    mesh = mesh_2d(shape, NAMES)
    xs = jax.device_put(grid(shape, n), NamedSharding(mesh, P(*NAMES)))
    config = CompressionConfig(bits=8, bucket_size=64, hierarchical=True, min_size=16)
    weights = jnp.linspace(-1, 1, n)

    def grads(reduce):
        body = lambda x: jax.grad(lambda v: jnp.sum(reduce(v) * weights))(x[0, 0])[None, None]  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=P(*NAMES), out_specs=P(*NAMES), check_vma=check_vma)
        return np.asarray(jax.jit(f)(xs))

    g = grads(lambda v: jax_cgx.compressed_psum(v, AXES, config))
    g_ref = grads(lambda v: jax.lax.psum(v, AXES))
    if check_vma:
        assert_same_bits(g, g_ref)
        # Like psum's, the result is invariant over both axes: it can leave shard_map unsharded.
        f = jax.shard_map(lambda x: jax_cgx.compressed_psum(x[0, 0], AXES, config), mesh=mesh, in_specs=P(*NAMES), out_specs=P())
        assert jax.jit(f)(xs).shape == (n,)
    else:
        # The transpose is the hierarchical compressed sum of the cotangents, `weights` on every
        # rank: its bound (was: atol 0.4).
        err, bound = hierarchical_bound(np.broadcast_to(np.asarray(weights), (*shape, n)), g[0, 0], config)
        assert np.all(err <= bound), float(np.max(err - bound))


def test_bytes_on_wire():
    tree = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32), "b": jax.ShapeDtypeStruct((10,), jnp.float32)}
    config = CompressionConfig(bits=4, bucket_size=512, hierarchical=True, min_size=16)
    exact_b = 2 * 7 / 8 * 10 * 4  # small leaf: a plain psum over all 8 ranks
    # Inner axis of 4: reduce-scatter + all-gather of 4 shards of 1024 values; the shard
    # goes through SRA over 2 nodes: 1 chunk of 512 values (256 payload bytes + 8 meta) each way.
    inner = 2 * 3 * 1024 * 4
    outer = 2 * 1 * (256 + 8)
    assert bytes_on_wire(tree, 8, config, inner_world=4) == round(inner + outer + exact_b)
    ring = CompressionConfig(bits=4, bucket_size=512, hierarchical=True, algorithm="ring", min_size=16)
    assert bytes_on_wire(tree, 8, ring, inner_world=4) == round(inner + outer + exact_b)
    # One node: an exact psum of everything.
    assert bytes_on_wire(tree, 8, config, inner_world=8) == round(2 * 7 / 8 * (4096 + 10) * 4)
    # Far fewer bytes cross nodes than a flat compressed exchange sends, but more move in total.
    flat = bytes_on_wire(tree, 8, CompressionConfig(bits=4, bucket_size=512, min_size=16))
    assert outer < flat < inner + outer
    with pytest.raises(ValueError, match="inner_world"):
        bytes_on_wire(tree, 8, config)
    with pytest.raises(ValueError, match="must divide"):
        bytes_on_wire(tree, 8, config, inner_world=3)
