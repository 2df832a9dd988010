"""Who may connect during jax_cgx.tcp.setup (issue 31): strangers that connect to a listener
while the real peers set up (real sockets on 127.0.0.1, one process, 8 virtual devices) are
rejected and logged, set-up completes, and the sums are bitwise the xla backend's; two jobs
with the same mesh on one host never cross-connect."""

import json
import logging
import re
import secrets
import socket
import sys
import threading
import time

import jax
import numpy as np
import pytest
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh
from processes import run_all

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.tcp import handshake, lifecycle
from jax_cgx.tcp import TcpError

WORLD = 8


def _sums(mesh, backend):
    x = jax.random.normal(jax.random.key(11), (WORLD, 30_001))
    config = CompressionConfig(bits=4, bucket_size=512, stochastic=True, min_size=0, backend=backend)
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config, key=jax.random.key(2))[None],
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    return np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("d")))))


def _set_up_under_attack(monkeypatch, attack, timeout_s=30.0):
    """setup(mesh) with ``attack(group, handshake, listener of rank 0, listener keys by rank)`` run after
    the listeners are open and published, before any real peer connects; returns (mesh, seconds)."""
    original = lifecycle._addresses

    def addresses(plan, listeners, process, timeout_s):
        out = original(plan, listeners, process, timeout_s)
        (g,) = plan
        for listener in listeners.values():  # only the published interface, not 0.0.0.0
            assert listener.sock.getsockname()[0] == "127.0.0.1"
        shake = handshake.GroupHandshake(g.key, g.generation, g.index, g.world, g.description)
        attack(g, shake, listeners[(g.index, g.key), 0], {r: k for r, (_, k) in enumerate(out[g.index, g.key])})
        return out

    monkeypatch.setattr(lifecycle, "_addresses", addresses)
    mesh = device_mesh((WORLD,), ("d",))
    start = time.monotonic()
    jax_cgx.tcp.setup(mesh, timeout_s=timeout_s)
    return mesh, time.monotonic() - start


def _dial(listener):
    host, port = listener.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.fixture
def strangers(caplog):
    """Sockets the attacks opened (closed after the test) and the warnings logged."""
    opened: list[socket.socket] = []
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        yield opened
    for s in opened:
        s.close()
    jax_cgx.tcp.teardown(device_mesh((WORLD,), ("d",)))


def _rejections(caplog):
    return [r.getMessage() for r in caplog.records if "rejected a connection from 127.0.0.1:" in r.getMessage()]


def _echo(sock, seen: list):
    """What a peer that claims rank 1 would do: send rank 0's bytes back."""
    try:
        while (data := sock.recv(65536)):
            seen.append(len(data))
            sock.sendall(data)
    except OSError:
        pass


def _forged(shake, world, rank, mac=None):
    return handshake.GREETING.pack(handshake.MAGIC, handshake.VERSION, 0, rank, world, shake.key,
                                   bytes(handshake.NONCE_BYTES), mac or secrets.token_bytes(32))


ATTACKS = {
    "garbage": (lambda g, shake, key: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64), "not a jax_cgx greeting"),
    # the public facts right, the MAC made up
    "forged MAC": (lambda g, shake, key: _forged(shake, g.world, 1), "wrong MAC"),
    # everything as a real rank 1 of another job (or attempt) would send: only the listener key differs
    "another key": (lambda g, shake, key: shake.greeting(secrets.token_bytes(32), 1, 0), "wrong MAC"),
    # a rank the listener does not wait for
    "wrong rank": (lambda g, shake, key: shake.greeting(key, 0, 0), "expected a rank above 0"),
    "older jax_cgx": (lambda g, shake, key: handshake._OLD_MAGIC + bytes(12), "older jax_cgx"),
    "version 2": (lambda g, shake, key: handshake.MAGIC + (2).to_bytes(2, "big") + bytes(62), "greeting version 2"),
    # the listener key right (inside the trust model), but not the process that claimed rank 1's connection
    # (which, in one process, has claimed it before the listener reads this)
    "second claim": (lambda g, shake, key: shake.greeting(key, 1, 0), "a duplicate claim of rank 1"),
    "short": (lambda g, shake, key: shake.greeting(key, 1, 0)[:20], "closed the connection after 20"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_stranger_is_rejected_and_the_sums_are_right(monkeypatch, strangers, caplog, name):
    make, why = ATTACKS[name]
    echoed: list[int] = []
    threads = []

    def attack(g, shake, listener, keys):
        s = _dial(listener)
        strangers.append(s)
        s.sendall(make(g, shake, keys[0]))
        if name == "short":
            s.shutdown(socket.SHUT_WR)
        threads.append(threading.Thread(target=_echo, args=(s, echoed), daemon=True))
        threads[-1].start()

    mesh, _ = _set_up_under_attack(monkeypatch, attack)
    assert_same_bits(_sums(mesh, "tcp"), _sums(mesh, "xla"), f"tcp vs xla after a {name} connection")
    (message,) = _rejections(caplog)
    assert "to rank 0 of" in message and why in message, message
    threads[0].join(5)
    assert not threads[0].is_alive() and not echoed  # closed without a byte of a reduction
    assert any("connected after rejecting 1 connection" in r.getMessage() for r in caplog.records)


def test_silent_and_held_connections_do_not_hold_setup(monkeypatch, strangers, caplog):
    """300 connections that say nothing, opened before the real peers: set-up takes the real
    ones (at most MAX_PENDING strangers wait at once) and does not wait for the silent ones."""

    def attack(g, shake, listener, keys):
        strangers.extend(_dial(listener) for _ in range(300))

    mesh, took = _set_up_under_attack(monkeypatch, attack)
    assert took < handshake.GREETING_TIMEOUT_S
    assert_same_bits(_sums(mesh, "tcp"), _sums(mesh, "xla"), "tcp vs xla after 300 held connections")
    dropped = [m for m in _rejections(caplog) if "the oldest, was dropped" in m]
    assert dropped  # counted past the first LOG_REJECTIONS, not logged one by one
    assert len(_rejections(caplog)) == handshake.LOG_REJECTIONS
    summary = [r.getMessage() for r in caplog.records if "connected after rejecting" in r.getMessage()]
    dropped_count = re.search(r"(\d+) too many pending", summary[0]) if summary else None
    assert dropped_count and int(dropped_count.group(1)) >= 300 - handshake.MAX_PENDING, summary


def test_a_duplicate_claim_fails_the_real_rank_at_once_naming_it(monkeypatch, strangers, caplog):
    """A second process that claims rank 1 first (the listener key and the store in hand) is taken by
    rank 0; the real rank 1 fails at once, its error naming the duplicate claim (before: it spent its
    whole timeout on refused connections, and nothing said why)."""

    def attack(g, shake, listener, keys):
        claims = handshake.Claims(None, lifecycle._kv_key(g, "claims"), g.description)
        nonce = claims.claim(1, 0, keys[0])  # the impostor's claim, made first
        s = _dial(listener)
        strangers.append(s)
        s.sendall(shake.greeting(keys[0], 1, 0, nonce))

    start = time.monotonic()
    with pytest.raises(TcpError, match=r"another process claimed rank 1's connection to rank 0 of .* first: a "
                                       r"duplicate claim of rank 1"):
        _set_up_under_attack(monkeypatch, attack, timeout_s=20)
    assert time.monotonic() - start < 10
    handshake.Claims._local.clear()


def test_a_second_claim_is_refused_and_logged_on_the_listener(caplog):
    shake = handshake.GroupHandshake(key=123, generation=0, index=0, world=2, description="test group",
                                     claims=handshake.Claims(None, "test/claims", "test group"))
    listeners = _listeners()
    real_nonce = shake.claims.claim(1, 0, listeners[0].key)
    impostor = handshake.connect(listeners[0].address, shake.greeting(listeners[0].key, 1, 0, bytes(16)),
                                 time.monotonic() + 5, "rank 0")
    real = handshake.connect(listeners[0].address, shake.greeting(listeners[0].key, 1, 0, real_nonce),
                             time.monotonic() + 5, "rank 0")
    try:
        with caplog.at_level(logging.WARNING, logger="jax_cgx"):
            got = shake.accept(listeners, time.monotonic() + 10)
        (message,) = _rejections(caplog)
        assert "a duplicate claim of rank 1" in message, message
        assert impostor.recv(1) == b""  # closed
        got[0][1].sendall(b"x")
        assert real.recv(1) == b"x"  # the real one was taken
    finally:
        shake.claims.forget()
        for sock in [impostor, real, *got[0].values()]:
            sock.close()
        for listener in listeners.values():
            listener.close()


def _listeners(n=1):
    return {r: handshake.open_listener("127.0.0.1") for r in range(n)}


def test_a_late_peer_is_taken_after_a_silent_one_is_dropped(monkeypatch, caplog):
    """The greeting deadline: a connection that says nothing is closed after GREETING_TIMEOUT_S
    (logged), and the real peer that comes later is still taken."""
    monkeypatch.setattr(handshake, "GREETING_TIMEOUT_S", 0.3)
    shake = handshake.GroupHandshake(key=123, generation=0, index=0, world=2, description="test group")
    listeners = _listeners()
    silent = _dial(listeners[0])
    late: list[socket.socket] = []

    def peer():
        time.sleep(0.8)
        late.append(handshake.connect(listeners[0].address, shake.greeting(listeners[0].key, 1, 0),
                                      time.monotonic() + 5, "rank 0"))

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="jax_cgx"):
            got = shake.accept(listeners, time.monotonic() + 10)
        thread.join()
        assert set(got) == {0} and set(got[0]) == {1}
        assert silent.recv(1) == b""  # closed by the listener's side
        (message,) = _rejections(caplog)
        assert "sent no complete greeting within 0.3 s" in message, message
        got[0][1].sendall(b"x")
        assert late[0].recv(1) == b"x"
    finally:
        for s in [silent, *late, *[s for row in got.values() for s in row.values()]]:
            s.close()
        for listener in listeners.values():
            listener.close()


def test_a_timeout_says_who_was_rejected(caplog):
    shake = handshake.GroupHandshake(key=123, generation=0, index=0, world=3, description="test group")
    listeners = _listeners(2)
    stranger = _dial(listeners[0])
    stranger.sendall(b"hello there, this is not it")
    try:
        with pytest.raises(TcpError, match=r"rank\(s\) \[1, 2\] to connect to rank 0; rank\(s\) \[2\] to connect to "
                                           r"rank 1 \(test group\): rejecting 1 connection .*1 not a jax_cgx greeting"):
            shake.accept(listeners, time.monotonic() + 0.5)
    finally:
        stranger.close()
        for listener in listeners.values():
            listener.close()


def test_setup_checks_mesh_and_timeout(monkeypatch):
    with pytest.raises(TypeError, match=r"expected a concrete jax.sharding.Mesh of CPU devices.*got NoneType"):
        jax_cgx.tcp.setup(None)
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds"):
        jax_cgx.tcp.setup(device_mesh((WORLD,), ("d",)), timeout_s="5")
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be > 0"):
            jax_cgx.tcp.setup(device_mesh((WORLD,), ("d",)), timeout_s=bad)
    monkeypatch.setenv("JAX_CGX_TCP_HOST", "192.0.2.1")  # TEST-NET-1: not an address of this host
    with pytest.raises(TcpError, match="cannot listen on 192.0.2.1"):
        jax_cgx.tcp.setup(device_mesh((WORLD,), ("d",)), timeout_s=5)
    assert jax_cgx.tcp.lookup(device_mesh((WORLD,), ("d",)), "d") is None


_TWIN_SCRIPT = """
import json, logging, os, pathlib, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_cgx
from jax_cgx._src.tcp import handshake, lifecycle
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
me, other, folder = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
original = lifecycle._addresses
strays = []

def addresses(plan, listeners, process, timeout_s):
    out = original(plan, listeners, process, timeout_s)
    (g,) = plan
    mine = out[g.index, g.key]
    (folder / (me + ".tmp")).write_text(json.dumps(mine[0][0]))
    (folder / (me + ".tmp")).rename(folder / (me + ".json"))
    deadline = time.monotonic() + 60
    while not (folder / (other + ".json")).exists():
        assert time.monotonic() < deadline, "the other job did not come"
        time.sleep(0.05)
    theirs = json.loads((folder / (other + ".json")).read_text())
    # Each rank's greeting to this job's rank 0, sent to the other job's rank 0 instead (same
    # mesh: same family key, generation and ranks; only the listener key differs).
    shake = handshake.GroupHandshake(g.key, g.generation, g.index, g.world, g.description)
    for rank in range(1, g.world):
        strays.append(handshake.connect(theirs, shake.greeting(mine[0][1], rank, 0), time.monotonic() + 10, "x"))
    # Both listeners stay open until both jobs have sent theirs.
    (folder / (me + ".sent")).write_text("")
    while not (folder / (other + ".sent")).exists():
        assert time.monotonic() < deadline, "the other job did not send"
        time.sleep(0.05)
    return out

lifecycle._addresses = addresses
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
jax_cgx.tcp.setup(mesh, timeout_s=60)
x = jax.random.normal(jax.random.key(int(me)), (4, 20_000))
def run(backend):
    config = jax_cgx.CompressionConfig(bits=3, min_size=0, backend=backend)
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config)[None], mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    return np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("d")))))
assert run("tcp").tobytes() == run("xla").tobytes(), "tcp differs from xla"
print("TWIN OK", me, flush=True)
"""


def test_two_jobs_with_the_same_mesh_never_cross_connect(tmp_path):
    script = tmp_path / "twin.py"
    script.write_text(_TWIN_SCRIPT)
    outcomes = run_all([[sys.executable, str(script), "1", "2", str(tmp_path)],
                        [sys.executable, str(script), "2", "1", str(tmp_path)]], timeout=240)
    for i, (returncode, log) in enumerate(outcomes, 1):
        assert returncode == 0 and f"TWIN OK {i}" in log, log[-4000:]
        rejected = [line for line in log.splitlines() if "rejected a connection from 127.0.0.1:" in line]
        assert len(rejected) == 3 and all("wrong MAC" in line for line in rejected), log[-4000:]
    assert json.loads((tmp_path / "1.json").read_text()) != json.loads((tmp_path / "2.json").read_text())
