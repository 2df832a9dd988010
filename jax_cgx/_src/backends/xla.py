"""The xla backend: each collective's own program, XLA collectives around the codec's kernels.

It runs every compressed collective on every platform, needs no connections of its own, and
is what ``backend="auto"`` falls back to. The programs are the collectives' (the all-reduce's
SRA or ring, the reduce-scatter's all-to-all, the all-gather's all-gather); this backend only
lowers the one it is given.
"""

from __future__ import annotations

import functools

from jax.interpreters import mlir

from jax_cgx._src.backends.protocol import Backend, register

__all__ = ["XlaBackend"]


class XlaBackend(Backend):
    name = "xla"
    residuals = True

    def lower(self, ctx, op, operands, params, program):
        """``program`` (the collective's :class:`~jax_cgx._src.backends.protocol.XlaProgram`) lowered
        into ``ctx`` with ``params``, its messages cut for the platforms being lowered for."""
        del op
        fn = functools.partial(program.fn, platforms=tuple(ctx.module_context.platforms), **params)
        return mlir.lower_fun(fn, multiple_results=program.multiple_results)(ctx, *operands)


register(XlaBackend())
