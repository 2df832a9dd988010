"""How a data-parallel step's gradients are averaged over the devices: in the backward pass, bucket
by bucket (:func:`marked` puts :func:`~jax_cgx._src.collectives.backward.reduce_in_backward` on each
bucket of parameters, :func:`buckets` says which leaves share one), or after it as one
:func:`~jax_cgx._src.collectives.psum.compressed_pmean` of the whole tree (:func:`mean_of_gradients`).
Either way the config is resolved once, on the parameters' tree, where each leaf's path is known."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cgx._src.collectives.backward import reduce_in_backward
from jax_cgx._src.collectives.plan import ConfigSpec, LeafConfigs, leaf_configs
from jax_cgx._src.collectives.psum import compressed_pmean
from jax_cgx._src.collectives.shards import local_shape
from jax_cgx._src.data_parallel.checks import API, differentiable

__all__ = ["bucket_bytes", "buckets", "varying_copy", "mean_of_gradients", "marked"]


def bucket_bytes(bucket_mb) -> int:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or not bucket_mb > 0 \
            or not math.isfinite(bucket_mb):
        raise ValueError(f"{API}: bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
    return max(1, int(bucket_mb * 2**20))


def buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[tuple[int, ...]]:
    """The leaves (indices into ``nbytes``, each leaf's size in bytes) averaged together in the
    backward pass, in the order their last gradient is expected.

    Leaves are taken last first, the order backward produces a model's layers in. A leaf of at
    least ``bucket_bytes`` is a bucket of its own: its exchange starts as soon as it exists and
    needs no copy into a fusion buffer (on the step of docs/performance.md, fusing the 16 MiB
    weights cost more in copies than a bucket's extra exchange). Smaller leaves (biases,
    normalization scales, a small model's layers) fill a bucket until it holds ``bucket_bytes``.
    Within a bucket, leaves keep their tree order.
    """
    out, pending, filled = [], [], 0
    for i in reversed(range(len(nbytes))):
        if nbytes[i] >= bucket_bytes:
            out.append((i,))
            continue
        pending.append(i)
        filled += nbytes[i]
        if filled >= bucket_bytes:
            out.append(tuple(sorted(pending)))
            pending, filled = [], 0
    if pending:
        out.append(tuple(sorted(pending)))
    return out


def varying_copy(params, axes):
    """``params`` typed as varying over ``axes`` (each device's own gradient), but for integer
    leaves: their float0 gradients stay replicated, as the result's spec says."""
    return jax.tree.map(lambda v: lax.pcast(v, axes, to="varying") if differentiable(v) else v, params)


def _resolved(tree, config: ConfigSpec, specs):
    """``(treedef, leaves, configs, spec_leaves)`` of ``tree`` (the parameters or their gradients,
    alike): its config resolved once on the whole tree, each leaf's path known; ``specs`` (a pytree
    like it, or None) one per leaf."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves = [p for p, _ in with_paths], [v for _, v in with_paths]
    configs = leaf_configs(config, tree, paths, API)
    spec_leaves = [None] * treedef.num_leaves if specs is None else treedef.flatten_up_to(specs)
    return treedef, leaves, configs, spec_leaves


def mean_of_gradients(grads, axes: tuple, config: ConfigSpec, key, specs=None):
    """:func:`compressed_pmean` of the whole gradient tree (``in_backward=False``), its config
    resolved on that tree (a config pytree or function sees the parameters' paths). ``float0``
    gradients (an integer leaf's, under ``allow_int``: nothing to average) are returned as they are."""
    treedef, leaves, configs, spec_leaves = _resolved(grads, config, specs)
    real = [i for i, g in enumerate(leaves) if jnp.result_type(g) != jax.dtypes.float0]
    reduced = compressed_pmean([leaves[i] for i in real], axes, LeafConfigs(configs[i] for i in real), key=key,
                               specs=None if specs is None else [spec_leaves[i] for i in real])
    for i, g in zip(real, reduced):
        leaves[i] = g
    return treedef.unflatten(leaves)


def marked(params, axes: tuple, config: ConfigSpec, key, bucket_bytes: int, specs=None):
    """``params`` with each bucket of leaves marked by :func:`reduce_in_backward`, its config the
    leaves' own (a config pytree or function is resolved on the whole tree, with its paths), its
    specs their sharding over the mesh axes left to the partitioner (buckets are filled with
    each device's shards)."""
    treedef, leaves, configs, spec_leaves = _resolved(params, config, specs)
    # Integer leaves (allow_int) have float0 gradients: nothing to average, so no bucket.
    nbytes = [math.prod(local_shape(jnp.shape(v), s or P())) * jnp.result_type(v).itemsize
              if differentiable(v) else 0 for v, s in zip(leaves, spec_leaves)]
    out = list(leaves)
    for b, members in enumerate(buckets(nbytes, bucket_bytes)):
        members = tuple(i for i in members if differentiable(leaves[i]))
        if not members:
            continue
        bucket_key = None if key is None else jax.random.fold_in(key, b)
        marked = reduce_in_backward(tuple(leaves[i] for i in members), axes, LeafConfigs(configs[i] for i in members),
                                    key=bucket_key,
                                    specs=None if specs is None else tuple(spec_leaves[i] for i in members))
        for i, leaf in zip(members, marked):
            out[i] = leaf
    return treedef.unflatten(out)
