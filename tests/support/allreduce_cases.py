"""Helpers for the all-reduce tests: meshes, a shard_map runner, the oracle and the error bound.

The oracles are tests/support/numpy_oracle.py's, written from docs/format.md and docs/algorithm.md
alone: they share no code with jax_cgx (its chunking, row dispatch, seeds or codec).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle
from codec_cases import flushed, step_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx

W = 8


def mesh_1d():
    return device_mesh((W,), ("d",))


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
    ``(out, scales, chunk)``: the scales each quantization used (for inspection: the bounds
    take theirs from the data, :func:`sra_bound`), the chunk length."""
    xs = np.asarray(xs)
    return tuple(numpy_oracle.sra(xs, np.asarray(seed_rows(key, config, xs.shape[0], buffer_index, ranks)),
                                  bits=config.bits, bucket_size=config.bucket_size, stochastic=config.stochastic,
                                  skip_incomplete_buckets=config.skip_incomplete_buckets))


@jax.jit
def exact_psum(xs):
    """``lax.psum`` over 'd' of row i on device i (the uncompressed reference), from device 0."""
    f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh_1d(), in_specs=P("d"), out_specs=P())
    return f(xs)[0]


# ------------------------------------------------------------------ ring and meshes


def mesh_2d(shape, names=("a", "b")):
    return device_mesh(shape, names)


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
    ``(out, scales, chunk)``: the scales each hop used (for inspection: the bounds take theirs
    from the data, :func:`ring_bound`), the chunk length."""
    xs = np.asarray(xs)
    return tuple(numpy_oracle.ring(xs, np.asarray(seed_rows(key, config, xs.shape[0], buffer_index, ranks)),
                                   bits=config.bits, bucket_size=config.bucket_size, stochastic=config.stochastic,
                                   skip_incomplete_buckets=config.skip_incomplete_buckets))


# ------------------------------------------------------------ bounds from the data


def _chunk_rule(n: int, world: int, bucket_size: int, whole_buckets: bool) -> int:
    """Values per chunk, as docs/algorithm.md ("SRA", step 1) documents it (not read from the library):
    a multiple of the bucket when whole buckets are asked for or every rank holds at least 64
    buckets, otherwise a multiple of 16."""
    per_rank = -(-n // world)
    align = bucket_size if whole_buckets or per_rank >= 64 * bucket_size else 16
    return -(-per_rank // align) * align


def _buckets(starts: np.ndarray, n: int):
    """Per-element ``(spread, top)`` over the buckets starting at ``starts`` (of ``n`` real values)."""
    lengths = np.diff(np.append(starts, n))

    def spread(a):
        return np.repeat(np.maximum.reduceat(a, starts, -1) - np.minimum.reduceat(a, starts, -1), lengths, -1)

    def top(a):
        return np.repeat(np.maximum.reduceat(a, starts, -1), lengths, -1)

    return spread, top


def _windows(bucket_size: int):
    """Per-element ``(spread, top)`` over the ``2B - 1`` values around each element: a bucket holding
    an element lies inside that window whatever the buffer, chunk and padding boundaries are."""

    def reduce(a, fn):
        pad = np.full(a.shape[:-1] + (bucket_size - 1,), np.nan)
        view = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, a, pad], -1), 2 * bucket_size - 1, -1)
        return fn(view, axis=-1)

    return (lambda a: reduce(a, np.nanmax) - reduce(a, np.nanmin)), (lambda a: reduce(a, np.nanmax))


def _rounding(x64):
    """float32 rounding of the W-term sums (a factor 4 of slack, as before)."""
    return x64.shape[0] * 2.0**-22 * (np.abs(x64).sum(0) + np.abs(x64.sum(0)))


def _sra_error(x64, spread, top, owner, bits, stochastic, slack):
    """docs/algorithm.md, "Error bound": every peer's quantization of the element's bucket plus the
    re-quantized sum's, each ``factor * scale``; the scales bounded from the data: a peer's from its
    bucket's range, the sum's from the exact sum's range widened by twice the first stage's error.
    ``owner``: the rank owning each element's chunk (its values enter exactly), None if unknown
    (every rank counted). ``slack[W, n]``: how far each rank's input may be from ``x64``."""
    w, n = x64.shape
    f = (1.0 if stochastic else 0.5) + 1e-4
    steps = step_bound(spread(x64) + 2 * top(slack), bits)  # [W, n]
    peers = steps.sum(0) if owner is None else steps.sum(0) - steps[owner, np.arange(n)]
    first = f * peers + slack.sum(0) + _rounding(x64)  # |owner's float32 sum - exact|
    return first + f * step_bound(spread(x64.sum(0)) + 2 * top(first), bits)


def _ring_error(x64, spread, top, owner, bits, stochastic, slack):
    """docs/algorithm.md, "Error bound (ring)": chunk o is quantized by rank o+1, then the partial sum
    is re-quantized at ranks o+2, ..., o+W = o. Each quantization errs by ``factor * scale``, its
    scale bounded by the exact partial sum's bucket range widened by twice the error so far."""
    w, n = x64.shape
    f = (1.0 if stochastic else 0.5) + 1e-4
    cols = np.arange(n)
    partial, err = np.zeros(n), np.zeros(n)
    for h in range(1, w + 1):
        r = (owner + h) % w
        partial = partial + x64[r, cols]
        err = err + slack[r, cols]
        err = err + f * step_bound(spread(partial) + 2 * top(err), bits) + 2.0**-23 * (np.abs(partial) + err)
    return err + _rounding(x64)


def _one_buffer_bound(xs, out, config, n, slack, error):
    x64 = flushed(xs)
    w, v = x64.shape
    n = v if n is None else n
    b = config.bucket_size
    head = n - n % b if config.skip_incomplete_buckets else n
    q = min(v, head)  # the quantized values; the rest (skip_incomplete_buckets' tail) is exact
    slack = np.zeros_like(x64) if slack is None else np.asarray(slack, np.float64)
    bound = slack.sum(0) + _rounding(x64)  # the exact lane
    if q and w > 1:
        c = _chunk_rule(head, w, b, config.skip_incomplete_buckets)
        starts = np.unique(np.concatenate([o * c + np.arange(0, c, b) for o in range(w)]))
        spread, top = _buckets(starts[starts < q], q)
        owner = np.arange(q) // c
        bound[:q] = error(x64[:, :q], spread, top, owner, config.bits, config.stochastic, slack[:, :q])
    return _against_exact(x64, out, bound)


def sra_bound(xs, out, config, n=None, slack=None):
    """``|out - exact|`` per element and its bound (docs/algorithm.md, "Error bound") for one buffer
    reduced by SRA, every scale derived from the inputs and the documented chunking, none read back
    from the collective or an oracle.

    ``xs[W, v]``: each rank's real values of a buffer of ``n >= v`` values (default ``v``; more when
    the buffer is a hierarchical shard padded past its real values). ``out[v]``: the result.
    ``slack[W, v]``: a known uncertainty of each rank's input (default 0).
    """
    return _one_buffer_bound(xs, out, config, n, slack, _sra_error)


def ring_bound(xs, out, config, n=None, slack=None):
    """:func:`sra_bound` for the ring (docs/algorithm.md, "Error bound (ring)")."""
    return _one_buffer_bound(xs, out, config, n, slack, _ring_error)


def sra_window_bound(xs, out, config):
    """:func:`sra_bound` where the buffer and chunk boundaries are not worked out
    (values spanning several fusion buffers): each bucket lies within the ``2B - 1`` values around
    an element of the stream ``xs[W, N]`` (one dtype's quantized leaves, in tree order), and every
    rank's quantization is counted (the owner's is not, but which rank owns what is not known)."""
    x64 = flushed(xs)
    spread, top = _windows(config.bucket_size)
    bound = _sra_error(x64, spread, top, None, config.bits, config.stochastic, np.zeros_like(x64))
    return _against_exact(x64, out, bound)


def _against_exact(x64, out, bound):
    out = np.asarray(out)
    out64 = np.asarray(out, np.float64)
    eps = {np.dtype(np.float32): 2.0**-23, np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(np.float16): 2.0**-10}
    bound = bound + eps[out.dtype] * np.abs(out64)  # the decode's rounding to the output dtype
    return np.abs(out64 - x64.sum(0)), bound


def hierarchical_bound(xs, out, config):
    """``|out - exact|`` and its bound for a hierarchical reduction of ``xs[nodes, local, n]``: the
    node sums (float32, up to ``local * 2^-23`` of ``sum |x|`` from exact: the slack of each
    outer rank's input) cut into ``local`` shards as docs/algorithm.md ("Hierarchical") documents,
    each reduced over the nodes by SRA or the ring (:func:`sra_bound`, :func:`ring_bound`)."""
    x64 = flushed(xs)
    nodes, local, n = x64.shape
    b = config.bucket_size
    head = n - n % b if config.skip_incomplete_buckets else n
    align = local * (b if config.skip_incomplete_buckets else 1)
    shard = -(-head // align) * align // local
    node_sums = x64.sum(1)
    slack = local * 2.0**-23 * np.abs(x64).sum(1)
    err, bound = np.zeros(n), np.zeros(n)
    out = np.asarray(out)
    for j in range(local):
        real = slice(j * shard, min((j + 1) * shard, head))
        if real.start < real.stop:
            outer = ring_bound if config.algorithm == "ring" else sra_bound
            err[real], bound[real] = outer(node_sums[:, real], out[real], config, n=shard, slack=slack[:, real])
    tail = slice(head, n)
    exact = x64.sum((0, 1))
    err[tail] = np.abs(np.asarray(out[tail], np.float64) - exact[tail])
    bound[tail] = 2.0**-21 * nodes * local * np.abs(x64[..., tail]).sum((0, 1))
    return err, bound


def half_psum_bound(xs, out, half_dtype):
    """``bits=16``: every rank's value cast to ``half_dtype`` (half an ulp), summed by psum in that
    dtype (one rounding per addition, to half an ulp of the partial sum: W-1 of them, plus the
    final one), then cast back exactly. Bounded in units of ``2^-(mantissa bits + 1)``."""
    x64 = np.asarray(xs, np.float64)
    w = x64.shape[0]
    u = 2.0 ** -(jnp.finfo(half_dtype).nmant + 1)
    tiny = float(jnp.finfo(half_dtype).smallest_subnormal)
    magnitude = np.abs(x64).sum(0) * (1 + u) ** w
    bound = u * np.abs(x64).sum(0) + w * u * magnitude + w * tiny
    return np.abs(np.asarray(out, np.float64) - x64.sum(0)), bound


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

