"""The CUDA lowering of the compressed all-reduce: the nccl backend, or the xla one.

On CUDA, ``compressed_allreduce_p`` lowers to one ``jax_cgx_nccl_allreduce`` custom
call per row (xla_ffi/nccl_allreduce.cc) when :func:`jax_cgx.nccl.select_backend`
picks ``nccl`` (communicators exist for the mesh and axes being reduced, or
``backend="nccl"`` was asked for), and to the xla backend's collectives otherwise.
The custom call computes the same bytes as the xla backend's program: only the
transport and the scheduling differ.

``compressed_allreduce_residual_p`` (``compressed_psum(return_residual=True)``, error
feedback) always lowers to the xla backend: ``backend="nccl"`` raises, ``"auto"`` picks
xla (logged at debug level).
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
from jax_cgx.collectives import agreement, primitive
from jax_cgx.config import ALGORITHMS
from jax_cgx.nccl import registry

__all__ = ["nccl_allreduce_p", "workspace_bytes"]

log = logging.getLogger("jax_cgx")

# The handler's algorithm codes: the index in config.ALGORITHMS (0 sra, 1 ring).
_ALGORITHMS = {name: code for code, name in enumerate(ALGORITHMS)}


def workspace_bytes(n: int, world: int, chunk: int, bits: int, bucket_size: int, dtype, algorithm: str,
                    segments: int) -> tuple[int, int]:
    """(workspace bytes, segments) of one custom call, as the C++ plan computes them."""
    _extensions.require_cuda_extension()
    return _extensions.cuda().nccl_workspace_bytes(
        n, world, chunk, bits, bucket_size, np.dtype(dtype).itemsize, _ALGORITHMS[algorithm], segments
    )


# One row: x[n], seeds[W+1, 2], valid int32[1] (x's first valid[0] values are real, the rest
# padding that never widens a bucket) -> out[n], workspace u8[bytes] (scratch, discarded).
nccl_allreduce_p = Primitive("jax_cgx_nccl_allreduce")
nccl_allreduce_p.multiple_results = True


def _abstract(x, seeds, valid, *, key, world, chunk, bits, bucket_size, stochastic, algorithm, segments):
    del seeds, valid, key, stochastic
    ws, _ = workspace_bytes(x.shape[0], world, chunk, bits, bucket_size, x.dtype, algorithm, segments)
    return x, x.update(shape=(ws,), dtype=np.dtype(np.uint8), weak_type=False)


def _lower_row(ctx, x, seeds, valid, *, key, world, chunk, bits, bucket_size, stochastic, algorithm, segments):
    # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
    return jax.ffi.ffi_lowering("jax_cgx_nccl_allreduce", has_side_effect=True)(
        ctx,
        x,
        seeds,
        valid,
        comm_key=np.int64(key),
        world=np.int64(world),
        chunk=np.int64(chunk),
        bits=np.int32(bits),
        bucket_size=np.int64(bucket_size),
        stochastic=bool(stochastic),
        algorithm=np.int32(_ALGORITHMS[algorithm]),
        segments=np.int64(segments),
    )


nccl_allreduce_p.def_abstract_eval(_abstract)
mlir.register_lowering(nccl_allreduce_p, _lower_row, platform="cuda")


def _lower_cuda(ctx, x, seeds, valid, *, backend, axes, world, chunk, bits, bucket_size, stochastic, impl,
                algorithm, segments):
    choice, _ = registry.select_backend(backend, "cuda", context_mesh(ctx), axes)
    params = dict(axes=axes, world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
                  stochastic=stochastic, impl=impl, algorithm=algorithm, segments=segments)
    if choice != "nccl":
        return primitive.lower_xla(ctx, x, seeds, valid, backend="xla", **params)
    agreement.check(ctx, "compressed_psum", "nccl", **params)  # across processes, once per compile
    key = registry.lookup(context_mesh(ctx), axes)

    def rows(x, seeds, valid):
        row = functools.partial(
            nccl_allreduce_p.bind, key=key, world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
            stochastic=stochastic, algorithm=algorithm, segments=segments,
        )
        return jnp.stack([row(x[i], seeds[i], valid[i : i + 1])[0] for i in range(x.shape[0])])

    return mlir.lower_fun(rows, multiple_results=False)(ctx, x, seeds, valid)


mlir.register_lowering(primitive.compressed_allreduce_p, _lower_cuda, platform="cuda")


def _lower_cuda_residual(ctx, x, seeds, valid, *, backend, axes, **params):
    """Error-feedback residuals: the xla backend's program (the custom call computes no residual)."""
    if backend == "nccl":
        raise NotImplementedError(primitive.RESIDUAL_BACKEND_ERROR)
    if backend == "auto":
        log.debug(
            "jax_cgx: compressed_psum(return_residual=True) over axes %r uses the xla backend: error "
            "feedback residuals are computed by the xla backend only",
            axes,
        )
    return primitive.lower_residual_xla(ctx, x, seeds, valid, backend="xla", axes=axes, **params)


mlir.register_lowering(primitive.compressed_allreduce_residual_p, _lower_cuda_residual, platform="cuda")
