"""Helpers for the all-reduce tests: meshes, a shard_map runner, the oracle and the error bound."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import _sra

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


def seed_rows(key, config, world, buffer_index=0):
    """The seeds rank r uses for one buffer: what compressed_psum derives from the key."""
    if not config.stochastic:
        return jnp.zeros((world, world + 1, 2), jnp.uint32)
    rows = []
    for r in range(world):
        k = jax.random.fold_in(jax.random.fold_in(key, r), buffer_index)
        rows.append(jax.random.bits(k, (1, world + 1, 2), jnp.uint32)[0])
    return jnp.stack(rows)


def oracle(xs, config, key=None):
    """The SRA result computed in one program (pure-JAX reference), with its scales."""
    w, n = xs.shape
    chunk = _sra.chunk_length(n, w, config.bucket_size, config.skip_incomplete_buckets)
    return _sra.simulate(
        jnp.asarray(xs),
        seed_rows(key, config, w),
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
