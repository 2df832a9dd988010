"""Creating and releasing the tcp backend's communicators: :func:`setup`, :func:`teardown`.

:func:`setup` plans every group of the families asked for (the groups and family keys the
nccl backend uses too, :mod:`jax_cgx._src.backends.groups`), opens a listening socket per local member on
the address this process publishes, exchanges the addresses and listener keys (the
``jax.distributed`` key-value store), connects and authenticates each group
(:mod:`jax_cgx._src.tcp.handshake`), hands the sockets to the C++ communicators and records
its family here. At interpreter exit the communicators still alive are
stopped after ``jax.effects_barrier()``.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import numbers
import os
import socket
import time
import types

import jax
import numpy as np

from jax_cgx._src import extensions
from jax_cgx._src.arguments import DEFAULT_TIMEOUT_S, timeout_seconds
from jax_cgx._src.backends.groups import Families, PlannedGroup, groups_array, mesh_ident, mesh_parts, wanted_families
from jax_cgx._src.backends.protocol import CommunicatorInfo
from jax_cgx._src.errors import PeerError
from jax_cgx._src.tcp import handshake
from jax_cgx._src.tcp.handshake import Claims, GroupHandshake, Listener, TcpError, TcpPeerError

__all__ = ["DEFAULT_TIMEOUT_S", "HOST_ENV", "TIMEOUT_ENV", "CommunicatorInfo", "TcpError", "communicators",
           "lookup", "setup", "teardown"]

log = logging.getLogger("jax_cgx")

TIMEOUT_ENV = "JAX_CGX_TCP_TIMEOUT_S"
HOST_ENV = "JAX_CGX_TCP_HOST"
# Key-value store keys of the addresses ("host:port/listener key in hex", handshake.Listener):
# <prefix>/<family key>/<generation>/<group index>/<rank>.
KV_PREFIX = "jax_cgx/tcp/addr"

# The tcp backend's families here and their generations (part of the store keys); set-up and
# teardown write holding `lock`.
connected = Families()
lock = connected.lock
_atexit_registered = False


def timeout(timeout_s: float | None) -> float:
    """``timeout_s``, else ``$JAX_CGX_TCP_TIMEOUT_S``, else 300 s (checked as the nccl backend's)."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)):
        raise TypeError(f"jax_cgx.tcp.setup: timeout_s must be a number of seconds (or None), got {timeout_s!r}")
    return timeout_seconds(timeout_s, TIMEOUT_ENV, "jax_cgx.tcp")


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"jax_cgx.tcp.setup: expected a concrete jax.sharding.Mesh of CPU devices (e.g. "
                        f"jax.make_mesh(...)), got {type(mesh).__name__} {mesh!r}")


def _kv_client():
    from jax._src import distributed

    return distributed.global_state.client


def _route_to(target: str) -> str | None:
    """The local address of a UDP socket "connected" to ``target``: the interface on the route
    to it (no packet is sent); None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return address == "localhost"


def host_address() -> str:
    """The address this process's peers reach it at (see the package docstring).

    Returns:
      ``$JAX_CGX_TCP_HOST`` where set; ``"127.0.0.1"`` for one process; else this machine's address
      on the route to the ``jax.distributed`` coordinator (the default route's interface where that
      is a loopback address and the coordinator's is not), a ``str``.
    """
    if (host := os.environ.get(HOST_ENV)):
        return host
    if jax.process_count() == 1:
        return "127.0.0.1"
    from jax._src import distributed

    coordinator = getattr(distributed.global_state, "coordinator_address", None) or ""
    target = coordinator.rsplit(":", 1)[0].strip("[]") if coordinator else ""
    address = (_route_to(target) if target else None) or socket.gethostbyname(socket.gethostname())
    if _loopback(address) and not _loopback(target):
        # The coordinator's name resolves to loopback here (Debian and Ubuntu map the host's own
        # name to 127.0.1.1): this is its host, and peers on other hosts cannot reach a loopback
        # address. The interface of the default route (TEST-NET-1: nothing is sent) can be.
        routed = _route_to("192.0.2.1")
        if routed and not _loopback(routed):
            log.info("jax_cgx.tcp: %s resolves to %s here; publishing %s (the default route's interface) "
                     "instead (set %s to choose)", target or socket.gethostname(), address, routed, HOST_ENV)
            return routed
        log.warning("jax_cgx.tcp: publishing the loopback address %s: processes on other hosts cannot reach "
                    "it; set %s to this host's address", address, HOST_ENV)
    return address


def lookup(mesh, axes) -> int | None:
    """The family key when :func:`setup` connected ``(mesh, axes)`` here, else None.

    Args:
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``, matched as by :func:`jax_cgx.nccl.lookup`.
      axes: the reduction's axis name, or a tuple of them.

    Returns:
      The family key, a non-negative ``int`` below 2^63; None where no such family was connected
      here (also for axes the mesh lacks, or an object that is not a mesh).
    """
    return connected.find(mesh, axes)[0]


def _check_devices(devices: np.ndarray) -> None:
    platforms = sorted({str(getattr(d, "platform", "?")) for d in devices.flat})
    if platforms != ["cpu"]:
        raise TcpError(
            f"jax_cgx.tcp: the tcp backend runs on CPU devices; the mesh has {', '.join(platforms)} devices. "
            "On GPUs use jax_cgx.nccl.setup (backend 'nccl'), elsewhere backend='xla'."
        )


def _kv_key(g: PlannedGroup, rank: int | str) -> str:
    return f"{KV_PREFIX}/{g.key:016x}/{g.generation}/{g.index}/{rank}"


def _members(g: PlannedGroup, process: int) -> list[tuple[int, int]]:
    """``[(device ordinal, rank)]`` of the group's devices this process owns. The ordinal is what
    XLA:CPU gives a custom call as ``DeviceOrdinal``: the device's global id (measured, jax 0.10.2:
    process 1's first device is 2048), not its ``local_hardware_id``."""
    return [(int(d.id), rank) for rank, d in enumerate(g.devices) if int(d.process_index) == process]


def _unpublish(plan: list[PlannedGroup], listeners: dict, process: int) -> None:
    """After a failed exchange: delete the addresses this process published (their listeners are
    closed), so that a retry can publish again, and a late peer waits instead of dialing them."""
    client = _kv_client() if jax.process_count() > 1 else None
    if client is None or not hasattr(client, "key_value_delete"):
        return
    mine = {(g.index, g.key): g for g in plan if process in g.processes}
    for gk, rank in listeners:
        try:
            client.key_value_delete(_kv_key(mine[gk], rank))
        except Exception:  # noqa: BLE001 - never published, or the store is gone: nothing to undo
            pass


def _addresses(plan: list[PlannedGroup], listeners: dict[tuple, Listener], process: int,
               timeout_s: float) -> dict:
    """Every rank's ``(address, listener key)`` of every group with a member here:
    ``{(group, key): [(address, key)]}``.

    Publishes all of this process's addresses before reading any other's, so no read
    waits on a process that waits on us.
    """
    mine = {(g.index, g.key): g for g in plan if process in g.processes}
    out = {k: [""] * g.world for k, g in mine.items()}
    for (gk, rank), listener in listeners.items():
        out[gk][rank] = listener.published
    if not all(all(a for a in addrs) for addrs in out.values()):
        client = _kv_client()
        if client is None:
            raise TcpError(
                "jax_cgx.tcp.setup: several processes, but jax.distributed is not initialized, so their "
                "addresses cannot be exchanged: call jax_cgx.distributed.initialize() first"
            )
        for (gk, rank), listener in listeners.items():
            client.key_value_set(_kv_key(mine[gk], rank), listener.published)
        deadline = time.monotonic() + timeout_s
        for gk, g in mine.items():
            for rank, d in enumerate(g.devices):
                if out[gk][rank]:
                    continue
                remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    out[gk][rank] = client.blocking_key_value_get(_kv_key(g, rank), remaining_ms)
                except Exception as err:
                    raise TcpPeerError(
                        f"jax_cgx.tcp.setup: timed out after {timeout_s:g} s waiting for process "
                        f"{d.process_index} to publish the address of rank {rank} of {g.description}. Did every "
                        "process call jax_cgx.tcp.setup with the same mesh and axes, in the same order? "
                        f"({type(err).__name__}: {err})"
                    ) from err
    return {gk: [handshake.parse_published(a) for a in addrs] for gk, addrs in out.items()}


def _connect_group(g: PlannedGroup, members: list[tuple[int, int]], listeners: dict[int, Listener],
                   addresses: list[tuple[str, bytes]], timeout_s: float) -> None:
    """Connects and authenticates this process's ``members`` [(ordinal, rank)] of ``g`` and
    registers their communicators; closes the members' listeners either way."""
    claims = Claims(_kv_client() if jax.process_count() > 1 else None, _kv_key(g, "claims"), g.description)
    shake = GroupHandshake(g.key, g.generation, g.index, g.world, g.description, claims)
    deadline = time.monotonic() + timeout_s
    sockets: dict[int, dict] = {rank: {} for _, rank in members}
    try:
        # 1. Every member claims its connections to the ranks below it, connects (the peer's
        #    kernel completes the TCP handshake from its listen backlog: nothing waits on an
        #    accept) and greets them.
        for _, rank in members:
            for peer in range(rank):
                address, key = addresses[peer]
                greeting = shake.greeting(key, rank, peer, claims.claim(rank, peer, key))
                sockets[rank][peer] = handshake.connect(address, greeting, deadline, f"rank {peer} of {g.description}")
        # 2. Then accepts the ranks above it, each proving it read this attempt's listener key.
        for rank, accepted in shake.accept(listeners, deadline).items():
            sockets[rank].update(accepted)
    except BaseException:
        for row in sockets.values():
            for sock in row.values():
                sock.close()
        raise
    finally:
        claims.forget()
        for listener in listeners.values():
            listener.close()
    # The C++ communicators own the descriptors from here (tcp_adopt closes them on an error).
    rows = [(ordinal, rank, [sockets[rank][j].detach() if j != rank else -1 for j in range(g.world)])
            for ordinal, rank in members]
    extensions.cpu().tcp_adopt(g.key, g.world, rows, g.description, timeout_s)


def setup(mesh, axes=None, *, timeout_s: float | None = None):
    """Connect the tcp backend's communicators of every reduction a program on ``mesh`` may run.

    Call on every process, with the same arguments and in the same order, before the
    first compressed reduction with backend "tcp"/"auto" is compiled; it blocks until
    every rank of every group has connected.

    Args:
      mesh: a concrete ``jax.sharding.Mesh`` of CPU devices.
      axes: the reductions, as for :func:`jax_cgx.nccl.setup`: ``None`` (every non-empty
        subset of the mesh's axes), a name or tuple of names, or a list of those.
      timeout_s: how long set-up waits for peers, and how long a call waits for bytes to
        move before failing (default ``$JAX_CGX_TCP_TIMEOUT_S`` or 300 s).

    Returns:
      A read-only mapping: each family of ``axes`` whose groups have more than one device (those set
      up before included), its axes tuple -> its family key.

    Raises:
      TypeError: ``mesh`` not a concrete ``jax.sharding.Mesh``; ``timeout_s`` not a number.
      ValueError: ``timeout_s`` (or ``JAX_CGX_TCP_TIMEOUT_S``) not in (0, 1e9] seconds; ``axes``
        empty, naming an axis twice or one ``mesh`` lacks; ``mesh``'s devices not matching its axes.
      TcpError: devices that are not CPU devices; several processes without ``jax.distributed``
        initialized; a connection that failed.
      TcpPeerError: a peer that never published its address or never connected within the timeout,
        refused, or was claimed twice.

    Returns the families of this call (axes tuple -> key), a read-only mapping. Families
    already set up are kept, so calling again is cheap.
    """
    global _atexit_registered
    _check_mesh(mesh)
    wait = timeout(timeout_s)
    devices, names = mesh_parts(mesh)
    _check_devices(devices)
    ident = mesh_ident(devices, names)
    wanted = wanted_families(devices, names, axes)
    binding = extensions.cpu()
    with lock:
        have = connected.of(ident)
        # In one order on every process, whatever order the caller listed the axes in: connecting
        # walks the families in this order, and two orders would wait on each other until the timeout.
        new = sorted((fam for fam in wanted if fam not in have), key=lambda fam: wanted[fam])
        if not new:
            return types.MappingProxyType(dict(wanted))
        process = jax.process_index()
        plan: list[PlannedGroup] = []
        for fam in new:
            key = wanted[fam]
            arr = groups_array(devices, names, fam)
            plan.extend(PlannedGroup(fam, key, connected.generation(key), i, len(arr), tuple(g))
                        for i, g in enumerate(arr))
        # (group index, key), rank -> Listener, for this process's members: on the address this
        # process publishes (not every interface), each with a fresh key for this attempt.
        listeners: dict = {}
        try:
            host = host_address() if any(_members(g, process) for g in plan) else ""
            for g in plan:
                for _, rank in _members(g, process):
                    listeners[(g.index, g.key), rank] = handshake.open_listener(host)
            addresses = _addresses(plan, listeners, process, wait)
        except BaseException:
            for listener in listeners.values():
                listener.close()
            _unpublish(plan, listeners, process)
            raise
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        published = dict.fromkeys(listeners)  # listeners are handed over below
        # One global order (families, then groups): connecting never waits on an accept,
        # accepting waits only on ranks that connect in the same group.
        try:
            for g in plan:
                members = _members(g, process)
                if members:
                    mine = {rank: listeners.pop(((g.index, g.key), rank)) for _, rank in members}
                    try:
                        _connect_group(g, members, mine, addresses[g.index, g.key], wait)
                    except Exception as err:
                        error = TcpPeerError if isinstance(err, PeerError) else TcpError
                        raise error(
                            f"jax_cgx.tcp.setup: connecting {g.description} (members (ordinal, rank) "
                            f"{members} of {g.world}) failed: {err}"
                        ) from err
        except BaseException:
            for listener in listeners.values():
                listener.close()
            for fam in new:
                binding.tcp_destroy(wanted[fam])
            # As after a failed exchange: a retry (here and on the peers, which fail too) uses this
            # generation again, and must not find this attempt's addresses.
            _unpublish(plan, published, process)
            raise
        for fam in new:
            # A connected generation's addresses stay published: the next set-up of this family
            # (after a teardown) publishes under the next generation.
            connected.advance_generation(wanted[fam])
            connected.record(ident, fam, wanted[fam])
            log.debug("jax_cgx.tcp: communicators for axes %r (key %#x)", fam, wanted[fam])
    return types.MappingProxyType(dict(wanted))


def teardown(mesh=None) -> int:
    """Stop the communicators of ``mesh`` (all when None) and forget them; returns how many.

    No computation that uses them may still be running: block on its results first. A
    call still waiting for peers fails with an error instead of hanging.

    Args:
      mesh: the mesh whose communicators go (those of every family set up on it); None (the
        default): every tcp communicator of this process.

    Returns:
      The number of communicators stopped, an ``int`` (0 where none were set up).

    Raises:
      TypeError: an ``AbstractMesh``.
      ValueError: ``mesh``'s devices not matching its axes.
    """
    binding = extensions.cpu()
    with lock:
        if mesh is None:
            keys = [] if connected.empty() else [-1]
            connected.forget()
        else:
            devices, names = mesh_parts(mesh)
            keys = sorted(set(connected.forget(mesh_ident(devices, names)).values()))
        if not keys:
            return 0
        try:
            jax.effects_barrier()
        except Exception:  # pragma: no cover - best effort
            pass
        return sum(int(binding.tcp_destroy(k)) for k in keys)


def communicators() -> list[CommunicatorInfo]:
    """Every tcp communicator of this process.

    Returns:
      A list of :class:`~jax_cgx.nccl.CommunicatorInfo`, one per (family, local device).
    """
    return [CommunicatorInfo(*row) for row in extensions.cpu().tcp_communicators()]


def _at_exit() -> None:
    """Stop what is left after the last effects (no lock: a thread stuck in setup must not block exit)."""
    if connected.empty():
        return
    connected.forget()
    try:
        jax.effects_barrier()
    except Exception:
        pass
    try:
        extensions.cpu().tcp_destroy(-1)
    except Exception as err:  # pragma: no cover - exit is best effort
        log.warning("jax_cgx.tcp: stopping communicators at exit failed: %s", err)
