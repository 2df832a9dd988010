"""``data_parallel_value_and_grad``: compressed gradient averaging for a plain ``jax.jit`` step.

Most JAX training steps are a ``jax.jit`` of ``jax.value_and_grad`` over a batch sharded along
a mesh axis, and the partitioner inserts the gradient all-reduce itself: by the time the
gradient is a value the program can see, it has been summed in float32 and there is nothing
left to compress. Compressing it needs each device's *own* gradient, which exists only inside
``shard_map``, taken with respect to a copy of the parameters typed as varying over the axis
(``lax.pcast(params, axis, to="varying")``; with the replicated parameters themselves, JAX's
transpose of the implicit broadcast would psum the gradient first).

:func:`data_parallel_value_and_grad` writes that once::

    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, config=CompressionConfig(bits=4))  # mesh: jax.set_mesh's

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

What a transformer's step returns and takes (lm1b's, say) has its own switches: ``aux=`` says
what becomes of ``has_aux``'s auxiliary output (averaged, summed, the whole batch's rows, or one
per device); ``weighted=True`` takes a loss that is a sum over tokens with its normalizer (the
result is the whole batch's weighted mean, whatever each device holds); ``device_keys=`` names
the PRNG keys each device folds its index into (dropout), and an undeclared key is refused,
since it would draw the same mask on every device. Every per-row array must be a batch argument:
one ``fun`` closes over is refused when its rows are the batch's.

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

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_cgx._src import compat
from jax_cgx._src.arguments import check_axes, check_bool
from jax_cgx._src.collectives.plan import ConfigSpec
from jax_cgx._src.data_parallel import averaging, checks, model_axes
from jax_cgx._src.data_parallel.checks import API

__all__ = ["data_parallel_value_and_grad", "DEFAULT_BUCKET_MB", "AUX_MODES"]

log = logging.getLogger("jax_cgx")

# DDP's default bucket is 25 MB. Ours is smaller: a bucket of many leaves is copied into a fusion
# buffer, and a leaf of at least this size needs no copy (docs/performance.md).
DEFAULT_BUCKET_MB = 4.0
# What becomes of has_aux's auxiliary output (see data_parallel_value_and_grad).
AUX_MODES = ("mean", "sum", "batch", "per_device")


def data_parallel_value_and_grad(fun: Callable[..., Any], *, mesh=None, axis_name: str | tuple[str, ...] = "data",
                                 config: ConfigSpec = None, has_aux: bool = False, aux: Any = "mean",
                                 weighted: bool = False, device_keys: Sequence[str] = (),
                                 shared_keys: Sequence[str] = (), in_backward: bool = True,
                                 bucket_mb: float = DEFAULT_BUCKET_MB, allow_int: bool = False,
                                 param_specs: Any = None) -> Callable[..., Any]:
    r"""``jax.value_and_grad(fun)`` over a batch sharded along ``axis_name``, the gradient
    averaged over the devices with :func:`~jax_cgx.compressed_pmean`.

    Args:
      fun: ``fun(params, *batch, **kwargs) -> loss`` (a scalar; with ``has_aux``, ``(loss, aux)``),
        the loss of one device's shard of the batch. Every per-row array (inputs, targets,
        positions, segmentation, weights) must be a batch argument: an array ``fun`` closes over
        whose leading dimension is the batch's rows is refused.
      mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the batch is sharded over; its axes
        may be ``Auto`` or ``Explicit``. None (the default): the mesh of the context at each call
        (``with jax.set_mesh(mesh):``, or jax's deprecated ``with mesh:``); a ``ValueError`` if there is none. Only
        ``axis_name``'s axes are mapped by hand; others (``"model"``, ``"fsdp"``, ``"tensor"``)
        stay with XLA's partitioner, which runs the loss sharded as the parameters and the batch
        are, and each gradient is compressed over ``axis_name`` shard by shard, keeping its
        parameter's sharding (see ``param_specs``). Where every mesh axis is one of ``axis_name``'s and ``Explicit``
        (``jax.make_mesh``'s default), JAX moves no argument between shardings: place the batch
        with ``jax.device_put(x, NamedSharding(mesh, P(axis_name)))`` and ``params`` replicated;
        a ``ValueError`` names any argument that is not.
      axis_name: the mesh axis (or axes) the batch's leading dimension is split over.
      config: as for :func:`~jax_cgx.compressed_pmean`: a ``CompressionConfig``, a pytree of
        them matching ``params``, a function of a leaf's path, or None (``CompressionConfig()``'s
        defaults, 4 bits; torch_cgx's where its ``CGX_*`` variables are set).
      has_aux: ``fun`` returns ``(loss, aux)``.
      aux: with ``has_aux``, what each leaf of ``aux`` becomes: ``"mean"`` (the default: averaged
        over the devices, like the loss), ``"sum"`` (summed: counts, weight sums), ``"batch"``
        (each leaf has the device's rows first, as logits do: the whole batch's rows, split over
        the devices as the batch is; nothing is sent), ``"per_device"`` (a new leading axis, one
        entry per device); or a pytree prefix of ``aux`` holding these names, one mode per
        subtree (``("mean", "batch")`` for ``(batch_stats, logits)``). ``"mean"`` warns once of a
        leaf whose leading dimension is a device's rows (logits averaged over devices are seldom
        meant).
      weighted: ``fun`` returns ``(loss_sum, weight_sum)`` instead of a loss (with ``has_aux``,
        ``((loss_sum, weight_sum), aux)``), lm1b's ``compute_weighted_cross_entropy``'s pair:
        the loss and the gradient are those of ``sum(loss_sum) / sum(weight_sum)`` over every
        device, the unsharded step's weighted mean however many real tokens each device holds
        (a mean of the devices' means is that only when they all hold the same number).
      device_keys: names of keyword arguments of ``grad_fn`` that are PRNG keys each device folds
        its index into (``jax.random.fold_in(key, device)``): dropout with a different mask on
        every device's rows, as one unsharded step would draw.
      shared_keys: names of keyword arguments that are PRNG keys meant to be the same on every
        device. Any other keyword argument that is a PRNG key raises a ``ValueError``.
      in_backward: average each bucket of gradients as soon as the backward pass has produced it
        (the default), or the whole tree after it (``False``).
      bucket_mb: with ``in_backward``, the size (MiB) buckets of small leaves are filled to;
        a leaf of at least this size is a bucket of its own.
      allow_int: as for ``jax.grad``: integer (and bool) leaves of ``params`` get ``float0``
        gradients, which are not averaged (there is nothing to send). Without it such a leaf
        raises a ``ValueError`` naming it.
      param_specs: on a mesh with axes besides ``axis_name`` (tensor parallelism, FSDP), how
        each parameter is sharded over them: a pytree prefix of ``params`` holding
        ``PartitionSpec``\ s, ``NamedSharding``\ s (what ``nn.logical_to_mesh_sharding`` gives a
        Flax model) or None. Each device then quantizes and sends only its own shard of each
        gradient over ``axis_name``, and the gradient keeps its parameter's sharding. None (the
        default) takes each parameter's sharding from its type where those axes are ``Explicit``,
        or from the array itself when ``grad_fn`` is called outside ``jax.jit``; under ``jax.jit``
        with ``Auto`` axes it is unknown, and such a gradient is compressed whole on every device
        and returned replicated (a warning says so). A spec may not name ``axis_name``'s axes
        (parameters sharded over the data axis cannot be averaged over it: shard them over an
        ``"fsdp"`` axis instead) and must divide each dimension it splits.

    Returns:
      ``grad_fn(params, *batch, key=None, **kwargs)`` returning ``(loss, grads)``
      (``((loss, aux), grads)`` with ``has_aux``), replicated (``aux`` as ``aux=`` says). Call it
      inside ``jax.jit`` or on its own. ``params`` is replicated; each ``batch`` argument is a
      pytree whose leaves have a leading dimension divisible by the number of devices along
      ``axis_name``. ``key``: a PRNG key for stochastic rounding, the same on every device
      (jax_cgx's, not passed to ``fun``). ``kwargs``: pytrees passed on as
      ``fun(params, *batch, **kwargs)``, replicated (the same on every device, not split; the
      ``device_keys`` folded per device) and not differentiated.

    Raises:
      TypeError: ``fun`` not callable; ``device_keys`` or ``shared_keys`` not names (strings).
      ValueError: ``has_aux``, ``weighted``, ``in_backward`` or ``allow_int`` not a bool; ``aux``
        holding something other than the modes above; a name in both ``device_keys`` and
        ``shared_keys``; ``bucket_mb`` not a positive number; ``axis_name`` empty or not axis names,
        or not an axis of ``mesh``. ``grad_fn`` raises too, naming the argument, for what is
        refused above (a badly placed or split batch, an integer parameter without ``allow_int``, a
        stray PRNG key, no mesh).

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=jax_cgx.CompressionConfig(bits=8))
      >>> w = jax.device_put(jnp.ones((16, 1)), NamedSharding(mesh, P()))
      >>> x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("data")))
      >>> loss, grad = jax.jit(grad_fn)(w, x)
      >>> float(loss), grad.shape, float(grad[0, 0])  # the mean gradient, as jax.value_and_grad gives it
      (256.0, (16, 1), 32.0)
    """
    if not callable(fun):
        raise TypeError(f"{API}: fun must be callable, got {type(fun).__name__}")
    has_aux = check_bool(API, "has_aux", has_aux)
    weighted = check_bool(API, "weighted", weighted)
    in_backward = check_bool(API, "in_backward", in_backward)
    allow_int = check_bool(API, "allow_int", allow_int)
    modes = jax.tree.leaves(aux, is_leaf=lambda m: isinstance(m, str))
    if not modes or not all(isinstance(m, str) and m in AUX_MODES for m in modes):
        raise ValueError(f"{API}: aux must be one of {AUX_MODES}, or a pytree prefix of the aux holding them, "
                         f"got {aux!r}")
    device_keys, shared_keys = _names("device_keys", device_keys), _names("shared_keys", shared_keys)
    if both := set(device_keys) & set(shared_keys):
        raise ValueError(f"{API}: {sorted(both)} are in both device_keys and shared_keys: a key is one or the other")
    bucket_bytes = averaging.bucket_bytes(bucket_mb)
    axes = check_axes(API, axis_name)
    if mesh is not None:
        _layout(mesh, axes)  # checked now, when given
    arg_names = checks.argument_names(fun)
    warned = [False]

    objective = functools.partial(_objective, fun, axes=axes, has_aux=has_aux, weighted=weighted,
                                  device_keys=device_keys)

    def local(world, rows, specs, params, key, kwargs, *batch):
        # Each device's own gradient: with respect to params typed as varying (as the transpose of
        # the implicit broadcast of replicated params would psum it), averaged in backward by the
        # marks, which type them so themselves. `specs`: each parameter's sharding over the mesh
        # axes left to the partitioner (None where unknown or there are none).
        mark = (lambda p: averaging.marked(p, axes, config, key, bucket_bytes, specs)) if in_backward else (lambda p: p)
        differentiated = objective(world, batch, kwargs, mark)
        value_and_grad = jax.value_and_grad(differentiated, has_aux=has_aux, allow_int=allow_int)
        if in_backward:
            value, grads = value_and_grad(params)
        else:
            value, grads = value_and_grad(averaging.varying_copy(params, axes))
            grads = averaging.mean_of_gradients(grads, axes, config, key, specs)
        if not has_aux:
            return lax.pmean(value, axes), grads
        loss, extra = value
        return (lax.pmean(loss, axes), _reduce_aux(extra, aux, axes, rows // world, warned)), grads

    def checked(params, batch, key, kwargs):
        """The mesh, world, batch spec and rows of a call, after checking what it was given."""
        if not batch:
            raise TypeError(f"{API}: grad_fn(params, *batch) needs at least one batch argument to split over the "
                            "devices")
        the_mesh = mesh if mesh is not None else _context_mesh()
        world, batch_spec, explicit = _layout(the_mesh, axes)
        rows = checks.check_batch(batch, axes, world, arg_names)
        checks.check_params(params, allow_int)
        checks.check_closures(fun, rows, world)
        checks.check_keys(kwargs, device_keys, shared_keys)
        if explicit:
            checks.check_placement(params, key, kwargs, batch, the_mesh, axes, arg_names)
        return the_mesh, world, batch_spec, rows

    def grad_fn(params, *batch, key: jax.Array | None = None, **kwargs):
        the_mesh, world, batch_spec, rows = checked(params, batch, key, kwargs)
        aux_spec = jax.tree.map(lambda m: batch_spec if m in ("batch", "per_device") else P(), aux,
                                is_leaf=lambda m: isinstance(m, str))
        out_specs = (((P(), aux_spec) if has_aux else P()), P())
        model = model_axes.model_axes(the_mesh, axes)
        specs = model_axes.param_specs(params, param_specs, the_mesh, axes, model) if model else None
        # Manual over the data axes only: other mesh axes (e.g. "model") stay with the partitioner.
        mapped = model_axes.data_shard_map(lambda *a: local(world, rows, specs, *a), the_mesh, axes, model, specs,
                                           in_specs=(P(), P(), P(), *(batch_spec,) * len(batch)),
                                           out_specs=out_specs)
        return mapped(params, key, kwargs, *batch)

    def leaf_errors(errors_of, params, *batch, **kwargs):
        """``errors_of(grads, axes)`` of each device's own gradient of ``fun`` (not reduced), under
        ``jax.jit``, compiled once per ``errors_of`` and shapes whatever the plan (``config`` plays no
        part): what :meth:`jax_cgx.adaptive.Planner.observe_loss` feeds its planner with."""
        the_mesh, world, batch_spec, _ = checked(params, batch, None, kwargs)
        return _errors_program(fun, has_aux, weighted, device_keys, errors_of, the_mesh, axes, world, batch_spec,
                               len(batch), allow_int)(params, kwargs, *batch)

    grad_fn.leaf_errors = leaf_errors
    return grad_fn


def _objective(fun, world, batch, kwargs, mark, *, axes, has_aux, weighted, device_keys):
    """What a device differentiates: ``fun`` of its shard (``mark`` applied to the parameters), its
    device keys folded with its index, a weighted loss scaled to the whole batch's weight."""
    kwargs = dict(kwargs)
    if device_keys:
        me = lax.axis_index(axes)
        for name in device_keys:
            kwargs[name] = jax.tree.map(lambda k: jax.random.fold_in(k, me), kwargs[name])
    leaves, treedef = jax.tree.flatten(kwargs)

    def differentiated(params):
        # kwargs' pytree nodes rebuilt in the trace fun runs in, as jax.jit gives its function new
        # ones: an NNX Variable (BatchNorm's statistics) may only be written where it was made.
        out = fun(mark(params), *batch, **jax.tree.unflatten(treedef, leaves))
        if not weighted:
            return out
        (total, weight), extra = out if has_aux else (out, None)
        # The gradients are averaged over the devices: each device's sum is scaled by W / the whole
        # batch's weight, so the average is sum(loss sums)' gradient / sum(weight sums).
        overall = lax.psum(lax.stop_gradient(jnp.asarray(weight, jnp.result_type(total))), axes)
        scaled = total * (world / overall)
        return (scaled, extra) if has_aux else scaled

    return differentiated


@functools.lru_cache(maxsize=64)
def _errors_program(fun, has_aux, weighted, device_keys, errors_of, mesh, axes, world, batch_spec, n_batch, allow_int):
    """The jitted shard_map of :func:`data_parallel_value_and_grad`'s ``leaf_errors``: one per loss,
    options and ``errors_of``, shared by the grad_fns of every plan."""
    def local(params, kwargs, *batch):
        differentiated = _objective(fun, world, batch, kwargs, lambda p: p, axes=axes, has_aux=has_aux,
                                    weighted=weighted, device_keys=device_keys)
        loss = (lambda p: differentiated(p)[0]) if has_aux else differentiated
        return errors_of(jax.grad(loss, allow_int=allow_int)(averaging.varying_copy(params, axes)), axes)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *(batch_spec,) * n_batch), out_specs=P(),
                                 axis_names=frozenset(axes)))


def _names(what: str, names) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{API}: {what} must be names of keyword arguments (strings), got {names!r}")
    return names


def _context_mesh():
    mesh = compat.current_mesh()
    if mesh is None:
        raise ValueError(f"{API}: no mesh: pass mesh=, or call grad_fn inside `with jax.set_mesh(mesh):`")
    return mesh


def _layout(mesh, axes: tuple) -> tuple[int, P, bool]:
    """``(devices along axes, the batch's spec, whether every mesh axis is a manual Explicit one)``."""
    names = tuple(getattr(mesh, "axis_names", ()))
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"{API}: axis {missing[0]!r} is not an axis of the mesh (its axes: {names}); pass "
                         "axis_name= one of them")
    world = math.prod(mesh.shape[a] for a in axes)
    # shard_map moves arguments to its in_specs itself, except on a mesh whose axes are all
    # manual and Explicit: there an argument whose type has another sharding is an error about
    # a shard_map the caller never wrote. Such arguments are checked (checks.check_placement), and named.
    types = dict(zip(names, getattr(mesh, "axis_types", ())))
    explicit = set(names) == set(axes) and all(types.get(a) == AxisType.Explicit for a in axes)
    return world, P(axes if len(axes) > 1 else axes[0]), explicit


def _reduce_aux(extra, modes, axes: tuple, rows: int, warned: list):
    """Each subtree of ``extra`` as its mode in ``modes`` (a prefix of it) says."""
    if not isinstance(modes, str):
        try:
            return jax.tree.map(lambda m, sub: _reduce_aux(sub, m, axes, rows, warned), modes, extra,
                                is_leaf=lambda m: isinstance(m, str))
        except ValueError as err:
            raise ValueError(f"{API}: aux={modes!r} is not a pytree prefix of the aux fun returns: {err}") from None
    mode = modes
    if mode == "mean":
        for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]:
            shape = jnp.shape(leaf)
            if not warned[0] and rows > 1 and len(shape) >= 1 and shape[0] == rows:
                warned[0] = True
                log.warning("jax_cgx: %s: aux%s has the device's %d rows first; aux='mean' averages it over the "
                            "devices. For the whole batch's rows (logits, per-token values) pass aux='batch'",
                            API, jax.tree_util.keystr(path), rows)
        return jax.tree.map(lambda v: lax.pmean(v, axes), extra)
    if mode == "sum":
        return jax.tree.map(lambda v: lax.psum(v, axes), extra)
    if mode == "per_device":
        return jax.tree.map(lambda v: jnp.asarray(v)[None], extra)
    for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]:  # "batch"
        if jnp.ndim(leaf) == 0:
            raise ValueError(f"{API}: aux='batch', but aux{jax.tree_util.keystr(path)} is a scalar, not the device's "
                             "rows: use aux='mean', 'sum' or 'per_device' for it")
    return extra
