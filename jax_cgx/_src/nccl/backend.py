"""The nccl backend (:class:`NcclBackend`): the compressed collectives over jax_cgx's NCCL communicators.

Run where asked for (``backend="nccl"``) over axes whose mesh :func:`jax_cgx.nccl.setup`
connected, on CUDA with NCCL compiled in, for any collective but error feedback's residuals;
``backend="auto"`` passes it over (measured slower than the xla backend: it warns once). Each row of
a reduction is one custom call, with a workspace XLA allocates:

- all-reduce: ``jax_cgx_nccl_allreduce`` (xla_ffi/nccl_allreduce.cc), SRA or ring over
  ncclSend/Recv and ncclAllGather;
- reduce-scatter and all-gather: ``jax_cgx_nccl_reduce_scatter`` / ``jax_cgx_nccl_all_gather``
  (xla_ffi/nccl_sharded.cc), point-to-point sends or one all-gather, pipelined in segments;
  they move fewer bytes than the xla backend (a block is encoded at its own length, not
  padded to an aligned one).

Every call computes the same bytes as the xla backend's program: only the transport and the
schedule differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_cgx._src import backends, extensions
from jax_cgx._src.config import ALGORITHMS
from jax_cgx._src.nccl import library, lifecycle, registry
from jax_cgx._src.nccl.library import NcclError

__all__ = ["NcclBackend", "nccl_allreduce_p", "nccl_all_gather_p", "nccl_reduce_scatter_p", "workspace_bytes",
           "sharded_workspace_bytes"]

# The handlers' codes: the algorithm's index in config.ALGORITHMS (0 sra, 1 ring); the sharded
# op (xla_ffi/nccl_sharded.h ShardedOp).
_ALGORITHMS = {name: code for code, name in enumerate(ALGORITHMS)}
_OPS = {"psum_scatter": 0, "all_gather": 1}


def workspace_bytes(n: int, world: int, chunk: int, bits: int, bucket_size: int, dtype, algorithm: str,
                    segments: int) -> tuple[int, int]:
    """(workspace bytes, segments) of one all-reduce call, as the C++ plan computes them."""
    extensions.require_cuda_extension()
    return extensions.cuda().nccl_workspace_bytes(
        n, world, chunk, bits, bucket_size, np.dtype(dtype).itemsize, _ALGORITHMS[algorithm], segments)


def sharded_workspace_bytes(op: str, m: int, world: int, bits: int, bucket_size: int, dtype,
                            segments: int) -> tuple[int, int]:
    """(workspace bytes, segments) of one call of ``op`` ("psum_scatter" or "all_gather") on
    blocks or shards of ``m`` values, as the C++ plan computes them."""
    extensions.require_cuda_extension()
    return extensions.cuda().nccl_sharded_workspace_bytes(_OPS[op], m, world, bits, bucket_size,
                                                           np.dtype(dtype).itemsize, segments)


# ------------------------------------------------------------------ the custom calls, one row each

# All-reduce: x[n], seeds[W+1, 2], valid int32[1] (x's first valid[0] values are real, the rest
# padding that never widens a bucket) -> out[n], workspace u8[bytes] (scratch, discarded).
nccl_allreduce_p = Primitive("jax_cgx_nccl_allreduce")
nccl_allreduce_p.multiple_results = True


def _allreduce_abstract(x, seeds, valid, *, key, world, chunk, bits, bucket_size, stochastic, algorithm, segments,
                        divisor):
    del seeds, valid, key, stochastic, divisor
    ws, _ = workspace_bytes(x.shape[0], world, chunk, bits, bucket_size, x.dtype, algorithm, segments)
    return x, x.update(shape=(ws,), dtype=np.dtype(np.uint8), weak_type=False)


def _allreduce_lowering(ctx, x, seeds, valid, *, key, world, chunk, bits, bucket_size, stochastic, algorithm,
                        segments, divisor):
    # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
    return jax.ffi.ffi_lowering("jax_cgx_nccl_allreduce", has_side_effect=True)(
        ctx, x, seeds, valid, comm_key=np.int64(key), world=np.int64(world), chunk=np.int64(chunk),
        bits=np.int32(bits), bucket_size=np.int64(bucket_size), stochastic=bool(stochastic),
        algorithm=np.int32(_ALGORITHMS[algorithm]), segments=np.int64(segments),
        scale=np.float32(backends.mean_scale(divisor)))


nccl_allreduce_p.def_abstract_eval(_allreduce_abstract)
mlir.register_lowering(nccl_allreduce_p, _allreduce_lowering, platform="cuda")


def _sharded_call(name: str, op: str) -> Primitive:
    """The per-row primitive of one sharded handler: ``(x, seeds) -> (out, workspace)``."""
    prim = Primitive(name)
    prim.multiple_results = True

    def abstract(x, seeds, *, key, world, bits, bucket_size, stochastic, segments):
        del seeds, key, stochastic
        m = x.shape[-1]
        ws, _ = sharded_workspace_bytes(op, m, world, bits, bucket_size, x.dtype, segments)
        out = (m,) if op == "psum_scatter" else (world, m)
        return x.update(shape=out), x.update(shape=(ws,), dtype=np.dtype(np.uint8), weak_type=False)

    def lower(ctx, x, seeds, *, key, world, bits, bucket_size, stochastic, segments):
        return jax.ffi.ffi_lowering(name, has_side_effect=True)(
            ctx, x, seeds, comm_key=np.int64(key), world=np.int64(world), bits=np.int32(bits),
            bucket_size=np.int64(bucket_size), stochastic=bool(stochastic), segments=np.int64(segments))

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lower, platform="cuda")
    return prim


# Reduce-scatter: x[W, m] (block j for rank j), seeds[W, 2] -> out[m], workspace u8[bytes].
nccl_reduce_scatter_p = _sharded_call("jax_cgx_nccl_reduce_scatter", "psum_scatter")
# All-gather: x[m] (this rank's shard), seeds[1, 2] -> out[W, m], workspace u8[bytes].
nccl_all_gather_p = _sharded_call("jax_cgx_nccl_all_gather", "all_gather")


# ------------------------------------------------------------------ the backend

class NcclBackend(backends.Backend):
    name = "nccl"
    platforms = frozenset({"cuda"})
    where = "CUDA GPUs"
    error = NcclError
    families = registry.connected
    communicator = "NCCL communicator"
    setup_hint = "jax_cgx.nccl.setup(mesh)"
    # auto takes it where communicators are set up (jax_cgx.nccl.setup is the user's opt-in): on an
    # H100 (docs/gpu-results.md, 2026-11-27, 2 ranks, 4 bits, 64 and 256 MiB) it runs level with the
    # xla backend over a 10 Gbit/s link (within 2% under MPS), bitwise the same results. It was
    # passed over while its automatic 8 segments made it 3x slower; one segment fixed that.
    # timed_as "xla": policy="auto" prices and times it as the xla backend (it cannot set up a
    # probe mesh of NCCL communicators in the middle of a trace).

    def unavailable(self, requested: bool) -> str:
        if library.compiled():
            return ""
        if requested:
            library.require_binding()  # raises with the rebuild hint
        return "jax_cgx's CUDA extension has no NCCL support"

    def setup(self, mesh, axes=None, **options):
        return lifecycle.setup(mesh, axes, **options)

    def teardown(self, mesh=None) -> int:
        return lifecycle.teardown(mesh)

    def lower(self, ctx, op, operands, params, program):
        del program
        key = self.key(ctx, params["axes"])
        if op == "psum":
            return mlir.lower_fun(functools.partial(_allreduce_rows, key=key, **params),
                                  multiple_results=False)(ctx, *operands)
        return mlir.lower_fun(functools.partial(_sharded_rows, op, key=key, **params),
                              multiple_results=False)(ctx, *operands)


def _allreduce_rows(x, seeds, valid, *, key, axes, world, chunk, bits, bucket_size, stochastic, impl, algorithm,
                    segments, divisor, link_gbps):
    del axes, impl, link_gbps  # the link sizes the xla backend's messages only
    row = functools.partial(nccl_allreduce_p.bind, key=key, world=world, chunk=chunk, bits=bits,
                            bucket_size=bucket_size, stochastic=stochastic, algorithm=algorithm, segments=segments,
                            divisor=divisor)
    return jnp.stack([row(x[i], seeds[i], valid[i : i + 1])[0] for i in range(x.shape[0])])


def _sharded_rows(op, x, seeds, *, key, axes, world, bits, bucket_size, stochastic, impl, segments, **typing):
    del axes, impl, typing  # all-gather's `invariant` only types its result
    prim = nccl_reduce_scatter_p if op == "psum_scatter" else nccl_all_gather_p
    row = functools.partial(prim.bind, key=key, world=world, bits=bits, bucket_size=bucket_size,
                            stochastic=stochastic, segments=segments)
    # All-gather rows carry one seed pair; the handler takes it as [1, 2].
    seed_row = (lambda s: s) if op == "psum_scatter" else (lambda s: s[None])
    return jnp.stack([row(x[i], seed_row(seeds[i]))[0] for i in range(x.shape[0])])


backends.register(NcclBackend())
