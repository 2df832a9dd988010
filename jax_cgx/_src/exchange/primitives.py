"""The rules every exchange primitive shares: one call registers them (:func:`register`).

Each collective's primitive (:mod:`~jax_cgx._src.exchange.all_reduce`,
:mod:`~jax_cgx._src.exchange.reduce_scatter`, :mod:`~jax_cgx._src.exchange.all_gather`) works on
rows, is lowered by the backend chosen for it while tracing (the xla backend runs the primitive's
per-device program), runs eagerly through ``jit``, and folds vmap into rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jax_cgx._src import backends, compat
from jax_cgx._src.codec import batch_rows
from jax_cgx._src.exchange import wire

__all__ = ["register"]


def register(prim: Primitive, *, abstract_eval: Callable, program: Callable, jvp: Callable, api: str, op: str,
             lax_name: str, typing_only: tuple[str, ...] = ()) -> None:
    """Register an exchange primitive's rules: ``abstract_eval``, its lowering through the
    backend chosen for it (:func:`jax_cgx._src.backends.register_lowering`; the xla backend runs
    ``program``, the per-device rows program, given the platform's message cap, without the
    ``typing_only`` params), ``jvp``, the impl, and vmap over a non-reduced axis folding into rows
    (over a reduced axis: an error, vmap has no wire). A primitive whose name ends in
    ``_residual`` is error feedback's twin: its backend must compute residuals."""
    multiple = prim.multiple_results

    def xla_program(*operands, platforms, link_gbps, **params):
        for name in typing_only:
            params.pop(name)
        return program(*operands, message_cap=wire.message_cap(platforms, link_gbps), **params)

    def batch(axis_data, args, dims, *, axes, **params):
        if axis_data.name is not None and axis_data.name in axes:
            raise NotImplementedError(
                f"{api} over the vmapped axis {axis_data.name!r} is not supported: vmap has no wire to compress; "
                f"use jax.lax.{lax_name}, or map the axis with shard_map/pmap")
        return batch_rows(prim, args, dims, axes=axes, **params)

    prim.def_effectful_abstract_eval(abstract_eval)
    prim.def_impl(functools.partial(compat.apply_primitive, prim))
    backends.register_lowering(prim, api, op, backends.XlaProgram(xla_program, multiple),
                               residual=prim.name.endswith("_residual"))
    ad.primitive_jvps[prim] = jvp
    batching.fancy_primitive_batchers[prim] = batch
