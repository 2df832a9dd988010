"""``data_parallel_value_and_grad``: compressed gradient averaging for a plain ``jax.jit`` step.

Most JAX training steps are a ``jax.jit`` of ``jax.value_and_grad`` over a batch sharded along
a mesh axis, and the partitioner inserts the gradient all-reduce itself: by the time the
gradient is a value the program can see, it has been summed in float32 and there is nothing
left to compress. Compressing it needs each device's *own* gradient, which exists only inside
``shard_map``, taken with respect to a copy of the parameters typed as varying over the axis
(``lax.pcast(params, axis, to="varying")``; with the replicated parameters themselves, JAX's
transpose of the implicit broadcast would psum the gradient first).

:func:`data_parallel_value_and_grad` writes that once::

    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=CompressionConfig(bits=4))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)          # grads: the compressed mean, replicated
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

``loss_fn(params, *batch)`` is the loss of one device's shard of the batch (a mean over its
rows); every batch argument is split along its leading axis over ``axis_name``. With
``bits=32`` the result is ``jax.value_and_grad(loss_fn)`` of the whole batch, to float32
rounding (the mean of the shards' means), for a loss whose rows do not depend on each other:
a layer with batch statistics (BatchNorm) sees only its device's rows (docs/flax.md).

Keyword arguments of ``grad_fn`` reach ``loss_fn`` the same on every device and are not
differentiated: model state (BatchNorm statistics), a PRNG key, a step number. They are
arguments rather than closures because ``shard_map`` cannot close over values sharded on
``Explicit`` mesh axes, and they are rebuilt in the trace ``loss_fn`` runs in because a mutable
pytree node (an NNX ``Variable``) may only be written in the trace that made it.

By default each gradient is averaged **in the backward pass**, as PyTorch DDP does: the
parameters' leaves are gathered, last first (the order backward produces them), into buckets of
about ``bucket_mb`` (a leaf at least that large is a bucket of its own, with no copy into a fusion
buffer), and each bucket is :func:`~jax_cgx.compressed_pmean`'d as soon as the backward pass has
produced all of its gradients (:func:`~jax_cgx.reduce_in_backward` on each bucket). The result is
bitwise that of ``compressed_pmean`` applied to each bucket (leaves in their tree order, bucket
``b``'s key ``fold_in(key, b)``); ``in_backward=False`` averages the whole tree in one
``compressed_pmean`` after the backward pass instead. The two differ only in how the values are cut
into exchanges (within the same error bound); docs/performance.md has what each costs.

Optimizer states that differ from device to device (error feedback, top-k and PowerSGD
residuals: :mod:`jax_cgx.optax`) cannot live in a replicated ``jit`` state; those transforms
run inside ``shard_map`` (docs/training.md has the recipe).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_cgx._src.arguments import check_axes, check_bool
from jax_cgx._src.collectives.backward import reduce_in_backward
from jax_cgx._src.collectives.plan import ConfigSpec, leaf_configs
from jax_cgx._src.collectives.psum import compressed_pmean

__all__ = ["data_parallel_value_and_grad", "buckets", "DEFAULT_BUCKET_MB"]

# DDP's default bucket is 25 MB. Ours is smaller: a bucket of many leaves is copied into a fusion
# buffer, and a leaf of at least this size needs no copy (docs/performance.md).
DEFAULT_BUCKET_MB = 4.0


def data_parallel_value_and_grad(fun: Callable[..., Any], *, mesh, axis_name: str | tuple[str, ...] = "data",
                                 config: ConfigSpec = None, has_aux: bool = False, in_backward: bool = True,
                                 bucket_mb: float = DEFAULT_BUCKET_MB, allow_int: bool = False) -> Callable[..., Any]:
    """``jax.value_and_grad(fun)`` over a batch sharded along ``axis_name``, the gradient
    averaged over the devices with :func:`~jax_cgx.compressed_pmean`.

    Args:
      fun: ``fun(params, *batch) -> loss`` (a scalar; with ``has_aux``, ``(loss, aux)``), the
        loss of one device's shard of the batch.
      mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the batch is sharded over; its axes
        may be ``Auto`` or ``Explicit``. Only ``axis_name``'s axes are mapped by hand; others
        (a ``"model"`` axis) stay with XLA's partitioner. Where every mesh axis is one of
        ``axis_name``'s and ``Explicit`` (``jax.make_mesh``'s default), JAX moves no argument
        between shardings: place the batch with ``jax.device_put(x, NamedSharding(mesh,
        P(axis_name)))`` and ``params`` replicated; a ``ValueError`` names any argument that is not.
      axis_name: the mesh axis (or axes) the batch's leading dimension is split over.
      config: as for :func:`~jax_cgx.compressed_pmean`: a ``CompressionConfig``, a pytree of
        them matching ``params``, a function of a leaf's path, or None (``CompressionConfig()``'s
        defaults, 4 bits; torch_cgx's where its ``CGX_*`` variables are set).
      has_aux: ``fun`` returns ``(loss, aux)``; ``aux`` is averaged over the devices like the
        loss (``lax.pmean``).
      in_backward: average each bucket of gradients as soon as the backward pass has produced it
        (the default), or the whole tree after it (``False``).
      bucket_mb: with ``in_backward``, the size (MiB) buckets of small leaves are filled to;
        a leaf of at least this size is a bucket of its own.
      allow_int: as for ``jax.grad``: integer (and bool) leaves of ``params`` get ``float0``
        gradients, which are not averaged (there is nothing to send). Without it such a leaf
        raises a ``ValueError`` naming it.

    Returns:
      ``grad_fn(params, *batch, key=None, **kwargs)`` returning ``(loss, grads)``
      (``((loss, aux), grads)`` with ``has_aux``), all replicated. Call it inside ``jax.jit`` or
      on its own. ``params`` is replicated; each ``batch`` argument is a pytree whose leaves have
      a leading dimension divisible by the number of devices along ``axis_name``. ``key``: a PRNG
      key for stochastic rounding, the same on every device (jax_cgx's, not passed to ``fun``).
      ``kwargs``: pytrees passed on as ``fun(params, *batch, **kwargs)``, replicated (the same
      on every device, not split) and not differentiated.
    """
    if not callable(fun):
        raise TypeError(f"data_parallel_value_and_grad: fun must be callable, got {type(fun).__name__}")
    has_aux = check_bool("data_parallel_value_and_grad", "has_aux", has_aux)
    in_backward = check_bool("data_parallel_value_and_grad", "in_backward", in_backward)
    allow_int = check_bool("data_parallel_value_and_grad", "allow_int", allow_int)
    bucket_bytes = _bucket_bytes(bucket_mb)
    axes = check_axes("data_parallel_value_and_grad", axis_name)
    names = tuple(getattr(mesh, "axis_names", ()))
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"data_parallel_value_and_grad: axis {missing[0]!r} is not an axis of the mesh "
                         f"(its axes: {names}); pass axis_name= one of them")
    world = math.prod(mesh.shape[a] for a in axes)
    batch_spec = P(axes if len(axes) > 1 else axes[0])
    # shard_map moves arguments to its in_specs itself, except on a mesh whose axes are all
    # manual and Explicit: there an argument whose type has another sharding is an error about
    # a shard_map the caller never wrote. Such arguments are checked here, and named.
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    explicit = set(names) == set(axes) and all(types.get(a) == AxisType.Explicit for a in axes)
    arg_names = _argument_names(fun)

    def local(params, key, kwargs, *batch):
        leaves, treedef = jax.tree.flatten(kwargs)

        def differentiated(params):
            # Each device's own gradient: with respect to params typed as varying (as the
            # transpose of the implicit broadcast of replicated params would psum it), averaged in
            # backward by the marks, which type them so themselves.
            mine = _marked(params, axes, config, key, bucket_bytes) if in_backward else params
            # kwargs' pytree nodes rebuilt in the trace fun runs in, as jax.jit gives its function
            # new ones: an NNX Variable (BatchNorm's statistics) may only be written where it was made.
            return fun(mine, *batch, **jax.tree.unflatten(treedef, leaves))

        value_and_grad = jax.value_and_grad(differentiated, has_aux=has_aux, allow_int=allow_int)
        if in_backward:
            value, grads = value_and_grad(params)
        else:
            value, grads = value_and_grad(_varying_copy(params, axes))
            grads = _without_float0(lambda g: compressed_pmean(g, axes, config, key=key), grads)
        return jax.tree.map(lambda v: lax.pmean(v, axes), value), grads

    def grad_fn(params, *batch, key: jax.Array | None = None, **kwargs):
        if not batch:
            raise TypeError("data_parallel_value_and_grad: grad_fn(params, *batch) needs at least one batch "
                            "argument to split over the devices")
        _check_batch(batch, axes, world, arg_names)
        _check_params(params, allow_int)
        if explicit:
            _check_placement(params, key, kwargs, batch, mesh, axes, arg_names)
        # Manual over the data axes only: other mesh axes (e.g. "model") stay with the partitioner.
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *(batch_spec,) * len(batch)),
                               out_specs=P(), axis_names=frozenset(axes))
        return mapped(params, key, kwargs, *batch)

    return grad_fn


def _bucket_bytes(bucket_mb) -> int:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or not bucket_mb > 0 \
            or not math.isfinite(bucket_mb):
        raise ValueError(f"data_parallel_value_and_grad: bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
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


def _differentiable(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _check_params(params, allow_int: bool) -> None:
    if allow_int:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not _differentiable(leaf):
            raise ValueError(
                f"data_parallel_value_and_grad: params{jax.tree_util.keystr(path)} is {jnp.result_type(leaf)}, "
                "which has no gradient: pass allow_int=True (as for jax.grad: its gradient is float0, and nothing "
                "is averaged for it), or pass it as a keyword argument of grad_fn instead of in params")


def _varying_copy(params, axes):
    """``params`` typed as varying over ``axes`` (each device's own gradient), but for integer
    leaves: their float0 gradients stay replicated, as the result's spec says."""
    return jax.tree.map(lambda v: lax.pcast(v, axes, to="varying") if _differentiable(v) else v, params)


def _without_float0(reduce, grads):
    """``reduce`` applied to the gradients that are not ``float0`` (an integer leaf's, under
    ``allow_int``: nothing to average); those are returned as they are."""
    leaves, treedef = jax.tree.flatten(grads)
    real = [i for i, g in enumerate(leaves) if jnp.result_type(g) != jax.dtypes.float0]
    reduced = reduce([leaves[i] for i in real])
    for i, g in zip(real, reduced):
        leaves[i] = g
    return treedef.unflatten(leaves)


def _marked(params, axes: tuple, config: ConfigSpec, key, bucket_bytes: int):
    """``params`` with each bucket of leaves marked by :func:`reduce_in_backward`, its config the
    leaves' own (a config pytree or function is resolved on the whole tree, with its paths)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths, leaves = [p for p, _ in with_paths], [v for _, v in with_paths]
    configs = leaf_configs(config, params, paths, "data_parallel_value_and_grad")
    # Integer leaves (allow_int) have float0 gradients: nothing to average, so no bucket.
    nbytes = [math.prod(jnp.shape(v)) * jnp.result_type(v).itemsize if _differentiable(v) else 0 for v in leaves]
    out = list(leaves)
    for b, members in enumerate(buckets(nbytes, bucket_bytes)):
        members = tuple(i for i in members if _differentiable(leaves[i]))
        if not members:
            continue
        bucket_key = None if key is None else jax.random.fold_in(key, b)
        marked = reduce_in_backward(tuple(leaves[i] for i in members), axes, tuple(configs[i] for i in members),
                                    key=bucket_key)
        for i, leaf in zip(members, marked):
            out[i] = leaf
    return treedef.unflatten(out)


def _argument_names(fun) -> list[str]:
    """The names of ``fun``'s positional parameters (``["params", "x", "y"]``), to name a batch
    argument in an error as its author wrote it; ``[]`` where there is no signature to read."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _batch_where(i: int, path, names: list[str]) -> str:
    # grad_fn(params, *batch) passes batch argument i to fun as its argument i + 1.
    named = f" (`{names[i + 1]}`)" if i + 1 < len(names) else ""
    return f"batch argument {i}{named}{jax.tree_util.keystr(path)}"


def _check_batch(batch, axes, world: int, names: list[str]) -> None:
    for i, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = getattr(leaf, "shape", None)
            where = _batch_where(i, path, names)
            if shape is None or len(shape) == 0:
                raise ValueError(f"data_parallel_value_and_grad: {where} is a scalar; every batch leaf needs a "
                                 f"leading dimension to split over {axes} (pass a constant as a keyword "
                                 "argument of grad_fn: it reaches fun whole, on every device)")
            if shape[0] == 0:
                raise ValueError(f"data_parallel_value_and_grad: {where} has no rows: each of the {world} devices "
                                 "would take the mean of an empty shard (NaN). Skip empty batches before the step")
            if shape[0] % world:
                raise ValueError(f"data_parallel_value_and_grad: {where} has {shape[0]} rows, not divisible by "
                                 f"the {world} devices along {axes}; use a batch size that is a multiple of {world}")


def _check_placement(params, key, kwargs, batch, mesh, axes, names: list[str]) -> None:
    """On a mesh of Explicit axes, every batch leaf must be split along its leading dimension over
    ``axes`` (and nowhere else over them), and ``params``, ``key`` and the keyword arguments
    replicated over them: the types shard_map will not convert. Axes of size 1 split nothing and
    are left out."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    over_axes = repr(axes[0]) if len(axes) == 1 else repr(axes)

    def over(entry) -> tuple:  # the mesh axes ``axes`` among one dimension's spec entry
        if entry is None or entry is P.UNCONSTRAINED:
            return ()
        return tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a in axes)

    def split(leaf) -> tuple[tuple, ...]:  # per dimension, the axes it is split over
        aval = jax.typeof(leaf)
        entries = tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
        return tuple(over(e) for e in entries)

    def refuse(where: str, leaf, wanted: str, name: str, spec: str) -> None:
        aval = jax.typeof(leaf)
        raise ValueError(
            f"data_parallel_value_and_grad: {where} is {aval} with sharding {aval.sharding.spec}; it must be "
            f"{wanted}. Place it first (in or outside jit): jax.device_put({name}, NamedSharding(mesh, {spec})). "
            f"On a mesh of Explicit axes (jax.make_mesh's default) JAX moves no argument to another sharding by "
            f"itself; on a mesh made with axis_types=(AxisType.Auto,) * {len(mesh.axis_names)} it would.")

    for i, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            dims = split(leaf)
            if dims[0] != axes or any(dims[1:]):
                name = names[i + 1] if i + 1 < len(names) else "batch"
                refuse(_batch_where(i, path, names), leaf,
                       f"split along its leading dimension over {over_axes}, and along no other", name,
                       f"P({over_axes})")
    for what, tree in (("params", params), ("key", key), *kwargs.items()):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if any(split(leaf)):
                refuse(f"{what}{jax.tree_util.keystr(path)}", leaf,
                       f"replicated over {over_axes}: every device takes its gradient with all of {what}", what, "P()")
