"""TCP connections owned by jax_cgx: the Python half of the ``tcp`` backend (CPU).

XLA:CPU runs a process's collectives in line with its compute, so with the xla backend
the codec and the wire take turns: quantize everything, send everything, reduce, gather,
decode. The ``tcp`` backend runs the whole compressed all-reduce (SRA) of a fusion buffer
on jax_cgx's own threads over TCP connections jax_cgx opens itself, started and awaited
by two custom calls (``jax_cgx_tcp_allreduce_start`` / ``_done``,
xla_ffi/tcp_allreduce.cc); each chunk is cut into segments and an I/O thread moves
segment ``s`` while the call thread quantizes ``s + 1``, reduces as segments arrive and
decodes as the gathered ones do, and XLA runs independent work meanwhile. The result is
bitwise the xla backend's (docs/tcp.md).

Typical use, on every process, after ``jax_cgx.distributed.initialize()`` and before the
first compressed reduction is traced::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    jax_cgx.tcp.setup(mesh)           # every reduction a program on `mesh` may run

Then ``backend="auto"`` (the default) picks ``tcp`` for reductions over those axes on
that mesh, and ``backend="tcp"`` insists on it. :func:`setup` blocks until every rank of
every group has connected, so every process calls it with the same arguments in the
same order. Reduction groups and family keys are shared with the nccl backend
(``jax_cgx._src.backends.groups``); each device of a group gets a *communicator*: a TCP
connection to every other rank of its group and one I/O thread.

Addresses: each device listens on an ephemeral port of the address this process
publishes (not every interface) and publishes ``ip:port`` with a fresh random listener
key through the ``jax.distributed`` key-value store (one process needs no store:
127.0.0.1). The address is ``$JAX_CGX_TCP_HOST``, else this machine's address on the
route to the ``jax.distributed`` coordinator. Each connection's greeting carries an
HMAC under the listener's key (``jax_cgx._src.tcp.handshake``): a process that did not
read this job's store is rejected and logged, and set-up waits on for the real peer. The
store is trusted; traffic after set-up is not authenticated (docs/tcp.md, "Trust"). A
call whose peers stop moving bytes fails after ``$JAX_CGX_TCP_TIMEOUT_S`` (default
300 s) instead of hanging.

In one process (8 simulated CPU devices) the connections are loopback ones, and the result is
bitwise the xla backend's:

>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((8,), ("data",))
>>> families = jax_cgx.tcp.setup(mesh)  # {axes: family key}
>>> x = jax.device_put(jnp.linspace(-1, 1, 8 * 4096).reshape(8, 4096), NamedSharding(mesh, P("data")))
>>> def mean(backend):
...     config = jax_cgx.CompressionConfig(bits=4, backend=backend)
...     return jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_pmean(v, "data", config),
...                                  mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
>>> bool(jnp.array_equal(mean("tcp"), mean("xla")))
True
>>> len(jax_cgx.tcp.communicators())  # one per device
8
>>> jax_cgx.tcp.teardown(mesh)  # the communicators it closed
8

What it does not do: error feedback residuals and the ring algorithm run on the xla
backend (``backend="auto"`` picks it and logs why at debug level; ``"tcp"`` raises).

=================  ==================================================================
``lifecycle``      :func:`setup`, :func:`teardown`, the families, the exit hook
``handshake``      listening, connecting, greetings and who may connect
``backend``        ``jax_cgx._src.tcp.backend.TcpBackend``: its custom calls and their order
=================  ==================================================================
"""

from jax_cgx._src.tcp import backend as _backend  # noqa: F401  (registers the tcp backend)
from jax_cgx._src.tcp.lifecycle import (
    DEFAULT_TIMEOUT_S,
    HOST_ENV,
    TIMEOUT_ENV,
    CommunicatorInfo,
    TcpError,
    TcpPeerError,
    communicators,
    host_address,
    lookup,
    setup,
    teardown,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HOST_ENV",
    "TIMEOUT_ENV",
    "CommunicatorInfo",
    "TcpError",
    "TcpPeerError",
    "communicators",
    "host_address",
    "lookup",
    "setup",
    "teardown",
]
