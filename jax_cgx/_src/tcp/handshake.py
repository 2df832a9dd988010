"""The tcp backend's set-up handshake: listening, connecting, and checking who connected.

Every member of a group connects to the ranks below it and sends one greeting, then
accepts the ranks above it (connecting never waits on an accept: the peer's kernel
completes the TCP handshake from its listen backlog), so the greeting is one-way.

Who may connect. Each listener, for each set-up attempt, has a fresh random 32-byte
*listener key* (:mod:`secrets`), published with its address in the ``jax.distributed``
key-value store (one process: kept in memory) and never sent over a tcp connection.
A greeting is::

    magic "cgxT", version, claimed rank, world, family key, claim nonce,
    HMAC-SHA256(listener key, DOMAIN | family key | generation | group index | world |
                from rank | to rank | claim nonce)

so only a process that read the store (a process of this job, this attempt) can make
one, and a greeting made for one listener, rank or attempt is worthless for another.

Duplicate claims. Before it connects, rank ``r``'s process *claims* its connection to rank
``r0`` (:class:`Claims`): it publishes a fresh random nonce under the connection's key, which
the store keeps only once. The greeting carries the nonce; the listener accepts a greeting
only if it carries the nonce published for that connection. So a second process claiming
rank ``r`` (one started with the same rank, or of a stale attempt holding this attempt's
key) is refused, logged at WARNING on the listener, whichever connects first; and if it
claimed first, the real rank's set-up fails at once with a :class:`TcpError` naming the
duplicate claim, instead of spending its timeout on refused connections.
The accepting side serves its listeners and every pending connection at once
(:mod:`selectors`): a connection that sends anything else, claims a rank that is not
expected or already connected, or sends nothing within :data:`GREETING_TIMEOUT_S` is
closed and logged at WARNING with its address, and set-up goes on waiting for the real
peer until its own deadline. At most :data:`MAX_PENDING` connections wait for their
greeting at once (the oldest is dropped for a new one), so held connections cannot
crowd out the real peer. The connected sockets go to the C++ communicators
(``tcp_adopt``) as file descriptors.

Nothing after the greeting is authenticated or encrypted (docs/tcp.md, "Trust").
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time

from jax_cgx._src.backends.protocol import BackendError
from jax_cgx._src.errors import PeerError

__all__ = ["GREETING", "GREETING_TIMEOUT_S", "MAX_PENDING", "Claims", "GroupHandshake", "Listener", "TcpError",
           "TcpPeerError", "connect",
           "open_listener", "parse_published"]

log = logging.getLogger("jax_cgx")


class TcpError(BackendError):
    """The tcp backend cannot do what was asked (set-up, a missing communicator, a dead peer)."""


class TcpPeerError(TcpError, PeerError):
    """Set-up failed because of a peer: it never connected, refused, or was claimed twice. Both a
    :class:`TcpError` and a :class:`~jax_cgx.PeerError` (a ``jax.errors.JaxRuntimeError``)."""


MAGIC = b"cgxT"
VERSION = 3
# magic, version, flags (0), claimed rank, world, family key, claim nonce, MAC.
GREETING = struct.Struct("!4sHHIIq16s32s")
DOMAIN = b"jax_cgx.tcp greeting v3\0"
# What version 1 (no MAC) sent first: its magic, a native little-endian uint32.
_OLD_MAGIC = struct.pack("<I", 0x63677874)
KEY_BYTES = 32
NONCE_BYTES = 16
# A connection must have sent its whole greeting this long after it was accepted (at most
# the set-up timeout).
GREETING_TIMEOUT_S = 10.0
# Connections waiting for their greeting at once, per group; beyond it the oldest is dropped.
MAX_PENDING = 64
# accept() errors that a pause may cure (the others: the next connection).
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# Rejections logged one by one per group; the rest are counted in one summary.
LOG_REJECTIONS = 20


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclasses.dataclass
class Listener:
    """A listening socket of one member of one group, and its key for this attempt."""

    sock: socket.socket
    address: str  # "ip:port" ("[ip]:port" for IPv6), where it listens
    key: bytes

    @property
    def published(self) -> str:
        """What goes into the key-value store: ``address/key in hex``."""
        return f"{self.address}/{self.key.hex()}"

    def close(self) -> None:
        self.sock.close()


def parse_published(value: str) -> tuple[str, bytes]:
    """``(address, listener key)`` of a :attr:`Listener.published` string."""
    address, sep, key = value.rpartition("/")
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if not sep or len(raw) != KEY_BYTES:
        raise TcpError(f"jax_cgx.tcp.setup: {value!r} in the key-value store is not an address with a listener key "
                       "(a process of another jax_cgx version?)")
    return address, raw


def open_listener(host: str) -> Listener:
    """A listening socket on an ephemeral port of ``host``'s address (an address of this machine:
    the one this process publishes), not of every interface."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError) as err:
        raise TcpError(f"jax_cgx.tcp.setup: cannot resolve the address to listen on, {host!r}: {err}") from err
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(where[:2])
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as err:
        sock.close()
        raise TcpError(f"jax_cgx.tcp.setup: cannot listen on {where[0]} (the address this process publishes; is it "
                       f"an address of this host? $JAX_CGX_TCP_HOST chooses it): {err}") from err
    return Listener(sock, _join(where[0], sock.getsockname()[1]), secrets.token_bytes(KEY_BYTES))


def connect(address: str, greeting: bytes, deadline: float, what: str) -> socket.socket:
    """A socket connected to ``address`` that has sent ``greeting``; refused connections are
    retried until ``deadline`` (time.monotonic())."""
    host, port = _split(address)
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(left, 0.05))
        except (ConnectionRefusedError, TimeoutError, InterruptedError) as err:
            if time.monotonic() + 0.05 >= deadline:
                raise TcpPeerError(f"connecting to {what} at {address} failed: {err}") from err
            time.sleep(0.05)
            continue
        except OSError as err:
            raise TcpPeerError(f"connecting to {what} at {address} failed: {err}") from err
        try:
            sock.sendall(greeting)  # fits a socket buffer: never waits for the peer's accept
        except OSError as err:
            sock.close()
            raise TcpPeerError(f"greeting {what} at {address} failed: {err}") from err
        return sock


class Claims:
    """Which process claimed each connection of one group's set-up attempt (module docstring).

    ``client``: the ``jax.distributed`` key-value store client, or None (one process: the
    claims are kept in memory); ``prefix``: the group's attempt's key in the store.
    """

    _local: dict[str, str] = {}  # one process: claims of its attempts in progress

    def __init__(self, client, prefix: str, description: str):
        self.client, self.prefix, self.description = client, prefix, description
        self._mine: list[str] = []

    def _key(self, from_rank: int, to_rank: int, listener_key: bytes) -> str:
        # The listener's key is fresh for each set-up attempt: a retry after a failed one (the same
        # generation) claims under other keys, not those its own first attempt left in the store.
        attempt = hashlib.sha256(listener_key).hexdigest()[:16]
        return f"{self.prefix}/claim/{from_rank}/{to_rank}/{attempt}"

    def claim(self, from_rank: int, to_rank: int, listener_key: bytes) -> bytes:
        """A fresh nonce, published as rank ``from_rank``'s claim of its connection to ``to_rank``
        (whose listener key is ``listener_key``); a :class:`TcpPeerError` naming the duplicate when
        another process claimed it first."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        key = self._key(from_rank, to_rank, listener_key)
        try:
            if self.client is None:
                if key in self._local:
                    raise KeyError(f"ALREADY_EXISTS: {key}")
                self._local[key] = nonce.hex()
            else:
                self.client.key_value_set(key, nonce.hex())  # kept once: a second set fails
        except Exception as err:  # noqa: BLE001 - the store's error, told apart by its text
            if "already" not in str(err).lower():  # not a duplicate: the store itself failed
                raise TcpError(f"jax_cgx.tcp.setup: publishing rank {from_rank}'s claim of its connection to rank "
                               f"{to_rank} of {self.description} in the key-value store failed: {err}") from err
            raise TcpPeerError(
                f"jax_cgx.tcp.setup: another process claimed rank {from_rank}'s connection to rank {to_rank} of "
                f"{self.description} first: a duplicate claim of rank {from_rank} (two processes started with the "
                "same rank, or a process of an earlier attempt still running), which rank "
                f"{to_rank} may have taken for this one. Stop the other process and set up again "
                f"({type(err).__name__}: {err})") from None
        self._mine.append(key)
        return nonce

    def lookup(self, from_rank: int, to_rank: int, listener_key: bytes) -> bytes | None:
        """The nonce rank ``from_rank``'s process published for the connection, None if none was."""
        key = self._key(from_rank, to_rank, listener_key)
        try:
            value = self._local.get(key) if self.client is None else self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - the store's NOT_FOUND
            return None
        try:
            return bytes.fromhex(value) if value else None
        except ValueError:
            return None

    def forget(self) -> None:
        """Drop this process's in-memory claims once the group is connected (or failed)."""
        if self.client is None:
            for key in self._mine:
                self._local.pop(key, None)
        self._mine.clear()


@dataclasses.dataclass
class _Pending:
    sock: socket.socket
    peer: str
    to_rank: int
    deadline: float
    data: bytearray = dataclasses.field(default_factory=bytearray)


@dataclasses.dataclass
class GroupHandshake:
    """The greetings of one group of one set-up attempt."""

    key: int  # family key
    generation: int
    index: int  # the group's index in its family
    world: int
    description: str
    claims: Claims | None = None  # None: claims are not checked (tests of the greeting alone)

    def mac(self, listener_key: bytes, from_rank: int, to_rank: int, nonce: bytes) -> bytes:
        fields = struct.pack("!qIIIII", self.key, self.generation, self.index, self.world, from_rank, to_rank)
        return hmac.new(listener_key, DOMAIN + fields + nonce, hashlib.sha256).digest()

    def greeting(self, listener_key: bytes, from_rank: int, to_rank: int, nonce: bytes = bytes(NONCE_BYTES)) -> bytes:
        """What rank ``from_rank`` sends the listener of rank ``to_rank`` (whose key is ``listener_key``),
        with the ``nonce`` of its claim of the connection."""
        return GREETING.pack(MAGIC, VERSION, 0, from_rank, self.world, self.key, nonce,
                             self.mac(listener_key, from_rank, to_rank, nonce))

    def check(self, data: bytes, listener_key: bytes, to_rank: int) -> tuple[int, str, str]:
        """(claimed rank, "", "") for a good greeting to rank ``to_rank``, else (-1, why, kind)."""
        magic, version, _, rank, world, key, nonce, mac = GREETING.unpack(data)
        if magic != MAGIC:
            return -1, f"not a jax_cgx greeting (it began {bytes(data[:8])!r})", "not a jax_cgx greeting"
        if version != VERSION:
            return -1, f"greeting version {version}, this is {VERSION} (another jax_cgx version)", "another version"
        if key != self.key or world != self.world or not to_rank < rank < world:
            return -1, (f"its greeting claims rank {rank} of {world} of family {key:#x}; expected a rank above "
                        f"{to_rank} of {self.world} of family {self.key:#x}"), "unexpected claim"
        if not hmac.compare_digest(mac, self.mac(listener_key, rank, to_rank, nonce)):
            return -1, (f"its greeting (claiming rank {rank}) has a wrong MAC: it is not from a process of this "
                        "job's set-up (another job, a stale attempt, or a forgery)"), "wrong MAC"
        if self.claims is not None:
            claimed = self.claims.lookup(rank, to_rank, listener_key)
            if claimed is None:
                return -1, (f"its greeting claims rank {rank}, but rank {rank}'s process has not claimed this "
                            "connection (it does before connecting): a process holding this attempt's listener key "
                            f"that is not rank {rank}"), "unclaimed"
            if not hmac.compare_digest(claimed, nonce):
                return -1, (f"a duplicate claim of rank {rank}: rank {rank}'s process claimed this connection with "
                            "another nonce, so this connection is from a second process claiming that rank (two "
                            "processes started with the same rank, or one of an earlier attempt)"), "duplicate claim"
        return rank, "", ""

    def accept(self, listeners: dict[int, Listener], deadline: float) -> dict[int, dict[int, socket.socket]]:
        """``{member rank: {rank above it: socket}}``: every rank above each member, authenticated.

        Serves every listener and pending connection at once until each member has all its
        ranks above, or raises :class:`TcpError` at ``deadline`` (time.monotonic()). Closes
        nothing it was given; closes every socket it accepted on an error.
        """
        got: dict[int, dict[int, socket.socket]] = {r: {} for r in listeners}
        missing = lambda: {r: [f for f in range(r + 1, self.world) if f not in got[r]]  # noqa: E731
                           for r in listeners if len(got[r]) < self.world - 1 - r}
        pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        rejected: collections.Counter = collections.Counter()
        sel = selectors.DefaultSelector()
        short_of = [False]  # accept() ran out of resources (logged once)
        start = time.monotonic()
        wait_greeting = max(min(GREETING_TIMEOUT_S, deadline - start), 0.001)

        def reject(p: _Pending, why: str, kind: str) -> None:
            sel.unregister(p.sock)
            del pending[p.sock]
            p.sock.close()
            rejected[kind] += 1
            count = sum(rejected.values())
            if count <= LOG_REJECTIONS:
                log.warning("jax_cgx.tcp: rejected a connection from %s to rank %d of %s: %s",
                            p.peer, p.to_rank, self.description, why)
            if count == LOG_REJECTIONS:
                log.warning("jax_cgx.tcp: further rejected connections to %s are counted, not logged",
                            self.description)

        def read(p: _Pending) -> None:
            while len(p.data) < GREETING.size:
                try:
                    chunk = p.sock.recv(GREETING.size - len(p.data))  # never past the greeting
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as err:
                    return reject(p, f"the connection failed before its greeting was complete: {err}",
                                  "closed early")
                if not chunk:
                    return reject(p, f"it closed the connection after {len(p.data)} of the greeting's "
                                     f"{GREETING.size} bytes", "closed early")
                p.data += chunk
                if len(p.data) >= 4 and p.data[:4] != MAGIC:
                    why = ("a greeting of an older jax_cgx (without a MAC)" if p.data[:4] == _OLD_MAGIC
                           else f"not a jax_cgx greeting (it began {bytes(p.data[:8])!r})")
                    return reject(p, why, "not a jax_cgx greeting")
                if len(p.data) >= 6 and (version := struct.unpack("!H", p.data[4:6])[0]) != VERSION:
                    # another greeting size: waiting for this one's would only time out
                    return reject(p, f"greeting version {version}, this is {VERSION} (another jax_cgx version)",
                                  "another version")
            rank, why, kind = self.check(bytes(p.data), listeners[p.to_rank].key, p.to_rank)
            if rank >= 0 and rank in got[p.to_rank]:
                rank, why, kind = -1, f"rank {rank} is connected already (a replayed greeting?)", "duplicate"
            if rank < 0:
                return reject(p, why, kind)
            sel.unregister(p.sock)
            del pending[p.sock]
            p.sock.setblocking(True)
            got[p.to_rank][rank] = p.sock

        def accept_from(listener: Listener, to_rank: int, now: float) -> None:
            for _ in range(MAX_PENDING):  # then let the others have a turn
                try:
                    sock, where = listener.sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as err:
                    if err.errno not in _OUT_OF_RESOURCES:  # e.g. a stranger reset before the accept
                        continue
                    # Out of file descriptors or memory: retried on the next turn, after a pause
                    # (the listener stays readable: no busy loop), logged once.
                    if not short_of[0]:
                        log.warning("jax_cgx.tcp: accepting a connection to rank %d of %s failed: %s", to_rank,
                                    self.description, err)
                    short_of[0] = True
                    time.sleep(0.05)
                    return
                sock.setblocking(False)
                if len(pending) >= MAX_PENDING:
                    reject(next(iter(pending.values())), f"more than {MAX_PENDING} connections were waiting to "
                           "send their greetings; this, the oldest, was dropped", "too many pending")
                p = _Pending(sock, _join(*where[:2]), to_rank, now + wait_greeting)
                pending[sock] = p
                sel.register(sock, selectors.EVENT_READ, p)
                read(p)  # a real peer's greeting is usually there already

        try:
            for rank, listener in listeners.items():
                if rank < self.world - 1:
                    sel.register(listener.sock, selectors.EVENT_READ, rank)
            while missing():
                now = time.monotonic()
                for p in [p for p in pending.values() if p.deadline <= now]:
                    reject(p, f"it sent no complete greeting within {wait_greeting:g} s", "no greeting in time")
                if now >= deadline:
                    raise TcpPeerError(self._timed_out(missing(), deadline - start, rejected))
                until = min([deadline, *(p.deadline for p in pending.values())])
                for item, _ in sel.select(max(until - now, 0.0)):
                    if isinstance(item.data, _Pending):
                        if item.data.sock in pending:
                            read(item.data)
                    else:
                        accept_from(listeners[item.data], item.data, time.monotonic())
            for p in list(pending.values()):  # every rank is in: whoever else is there is not one
                reject(p, "it had not sent a whole greeting when every rank had connected", "no greeting in time")
        except BaseException:
            for socks in got.values():
                for sock in socks.values():
                    sock.close()
            raise
        finally:
            for p in pending.values():
                p.sock.close()
            sel.close()
        if rejected:
            log.warning("jax_cgx.tcp: %s connected after %s", self.description, _rejections(rejected))
        return got

    def _timed_out(self, missing: dict[int, list[int]], waited: float, rejected) -> str:
        waits = "; ".join(f"rank(s) {ranks} to connect to rank {r}" for r, ranks in missing.items())
        return (f"timed out after {waited:.3g} s waiting for {waits} ({self.description}): "
                + (f"{_rejections(rejected)}. " if rejected else "no other connection came. ")
                + "Did every process call jax_cgx.tcp.setup with the same mesh and axes, in the same order? "
                "A slower peer may need more time: setup(timeout_s=...) or $JAX_CGX_TCP_TIMEOUT_S")


def _rejections(rejected: collections.Counter) -> str:
    n = sum(rejected.values())
    parts = ", ".join(f"{c} {kind}" for kind, c in rejected.most_common())
    return (f"rejecting {n} connection{'s' if n != 1 else ''} that did not prove they belong to this job "
            f"({parts}; see the warnings on the 'jax_cgx' logger)")
