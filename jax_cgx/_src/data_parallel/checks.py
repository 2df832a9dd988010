"""What :func:`~jax_cgx.data_parallel_value_and_grad` checks before it maps a step: each a
``ValueError`` that names the argument, leaf or closed-over variable and says the fix.

- the batch: every leaf has rows, divisible by the devices, and not zero of them;
- the placement, on a mesh of ``Explicit`` axes (where JAX moves no argument itself);
- the parameters: integer leaves need ``allow_int``;
- what ``fun`` closes over: an array with the global batch's rows would reach every device whole,
  beside each device's shard of the batch arguments;
- the keyword arguments: a PRNG key that is neither a device key (folded with each device's index)
  nor declared shared would draw the same random numbers (dropout masks) on every device.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_cgx._src import compat

API = "data_parallel_value_and_grad"


def argument_names(fun) -> list[str]:
    """The names of ``fun``'s positional parameters (``["params", "x", "y"]``), to name a batch
    argument in an error as its author wrote it; ``[]`` where there is no signature to read."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def batch_where(i: int, path, names: list[str]) -> str:
    # grad_fn(params, *batch) passes batch argument i to fun as its argument i + 1.
    named = f" (`{names[i + 1]}`)" if i + 1 < len(names) else ""
    return f"batch argument {i}{named}{jax.tree_util.keystr(path)}"


def check_batch(batch, axes, world: int, names: list[str]) -> int:
    """The batch's rows (the first leaf's leading dimension), after checking every leaf."""
    rows = None
    for i, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = getattr(leaf, "shape", None)
            where = batch_where(i, path, names)
            if shape is None or len(shape) == 0:
                raise ValueError(f"{API}: {where} is a scalar; every batch leaf needs a leading dimension to split "
                                 f"over {axes} (pass a constant as a keyword argument of grad_fn: it reaches fun "
                                 "whole, on every device)")
            if shape[0] == 0:
                raise ValueError(f"{API}: {where} has no rows: each of the {world} devices would take the mean of an "
                                 "empty shard (NaN). Skip empty batches before the step")
            if shape[0] % world:
                raise ValueError(f"{API}: {where} has {shape[0]} rows, not divisible by the {world} devices along "
                                 f"{axes}; use a batch size that is a multiple of {world}")
            rows = shape[0] if rows is None else rows
    return rows


def check_params(params, allow_int: bool) -> None:
    if allow_int:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not differentiable(leaf):
            raise ValueError(
                f"{API}: params{jax.tree_util.keystr(path)} is {jnp.result_type(leaf)}, which has no gradient: pass "
                "allow_int=True (as for jax.grad: its gradient is float0, and nothing is averaged for it), or pass "
                "it as a keyword argument of grad_fn instead of in params")


def differentiable(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _closed_over(fun) -> list[tuple[str, object]]:
    """``(how, value)`` of what ``fun`` closes over: its closure cells, a ``functools.partial``'s
    bound arguments (``fun`` itself unwrapped), and the module-level arrays its own code reads."""
    out = []
    while isinstance(fun, functools.partial):
        out += [(f"closes over a functools.partial argument {i}", a) for i, a in enumerate(fun.args)]
        out += [(f"closes over the functools.partial keyword {k!r}", v) for k, v in fun.keywords.items()]
        fun = fun.func
    code, cells = getattr(fun, "__code__", None), getattr(fun, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, cells):
        try:
            out.append((f"closes over `{name}`", cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned after the function was made)
            pass
    module = getattr(fun, "__globals__", {})
    for name in code.co_names if code is not None else ():
        value = module.get(name)
        if isinstance(value, (jax.Array, np.ndarray)):
            out.append((f"reads the module-level `{name}`", value))
    return out


def check_closures(fun, rows: int, world: int) -> None:
    """A closed-over array whose leading dimension is the batch's ``rows`` is per-row data that
    should be split: refused, named. (Only ``fun``'s own closure, partial arguments and the
    module-level arrays its own code names are seen, not those of the functions it calls.)"""
    if rows is None or rows <= rows // world:
        return
    for how, value in _closed_over(fun):
        if callable(value) and not hasattr(value, "shape"):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            shape = getattr(leaf, "shape", None)  # (a module closed over, jnp, has a function `shape`)
            if isinstance(shape, tuple) and shape and shape[0] == rows and not isinstance(leaf, (int, float)):
                raise ValueError(
                    f"{API}: fun {how}{jax.tree_util.keystr(path)} ({jnp.result_type(leaf)}{list(shape)}), "
                    f"whose leading dimension is the batch's {rows} rows: every device would see all of it beside "
                    f"its own {rows // world} rows of the batch arguments. Pass per-row arrays (positions, "
                    "segmentation, weights, masks) as batch arguments, grad_fn(params, x, positions, ...), so each "
                    "device gets its rows; pass data that is the same for every device as a keyword argument")


def check_keys(kwargs: dict, device_keys: tuple[str, ...], shared_keys: tuple[str, ...]) -> None:
    """Every declared device key is given and is a key; an undeclared key is refused."""
    for name in device_keys:
        if name not in kwargs:
            raise ValueError(f"{API}: device_keys names {name!r}, but grad_fn got no keyword argument {name!r} "
                             f"(it got {sorted(kwargs)})")
        if not all(compat.is_prng_key(leaf) for leaf in jax.tree.leaves(kwargs[name])):
            raise ValueError(f"{API}: the device key {name!r} is not a PRNG key (jax.random.key or "
                             "jax.random.PRNGKey): each device folds its index into it")
    for name, value in kwargs.items():
        if name in device_keys or name in shared_keys:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            if compat.is_prng_key(leaf):
                raise ValueError(
                    f"{API}: keyword argument {name}{jax.tree_util.keystr(path)} is a PRNG key: every device would "
                    "draw the same random numbers from it (the same dropout mask on every device's rows). Declare "
                    f"it: data_parallel_value_and_grad(..., device_keys=({name!r},)) folds each device's index into "
                    f"it; shared_keys=({name!r},) keeps it the same on every device")


def check_placement(params, key, kwargs, batch, mesh, axes, names: list[str]) -> None:
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
            f"{API}: {where} is {aval} with sharding {aval.sharding.spec}; it must be "
            f"{wanted}. Place it first (in or outside jit): jax.device_put({name}, NamedSharding(mesh, {spec})). "
            f"On a mesh of Explicit axes (jax.make_mesh's default) JAX moves no argument to another sharding by "
            f"itself; on a mesh made with axis_types=(AxisType.Auto,) * {len(mesh.axis_names)} it would.")

    for i, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            dims = split(leaf)
            if dims[0] != axes or any(dims[1:]):
                name = names[i + 1] if i + 1 < len(names) else "batch"
                refuse(batch_where(i, path, names), leaf,
                       f"split along its leading dimension over {over_axes}, and along no other", name,
                       f"P({over_axes})")
    for what, tree in (("params", params), ("key", key), *kwargs.items()):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if any(split(leaf)):
                refuse(f"{what}{jax.tree_util.keystr(path)}", leaf,
                       f"replicated over {over_axes}: every device takes its gradient with all of {what}", what, "P()")
