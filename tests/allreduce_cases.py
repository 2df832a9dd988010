"""Helpers for the all-reduce tests: meshes, a shard_map runner, the oracle and the error bound."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import _ring, _sra

W = 8


def mesh_1d():
    return jax.make_mesh((W,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


def per_device(xs, mesh, spec=P("d")):
    return jax.device_put(xs, NamedSharding(mesh, spec))


def psum_1d(xs, key, config, check_vma=True, impl="auto", mean=False):
    """compressed_psum over 'd' of row i on device i; every device's result, as numpy."""
    return np.asarray(psum_1d_jit(xs, key, config, check_vma=check_vma, impl=impl, mean=mean))


@functools.partial(jax.jit, static_argnames=("config", "check_vma", "impl", "mean"))
def psum_1d_jit(xs, key, config, check_vma=True, impl="auto", mean=False):
    """compressed_psum over 'd' of row i on device i; returns every device's result, stacked."""
    fn = jax_cgx.compressed_pmean if mean else jax_cgx.compressed_psum

    def body(x, k):
        return fn(x[0], "d", config, key=k, impl=impl)[None]

    return jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("d"), P()), out_specs=P("d"), check_vma=check_vma)(
        xs, key
    )


def seed_rows(key, config, world, buffer_index=0, ranks=None):
    """The seeds rank r uses for one buffer: what compressed_psum derives from the key.

    ``ranks``: the index each rank folds into the key (``lax.axis_index`` over all the
    reduced axes); by default ``0..world-1``. Hierarchical mode reduces over a subset of
    the ranks, which keep their index over all axes.
    """
    if not config.stochastic:
        return jnp.zeros((world, world + 1, 2), jnp.uint32)
    rows = []
    for r in range(world) if ranks is None else ranks:
        k = jax.random.fold_in(jax.random.fold_in(key, int(r)), buffer_index)
        rows.append(jax.random.bits(k, (1, world + 1, 2), jnp.uint32)[0])
    return jnp.stack(rows)


def oracle(xs, config, key=None, ranks=None):
    """The SRA result computed in one program (pure-JAX reference), with its scales."""
    w, n = xs.shape
    chunk = _sra.chunk_length(n, w, config.bucket_size, config.skip_incomplete_buckets)
    return _sra.simulate(
        jnp.asarray(xs),
        seed_rows(key, config, w, ranks=ranks),
        chunk=chunk,
        bits=config.bits,
        bucket_size=config.bucket_size,
        stochastic=config.stochastic,
    ) + (chunk,)


def sra_bound(xs, out, scales, chunk, bucket_size, stochastic=False):
    """|out - exact| per element and the analytic bound of ARCHITECTURE.md section 3.

    For an element of chunk o: sum over peers r != o of s_r/2 (the owner's own chunk is
    exact) plus s_sum/2 for the re-quantized sum; stochastic rounding doubles each term.
    Plus float32 rounding of the W-term sum.
    """
    xs = np.asarray(xs, np.float64)
    w, n = xs.shape
    exact = xs.sum(0)
    per_value = np.zeros(w * chunk)
    q = np.asarray(scales["quantized"], np.float64)  # [owner, rank, bucket]
    s = np.asarray(scales["summed"], np.float64)  # [owner, bucket]
    for o in range(w):
        peers = q[o].sum(0) - q[o, o]
        per_bucket = peers + s[o]
        per_value[o * chunk : (o + 1) * chunk] = np.repeat(per_bucket, bucket_size)[:chunk]
    factor = 1.0 if stochastic else 0.5
    rounding = 2.0**-22 * (np.abs(xs).sum(0) + np.abs(exact)) * w
    bound = per_value[:n] * (factor + 1e-4) + rounding
    return np.abs(np.asarray(out, np.float64) - exact), bound


@jax.jit
def exact_psum(xs):
    """``lax.psum`` over 'd' of row i on device i (the uncompressed reference), from device 0."""
    f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh_1d(), in_specs=P("d"), out_specs=P())
    return f(xs)[0]


# ------------------------------------------------------------------ ring and meshes


def mesh_2d(shape, names=("a", "b")):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def psum_grid(xs, mesh, axes, config, key=None, check_vma=True, impl="auto"):
    """compressed_psum over ``axes`` of ``xs[*mesh.shape, n]`` (one row per device); every device's result."""
    names = mesh.axis_names
    spec = P(*names)
    lead = (0,) * len(names)

    def body(x, k):
        return jax_cgx.compressed_psum(x[lead], axes, config, key=k, impl=impl)[(None,) * len(names)]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=check_vma))
    return np.asarray(f(jax.device_put(xs, NamedSharding(mesh, spec)), key))


def reduction_groups(a, names, axes):
    """``a[*mesh_shape, n]`` as ``[G, W, n]``: the groups a reduction over ``axes`` forms.

    Groups are the devices that share the other coordinates (in mesh order); within a group,
    ranks are numbered like ``lax.axis_index(axes)``: row-major over ``axes`` as listed.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    a = np.asarray(a)
    others = [i for i, name in enumerate(names) if name not in axes]
    reduced = [names.index(name) for name in axes]
    moved = a.transpose(*others, *reduced, a.ndim - 1)
    w = int(np.prod([a.shape[i] for i in reduced]))
    return moved.reshape(-1, w, a.shape[-1])


@functools.partial(jax.jit, static_argnames=("chunk", "bits", "bucket_size", "stochastic"))
def _simulate_ring(xs, seeds, *, chunk, bits, bucket_size, stochastic):
    return _ring.simulate_ring(xs, seeds, chunk=chunk, bits=bits, bucket_size=bucket_size, stochastic=stochastic)


def ring_oracle(xs, config, key=None, ranks=None):
    """The ring result computed in one program (pure-JAX reference): ``(out, scales, chunk)``."""
    w, n = xs.shape
    chunk = _sra.chunk_length(n, w, config.bucket_size, config.skip_incomplete_buckets)
    out, scales = _simulate_ring(
        jnp.asarray(xs),
        seed_rows(key, config, w, ranks=ranks),
        chunk=chunk,
        bits=config.bits,
        bucket_size=config.bucket_size,
        stochastic=config.stochastic,
    )
    return out, scales, chunk


def ring_bound(xs, out, scales, chunk, bucket_size, stochastic=False):
    """|out - exact| per element and the analytic bound of the ring (docs/algorithm.md).

    An element of chunk o went through W quantizations (its first one, the W-2
    re-quantizations of the partial sum, the final one): the error is at most the sum of
    their scales / 2 (nearest) or of their scales (stochastic), plus float32 rounding of
    the W-term sum and of the W decodes.
    """
    xs = np.asarray(xs, np.float64)
    w, n = xs.shape
    exact = xs.sum(0)
    hops = np.asarray(scales["hops"], np.float64)  # [owner, hop, bucket]
    per_value = np.repeat(hops.sum(1), bucket_size, axis=1)[:, :chunk].reshape(-1)
    factor = 1.0 if stochastic else 0.5
    rounding = 2.0**-22 * (np.abs(xs).sum(0) + np.abs(exact)) * w
    bound = per_value[:n] * (factor + 1e-4) + rounding
    return np.abs(np.asarray(out, np.float64) - exact), bound
