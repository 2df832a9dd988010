"""The tcp backend (:class:`TcpBackend`): the compressed all-reduce over jax_cgx's TCP connections on CPU.

Chosen while tracing (:mod:`jax_cgx._src.backends`) for an all-reduce over axes whose mesh
:func:`jax_cgx.tcp.setup` connected (``backend="auto"``), or asked for (``backend="tcp"``),
when it can run it: SRA with the compiled kernels over at least two ranks, no error-feedback
residual. It lowers the all-reduce to a pair of custom calls per row (xla_ffi/tcp_allreduce.cc):

- ``jax_cgx_tcp_allreduce_start(x, seeds, valid, after) -> (out, ticket)`` checks its
  arguments, queues the all-reduce on the communicator's call thread and returns at once;
- ``jax_cgx_tcp_allreduce_done(out, x, seeds, ticket) -> out`` (its result aliases ``out``)
  is asynchronous: XLA:CPU goes on with independent work, e.g. the rest of a backward pass,
  until something uses the result. Taking ``x`` and ``seeds`` keeps them alive and
  untouched while the call thread reads them.

The pair computes the same bytes as the xla backend's program: only the transport and
the schedule differ.

Order. A custom call's transfers with a peer must pair with the peer's calls in the same
order, but XLA:CPU runs a program's thunks as a dataflow graph, concurrently where they are
independent, and gives custom calls no ordering resource as it does its own collectives.
So every start call takes one more operand, ``after``: the ticket of the previous start call
lowered into the same block (for the first, an array that keeps the program from running
inline: ``_not_cheap``), which it never reads. The
calls of a block then start one after another in lowering order, the same on every rank,
and the call thread runs them in that order; a start waits for the previous start only
(microseconds), never for the previous exchange.
(Calls in different blocks, e.g. inside and outside a loop body, are not chained; if
they ever run out of order, the calls' headers disagree and they fail with an error
naming both reductions, never mixing their bytes.)
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_cgx._src import backends
from jax_cgx._src.tcp import lifecycle
from jax_cgx._src.tcp.lifecycle import TcpError

__all__ = ["TcpBackend", "tcp_done_p", "tcp_start_p"]

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


def _lower_start(ctx, x, seeds, valid, after, *, key, site, world, chunk, bits, bucket_size, stochastic, segments,
                 divisor):
    # has_side_effect: a collective; XLA must neither drop it nor merge two of them.
    return jax.ffi.ffi_lowering("jax_cgx_tcp_allreduce_start", has_side_effect=True)(
        ctx, x, seeds, valid, after, comm_key=np.int64(key), site=np.int64(site), world=np.int64(world),
        chunk=np.int64(chunk), bits=np.int32(bits), bucket_size=np.int64(bucket_size), stochastic=bool(stochastic),
        segments=np.int64(segments), scale=np.float32(backends.mean_scale(divisor)),
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


class TcpBackend(backends.Backend):
    name = "tcp"
    platforms = frozenset({"cpu"})
    where = "CPU devices"
    ops = frozenset({"psum"})
    timed_as = "tcp"  # policy="auto" times near-ties over a tcp mesh of its own
    error = TcpError
    families = lifecycle.connected
    communicator = "tcp communicator"
    setup_hint = "jax_cgx.tcp.setup(mesh)"

    def unsupported(self, reduction: backends.Reduction) -> str:
        if reduction.algorithm != "sra":
            return "the ring algorithm runs on the xla backend only"
        if reduction.impl == "reference":
            return "impl='reference' runs on the xla backend only"
        return "one rank" if reduction.world < 2 else ""

    def setup(self, mesh, axes=None, **options):
        return lifecycle.setup(mesh, axes, **options)

    def teardown(self, mesh=None) -> int:
        return lifecycle.teardown(mesh)

    def lower(self, ctx, op, operands, params, program):
        del op, program
        return _lower_rows(ctx, *operands, key=self.key(ctx, params["axes"]), **params)


# XLA:CPU runs a program it prices under 1000 flops inline, inside the dispatch call, and jaxlib
# raises a failed inline run's error there as a builtin ValueError; a program run asynchronously
# reports the same error as JaxRuntimeError where its result is read. Custom calls price at -1 flop
# each, so a step that returns the all-reduce's result directly was "cheap": a dead peer surfaced as
# ValueError in that form only. The first start of each block therefore takes as its (unread) `after`
# a product of runtime data XLA cannot fold away: 4096 flops, a microsecond.
_NOT_CHEAP = 4096


def _not_cheap(x):
    """The first start's ``after``: ``_NOT_CHEAP`` flops, so the program never runs inline."""
    scale = x[0, :1].sum().astype(jnp.float32) if x.shape[0] else jnp.float32(0)
    return jnp.arange(_NOT_CHEAP, dtype=jnp.float32) * scale


def _lower_rows(ctx, x, seeds, valid, *, key, axes, world, chunk, bits, bucket_size, stochastic, impl, algorithm,
                segments, divisor, link_gbps):
    """Each row's start and done calls, each start chained after the previous one of its block."""
    del axes, impl, algorithm, link_gbps  # the link sizes the xla backend's messages only

    def rows(x, seeds, valid, *previous):
        after = previous[0] if previous else _not_cheap(x)
        out = []
        for i in range(x.shape[0]):
            started, after = tcp_start_p.bind(x[i], seeds[i], valid[i : i + 1], after, key=key, site=site + i,
                                              world=world, chunk=chunk, bits=bits, bucket_size=bucket_size,
                                              stochastic=stochastic, segments=segments, divisor=divisor)
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


backends.register(TcpBackend())
