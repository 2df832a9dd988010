"""The CUDA lowering of ``compressed_psum_scatter`` and ``compressed_all_gather``: the nccl
backend's custom calls, or the xla backend.

On CUDA, ``compressed_reduce_scatter_p`` and ``compressed_all_gather_p`` lower to one
``jax_cgx_nccl_reduce_scatter`` / ``jax_cgx_nccl_all_gather`` custom call per row
(xla_ffi/nccl_sharded.cc) when :func:`jax_cgx.nccl.select_backend` picks ``nccl``
(communicators exist for the mesh and axes, or ``backend="nccl"`` was asked for), and to
the xla backend's program otherwise. The custom calls compute the same bits as the xla
backend's ``scatter_rows`` / ``gather_rows``; they move fewer bytes (a block is encoded at
its own length, not padded to an aligned one) over point-to-point NCCL sends or one
all-gather, pipelined in segments.

``compressed_psum_scatter(return_residual=True)`` (error feedback) always lowers to the
xla backend: ``backend="nccl"`` raises, ``"auto"`` picks xla (logged at debug level).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_cgx import _extensions
from jax_cgx._compat import context_mesh
from jax_cgx.collectives import agreement, all_gather, reduce_scatter
from jax_cgx.nccl import registry

__all__ = ["nccl_reduce_scatter_p", "nccl_all_gather_p", "workspace_bytes"]

log = logging.getLogger("jax_cgx")

# The handlers' op codes (xla_ffi/nccl_sharded.h ShardedOp).
_OPS = {"psum_scatter": 0, "all_gather": 1}


def workspace_bytes(op: str, m: int, world: int, bits: int, bucket_size: int, dtype, segments: int) -> tuple[int, int]:
    """(workspace bytes, segments) of one custom call of ``op`` ("psum_scatter" or "all_gather")
    on blocks or shards of ``m`` values, as the C++ plan computes them."""
    _extensions.require_cuda_extension()
    return _extensions.cuda().nccl_sharded_workspace_bytes(_OPS[op], m, world, bits, bucket_size,
                                                      np.dtype(dtype).itemsize, segments)


def _custom_call(name: str, op: str):
    """The per-row primitive of one handler: ``(x, seeds) -> (out, workspace)``."""
    prim = Primitive(name)
    prim.multiple_results = True

    def abstract(x, seeds, *, key, world, bits, bucket_size, stochastic, segments):
        del seeds, key, stochastic
        m = x.shape[-1]
        ws, _ = workspace_bytes(op, m, world, bits, bucket_size, x.dtype, segments)
        out = (m,) if op == "psum_scatter" else (world, m)
        return x.update(shape=out), x.update(shape=(ws,), dtype=np.dtype(np.uint8), weak_type=False)

    def lower(ctx, x, seeds, *, key, world, bits, bucket_size, stochastic, segments):
        # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
        return jax.ffi.ffi_lowering(name, has_side_effect=True)(
            ctx, x, seeds, comm_key=np.int64(key), world=np.int64(world), bits=np.int32(bits),
            bucket_size=np.int64(bucket_size), stochastic=bool(stochastic), segments=np.int64(segments))

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lower, platform="cuda")
    return prim


# Reduce-scatter, one row: x[W, m] (block j for rank j), seeds[W, 2] -> out[m], workspace u8[bytes].
nccl_reduce_scatter_p = _custom_call("jax_cgx_nccl_reduce_scatter", "psum_scatter")
# All-gather, one row: x[m] (this rank's shard), seeds[1, 2] -> out[W, m], workspace u8[bytes].
nccl_all_gather_p = _custom_call("jax_cgx_nccl_all_gather", "all_gather")


def _lower_cuda(prim: Primitive, lower_xla, ctx, x, seeds, *, backend, axes, world, bits, bucket_size, stochastic,
                segments, **params):
    """The rows of one collective as custom calls when the nccl backend runs, else the xla program."""
    choice, _ = registry.select_backend(backend, "cuda", context_mesh(ctx), axes)
    if choice != "nccl":
        return lower_xla(ctx, x, seeds, backend="xla", axes=axes, world=world, bits=bits, bucket_size=bucket_size,
                         stochastic=stochastic, segments=segments, **params)
    api = reduce_scatter.API if prim is nccl_reduce_scatter_p else all_gather.API
    agreement.check(ctx, api, "nccl", axes=axes, world=world, bits=bits, bucket_size=bucket_size,  # once per compile
                    stochastic=stochastic, segments=segments, **params)
    row = functools.partial(prim.bind, key=registry.lookup(context_mesh(ctx), axes), world=world, bits=bits,
                            bucket_size=bucket_size, stochastic=stochastic, segments=segments)
    # All-gather rows carry one seed pair, the handler takes it as [1, 2].
    seed_row = (lambda s: s) if prim is nccl_reduce_scatter_p else (lambda s: s[None])

    def rows(x, seeds):
        return jnp.stack([row(x[i], seed_row(seeds[i]))[0] for i in range(x.shape[0])])

    return mlir.lower_fun(rows, multiple_results=False)(ctx, x, seeds)


mlir.register_lowering(reduce_scatter.compressed_reduce_scatter_p,
                       functools.partial(_lower_cuda, nccl_reduce_scatter_p, reduce_scatter.lower_xla),
                       platform="cuda")
mlir.register_lowering(all_gather.compressed_all_gather_p,
                       functools.partial(_lower_cuda, nccl_all_gather_p, all_gather.lower_xla), platform="cuda")


def _lower_cuda_residual(ctx, x, seeds, *, backend, axes, **params):
    """Error-feedback residuals: the xla backend's program (the custom call computes no residual)."""
    if backend == "nccl":
        raise NotImplementedError(
            f"{reduce_scatter.API}(return_residual=True): error feedback residuals are computed by the xla "
            "backend only; use backend='auto' or 'xla'.")
    if backend == "auto":
        log.debug("jax_cgx: %s(return_residual=True) over axes %r uses the xla backend: error feedback "
                  "residuals are computed by the xla backend only", reduce_scatter.API, axes)
    return reduce_scatter.lower_residual_xla(ctx, x, seeds, backend="xla", axes=axes, **params)


mlir.register_lowering(reduce_scatter.compressed_reduce_scatter_residual_p, _lower_cuda_residual, platform="cuda")
