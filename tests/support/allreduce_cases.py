"""Helpers for the all-reduce tests: meshes, a shard_map runner, the oracle and the error bound.

The oracles are tests/support/numpy_oracle.py's, written from docs/format.md and docs/algorithm.md
alone: they share no code with jax_cgx (its chunking, row dispatch, seeds or codec).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx

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
    """The seeds rank r draws for one buffer, ``uint32[W, W+1, 2]``, as docs/algorithm.md defines
    them (:func:`numpy_oracle.buffer_seeds`): zeros without stochastic rounding.

    ``ranks``: the index each rank folds into the key (``lax.axis_index`` over all the
    reduced axes); by default ``0..world-1``. Hierarchical mode reduces over a subset of
    the ranks, which keep their index over all axes.
    """
    ranks = range(world) if ranks is None else ranks
    return jnp.asarray(numpy_oracle.rank_seeds(key if config.stochastic else None, ranks, buffer_index, world + 1))


def oracle(xs, config, key=None, ranks=None, buffer_index=0):
    """SRA over the rows of ``xs[W, n]``, from the documents alone (tests/support/numpy_oracle.py):
    ``(out, scales, chunk)``, the scales as :func:`sra_bound` reads them."""
    xs = np.asarray(xs)
    return tuple(numpy_oracle.sra(xs, np.asarray(seed_rows(key, config, xs.shape[0], buffer_index, ranks)),
                                  bits=config.bits, bucket_size=config.bucket_size, stochastic=config.stochastic,
                                  skip_incomplete_buckets=config.skip_incomplete_buckets))


def sra_bound(xs, out, scales, chunk, bucket_size, stochastic=False):
    """|out - exact| per element and the analytic bound of docs/algorithm.md.

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


def ring_oracle(xs, config, key=None, ranks=None, buffer_index=0):
    """The ring over the rows of ``xs[W, n]``, from the documents alone (tests/support/numpy_oracle.py):
    ``(out, scales, chunk)``, the scales as :func:`ring_bound` reads them."""
    xs = np.asarray(xs)
    return tuple(numpy_oracle.ring(xs, np.asarray(seed_rows(key, config, xs.shape[0], buffer_index, ranks)),
                                   bits=config.bits, bucket_size=config.bucket_size, stochastic=config.stochastic,
                                   skip_incomplete_buckets=config.skip_incomplete_buckets))


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


# ------------------------------------------------------------ error-feedback residuals


def residual_grid(xs, mesh, axes, config, key=None, check_vma=True, mean=False, impl="auto"):
    """compressed_psum(return_residual=True) over ``axes`` of ``xs[*mesh.shape, n]`` (one row per device).

    Returns numpy ``(out, residual, plain)``, each ``[*mesh.shape, n]``: every device's
    result, its residual, and the result of the same call without ``return_residual``.
    With ``mean`` the same through compressed_pmean.
    """
    names = mesh.axis_names
    spec = P(*names)
    lead = (0,) * len(names)
    fn = jax_cgx.compressed_pmean if mean else jax_cgx.compressed_psum
    expand = (None,) * len(names)

    def body(x, k):
        out, res = fn(x[lead], axes, config, key=k, impl=impl, return_residual=True)
        plain = fn(x[lead], axes, config, key=k, impl=impl)
        return out[expand], res[expand], plain[expand]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=check_vma))
    return tuple(np.asarray(a) for a in f(jax.device_put(xs, NamedSharding(mesh, spec)), key))


def residual_identity_error(xs, out, residual):
    """``|sum_r residual_r + out - sum_r x_r|`` per element (float64), and its float32 tolerance.

    ``xs``, ``residual``: ``[W, n]`` (one reduction group); ``out``: ``[n]``. The identity
    is exact in real arithmetic; in float32 each of the (at most W) accumulations of a
    partial sum and each residual subtraction rounds once, by at most 2^-24 of the
    magnitudes involved, so the tolerance is ``W * 2^-22 * (sum_r |x_r| + |out| + sum_r
    |residual_r|)`` (a factor 4 of slack). bfloat16/float16 residuals are rounded to their
    dtype: add ``2^-(mantissa bits)`` of ``sum_r |residual_r|``.
    """
    x64 = np.asarray(xs, np.float64)
    r64 = np.asarray(residual, np.float64)
    o64 = np.asarray(out, np.float64)
    w = x64.shape[0]
    err = np.abs(r64.sum(0) + o64 - x64.sum(0))
    magnitude = np.abs(x64).sum(0) + np.abs(o64) + np.abs(r64).sum(0)
    tol = w * 2.0**-22 * magnitude
    dtype = np.asarray(residual).dtype
    if dtype != np.float32:
        tol = tol + 2.0 ** -jnp.finfo(dtype).nmant * np.abs(r64).sum(0)
    return err, tol


def residual_bound(config, scales, chunk, n):
    """The analytic bound of each rank's residual, ``[W, n]``: half a quantization step.

    Every value of rank ``r``'s residual is the error of one quantization rank ``r`` ran
    (SRA: of its chunk ``o`` for the peer ``o``, of the summed chunk ``r`` for itself;
    ring: the ``h``-th quantization of chunk ``o`` runs on rank ``o+1+h``), so it is at
    most ``scale/2`` of that bucket with nearest rounding and ``scale`` with stochastic
    rounding, plus float32 rounding (left to the caller). ``scales`` as the oracles return them.
    """
    b = config.bucket_size
    expand = lambda s: np.repeat(np.asarray(s, np.float64), b, axis=-1)[..., :chunk]  # noqa: E731
    if config.algorithm == "ring":
        hops = expand(scales["hops"])  # [owner, hop, value]
        w = hops.shape[0]
        bound = np.stack([
            np.concatenate([hops[o, (r - o - 1) % w] for o in range(w)]) for r in range(w)
        ])
    else:
        q = expand(scales["quantized"])  # [owner, rank, value]
        s = expand(scales["summed"])  # [owner, value]
        w = q.shape[0]
        bound = np.stack([
            np.concatenate([s[o] if o == r else q[o, r] for o in range(w)]) for r in range(w)
        ])
    factor = 1.0 if config.stochastic else 0.5
    return factor * bound[:, :n]

