"""The CPU lowering of the compressed all-reduce: the tcp backend, or the xla one.

On CPU, ``compressed_allreduce_p`` lowers to one ``jax_cgx_tcp_allreduce`` custom call per
row (xla_ffi/tcp_allreduce.cc) when :func:`select_backend` picks ``tcp`` (communicators
exist for the mesh and axes being reduced, or ``backend="tcp"`` was asked for), and to the
xla backend's collectives otherwise. The custom call computes the same bytes as the xla
backend's program: only the transport and the schedule differ.

``compressed_allreduce_residual_p`` (error feedback) always lowers to the xla backend:
``backend="tcp"`` raises, ``"auto"`` picks xla (logged at debug level).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_cgx.collectives import primitive
from jax_cgx.tcp import lifecycle
from jax_cgx.tcp.lifecycle import TcpError

__all__ = ["select_backend", "tcp_allreduce_p"]

log = logging.getLogger("jax_cgx")

# One row: x[n], seeds[W+1, 2], valid int32[1] (x's first valid[0] values are real, the rest
# padding that never widens a bucket) -> out[n].
tcp_allreduce_p = Primitive("jax_cgx_tcp_allreduce")


def _abstract(x, seeds, valid, **params):
    del seeds, valid, params
    return x


def _lower_row(ctx, x, seeds, valid, *, key, world, chunk, bits, bucket_size, stochastic, segments):
    # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
    return jax.ffi.ffi_lowering("jax_cgx_tcp_allreduce", has_side_effect=True)(
        ctx, x, seeds, valid, comm_key=np.int64(key), world=np.int64(world), chunk=np.int64(chunk),
        bits=np.int32(bits), bucket_size=np.int64(bucket_size), stochastic=bool(stochastic),
        segments=np.int64(segments),
    )


tcp_allreduce_p.def_abstract_eval(_abstract)
mlir.register_lowering(tcp_allreduce_p, _lower_row, platform="cpu")


def _context_mesh(ctx):
    """The mesh of the shard_map/pmap being lowered (None outside one)."""
    return getattr(ctx.module_context.axis_context, "mesh", None)


def select_backend(requested: str, mesh, axes, *, algorithm: str = "sra", impl: str = "auto",
                   world: int = 2) -> tuple[str, str]:
    """Which backend runs a compressed reduction over ``axes`` of ``mesh`` on CPU: ``(backend, reason)``.

    ``"auto"`` picks ``tcp`` when :func:`jax_cgx.tcp.setup` connected ``(mesh, axes)``
    and the reduction is one the custom call runs (SRA with the compiled kernels);
    ``"tcp"`` raises :class:`TcpError` when it cannot be honoured.
    """
    choice = _select(requested, mesh, axes, algorithm, impl, world)
    log.debug("jax_cgx: backend %s for axes %r on cpu (requested %s): %s", choice[0], axes, requested, choice[1])
    return choice


def _select(requested, mesh, axes, algorithm, impl, world) -> tuple[str, str]:
    if requested not in ("auto", "tcp"):
        return requested, "requested"
    key, why = lifecycle.find(mesh, axes)
    if key is None:
        if requested == "tcp":
            raise TcpError(
                f"jax_cgx: backend='tcp': no tcp communicator for axes {axes!r} of mesh {mesh!r} ({why}); call "
                "jax_cgx.tcp.setup(mesh) (on every process, before the first call of the compiled function), "
                "or use backend='auto' or 'xla'."
            )
        return "xla", f"{why}; call jax_cgx.tcp.setup(mesh) to use tcp"
    unsupported = ("the ring algorithm runs on the xla backend only" if algorithm != "sra" else
                   "impl='reference' runs on the xla backend only" if impl == "reference" else
                   "one rank" if world < 2 else "")
    if unsupported:
        if requested == "tcp":
            raise TcpError(f"jax_cgx: backend='tcp' cannot run this reduction: {unsupported}; use backend='auto'")
        return "xla", unsupported
    return "tcp", f"communicators set up for axes {axes!r} on this mesh"


def _lower_cpu(ctx, x, seeds, valid, *, backend, axes, world, chunk, bits, bucket_size, stochastic, impl,
               algorithm, segments):
    mesh = _context_mesh(ctx)
    choice, _ = select_backend(backend, mesh, axes, algorithm=algorithm, impl=impl, world=world)
    params = dict(axes=axes, world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
                  stochastic=stochastic, impl=impl, algorithm=algorithm, segments=segments)
    if choice != "tcp":
        return primitive.lower_xla(ctx, x, seeds, valid, backend=choice, **params)
    key = lifecycle.lookup(mesh, axes)

    def rows(x, seeds, valid):
        row = functools.partial(tcp_allreduce_p.bind, key=key, world=world, chunk=chunk, bits=bits,
                                bucket_size=bucket_size, stochastic=stochastic, segments=segments)
        return jnp.stack([row(x[i], seeds[i], valid[i : i + 1]) for i in range(x.shape[0])])

    return mlir.lower_fun(rows, multiple_results=False)(ctx, x, seeds, valid)


mlir.register_lowering(primitive.compressed_allreduce_p, _lower_cpu, platform="cpu")


def _lower_cpu_residual(ctx, x, seeds, valid, *, backend, axes, **params):
    """Error-feedback residuals: the xla backend's program (the custom call computes no residual)."""
    if backend == "auto" and lifecycle.lookup(_context_mesh(ctx), axes) is not None:
        log.debug("jax_cgx: compressed_psum(return_residual=True) over axes %r uses the xla backend: error "
                  "feedback residuals are computed by the xla backend only", axes)
    return primitive.lower_residual_xla(ctx, x, seeds, valid, backend=backend, axes=axes, **params)


mlir.register_lowering(primitive.compressed_allreduce_residual_p, _lower_cpu_residual, platform="cpu")
