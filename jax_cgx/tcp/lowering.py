"""The CPU lowering of the compressed all-reduce: the tcp backend, or the xla one.

On CPU, ``compressed_allreduce_p`` lowers to a pair of custom calls per row
(xla_ffi/tcp_allreduce.cc) when :func:`select_backend` picks ``tcp`` (communicators exist
for the mesh and axes being reduced, or ``backend="tcp"`` was asked for), and to the xla
backend's collectives otherwise:

- ``jax_cgx_tcp_allreduce_start(x, seeds, valid, after) -> (out, ticket)`` checks its
  arguments, queues the all-reduce on the communicator's call thread and returns at once;
- ``jax_cgx_tcp_allreduce_done(out, x, seeds, ticket) -> out`` (its result aliases ``out``)
  is asynchronous: XLA:CPU goes on with independent work, e.g. the rest of a backward pass,
  until something uses the result. Taking ``x`` and ``seeds`` keeps them alive and
  untouched while the call thread reads them.

The pair computes the same bytes as the xla backend's program: only the transport and
the schedule differ.

``compressed_allreduce_residual_p`` (error feedback) always lowers to the xla backend:
``backend="tcp"`` raises, ``"auto"`` picks xla (logged at debug level).

Order. A custom call's transfers with a peer must pair with the peer's calls in the same
order, but XLA:CPU runs a program's thunks as a dataflow graph, concurrently where they are
independent, and gives custom calls no ordering resource as it does its own collectives.
So every start call takes one more operand, ``after``: the ticket of the previous start call
lowered into the same block (a zero-size array for the first), which it never reads. The
calls of a block then start one after another in lowering order, the same on every rank,
and the call thread runs them in that order; a start waits for the previous start only
(microseconds), never for the previous exchange.
(Calls in different blocks, e.g. inside and outside a loop body, are not chained; if
they ever run out of order, the calls' headers disagree and they fail with an error
naming both reductions, never mixing their bytes.)
"""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_cgx._compat import context_mesh
from jax_cgx.collectives import agreement, primitive
from jax_cgx.tcp import lifecycle
from jax_cgx.tcp.lifecycle import TcpError

__all__ = ["select_backend", "tcp_done_p", "tcp_start_p"]

log = logging.getLogger("jax_cgx")

# One row: x[n], seeds[W+1, 2], valid int32[1] (x's first valid[0] values are real, the rest
# padding that never widens a bucket), after (any array, unread: orders the starts)
# -> out[n] (filled in later: only tcp_done_p's result may be read), ticket int32[1].
tcp_start_p = Primitive("jax_cgx_tcp_allreduce_start")
tcp_start_p.multiple_results = True
# out[n] of the start, x, seeds, ticket -> out[n] (the same buffer), once the call is done.
tcp_done_p = Primitive("jax_cgx_tcp_allreduce_done")


def _start_abstract(x, seeds, valid, after, **params):
    del seeds, after, params
    return x, valid.update(shape=(1,), dtype=np.dtype(np.int32), weak_type=False)


def _done_abstract(started, x, seeds, ticket, **params):
    del x, seeds, ticket, params
    return started


def _lower_start(ctx, x, seeds, valid, after, *, key, site, world, chunk, bits, bucket_size, stochastic, segments):
    # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
    return jax.ffi.ffi_lowering("jax_cgx_tcp_allreduce_start", has_side_effect=True)(
        ctx, x, seeds, valid, after, comm_key=np.int64(key), site=np.int64(site), world=np.int64(world),
        chunk=np.int64(chunk), bits=np.int32(bits), bucket_size=np.int64(bucket_size), stochastic=bool(stochastic),
        segments=np.int64(segments),
    )


def _lower_done(ctx, started, x, seeds, ticket, *, key):
    return jax.ffi.ffi_lowering("jax_cgx_tcp_allreduce_done", has_side_effect=True, operand_output_aliases={0: 0})(
        ctx, started, x, seeds, ticket, comm_key=np.int64(key))


tcp_start_p.def_abstract_eval(_start_abstract)
tcp_done_p.def_abstract_eval(_done_abstract)
mlir.register_lowering(tcp_start_p, _lower_start, platform="cpu")
mlir.register_lowering(tcp_done_p, _lower_done, platform="cpu")


class _ModuleCalls:
    """The tcp calls lowered so far into one module: how many (each call's ``site``, sent in
    its header, so two calls of equal shapes that run in different orders on two ranks are
    told apart), and the last start of each block (its ticket: the next start's ``after``)."""

    def __init__(self, module):
        self.module = module  # keeps id(module) from being reused while we hold it
        self.sites = 0
        self.last: list[tuple] = []  # [(block, ticket value, its aval)]


# id(module) -> its calls. Few modules are lowered at once (nested jits lower into their
# caller's module), so only the latest few are kept.
_modules: dict[int, _ModuleCalls] = {}
_modules_lock = threading.Lock()
_MODULES_KEPT = 8


def _calls_of(ctx) -> _ModuleCalls:
    module = ctx.module_context.module
    calls = _modules.get(id(module))
    if calls is None:
        if len(_modules) >= _MODULES_KEPT:
            _modules.pop(next(iter(_modules)))
        calls = _modules[id(module)] = _ModuleCalls(module)
    return calls


def _next_calls(ctx, count: int) -> tuple[int, tuple | None]:
    """(the first site of ``count`` calls being lowered, (value, aval) of the last call in the
    current block or None)."""
    block = mlir.ir.InsertionPoint.current.block
    with _modules_lock:
        calls = _calls_of(ctx)
        first, calls.sites = calls.sites, calls.sites + count
        return first, next(((v, a) for b, v, a in reversed(calls.last) if b == block), None)


def _record_call(ctx, value, aval) -> None:
    block = mlir.ir.InsertionPoint.current.block
    with _modules_lock:
        calls = _calls_of(ctx)
        calls.last = [c for c in calls.last if c[0] != block] + [(block, value, aval)]


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
    mesh = context_mesh(ctx)
    choice, _ = select_backend(backend, mesh, axes, algorithm=algorithm, impl=impl, world=world)
    params = dict(axes=axes, world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
                  stochastic=stochastic, impl=impl, algorithm=algorithm, segments=segments)
    if choice != "tcp":
        return primitive.lower_xla(ctx, x, seeds, valid, backend=choice, **params)
    agreement.check(ctx, "compressed_psum", "tcp", **params)  # across processes, once per compile
    key = lifecycle.lookup(mesh, axes)

    def rows(x, seeds, valid, *previous):
        after = previous[0] if previous else jnp.zeros((0,), jnp.uint8)
        out = []
        for i in range(x.shape[0]):
            started, after = tcp_start_p.bind(x[i], seeds[i], valid[i : i + 1], after, key=key, site=site + i,
                                              world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
                                              stochastic=stochastic, segments=segments)
            out.append(tcp_done_p.bind(started, x[i], seeds[i], after, key=key))
        return jnp.stack(out), after

    site, previous = _next_calls(ctx, ctx.avals_in[0].shape[0])
    ticket_aval = ctx.avals_in[2].update(shape=(1,))  # int32[1], typed like `valid`
    inner = ctx.replace(avals_out=[*ctx.avals_out, ticket_aval])
    if previous is None:
        out, ticket = mlir.lower_fun(rows, multiple_results=True)(inner, x, seeds, valid)
    else:
        value, aval = previous
        out, ticket = mlir.lower_fun(rows, multiple_results=True)(inner.replace(avals_in=[*ctx.avals_in, aval]), x,
                                                                   seeds, valid, value)
    _record_call(ctx, ticket, ticket_aval)
    return [out]


# Not cacheable: a cached lowering is emitted once as a private function that every identical
# call site calls, out of the block the calls are chained in.
mlir.register_lowering(primitive.compressed_allreduce_p, _lower_cpu, platform="cpu", cacheable=False)


def _lower_cpu_residual(ctx, x, seeds, valid, *, backend, axes, **params):
    """Error-feedback residuals: the xla backend's program (the custom call computes no residual)."""
    if backend == "auto" and lifecycle.lookup(context_mesh(ctx), axes) is not None:
        log.debug("jax_cgx: compressed_psum(return_residual=True) over axes %r uses the xla backend: error "
                  "feedback residuals are computed by the xla backend only", axes)
    return primitive.lower_residual_xla(ctx, x, seeds, valid, backend=backend, axes=axes, **params)


mlir.register_lowering(primitive.compressed_allreduce_residual_p, _lower_cpu_residual, platform="cpu")
