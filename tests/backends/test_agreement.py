"""jax_cgx._src.backends.agreement in one process: descriptions, which reductions are checked, and
the verdict every process acts on (with a stand-in for the jax.distributed store). The processes
themselves: test_agreement_processes.py."""

import json
import threading
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src.backends import agreement


def _pairs(bits=4, bucket_size=64, n=1000):
    aval = jax.core.ShapedArray((1, n), np.float32)
    return agreement.fields("compressed_psum", aval, "cpu", dict(bits=bits, bucket_size=bucket_size, impl="auto",
                                                                  axes=("d",), world=2, backend="xla"), {"d": 2})


def test_a_description_names_what_goes_on_the_wire():
    text = agreement.describe(_pairs())
    assert text == ("compressed_psum(n=1000, rows=1, dtype=float32, bits=4, bucket_size=64, backend='xla', "
                    "axes=('d',), world=2, mesh={'d': 2}, platform=cpu)")
    assert agreement._differing(_pairs(bits=4), _pairs(bits=8, bucket_size=512)) == "bits, bucket_size"


def test_one_process_never_touches_the_store(monkeypatch):
    monkeypatch.setattr(agreement, "_agree", lambda *a: pytest.fail("agreed with nobody"))
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v, "d", jax_cgx.CompressionConfig(bits=4, min_size=16)),
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    f.lower(jax.device_put(np.ones(4096, np.float32), NamedSharding(mesh, P("d")))).compile()


class _Device:
    def __init__(self, process):
        self.process_index = process


def _ctx(processes_by_position, axis_names):
    devices = np.array([_Device(p) for p in np.ravel(processes_by_position)], dtype=object)
    mesh = types.SimpleNamespace(devices=devices.reshape(np.shape(processes_by_position)), axis_names=axis_names)
    return types.SimpleNamespace(module_context=types.SimpleNamespace(axis_context=types.SimpleNamespace(mesh=mesh)))


def test_only_reductions_that_cross_processes_are_checked(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    ctx = _ctx([[0, 0], [1, 1]], ("node", "local"))  # processes along "node"
    assert agreement.participants(ctx, ("local",)) is None
    assert agreement.participants(ctx, ("node",)) == (0, 1)
    assert agreement.participants(ctx, ("node", "local")) == (0, 1)
    assert agreement.participants(_ctx([[0, 0]], ("node", "local")), ("local",)) is None


class _Store:
    """The key-value store's calls agreement uses, in memory."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            assert key not in self.values, key
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


_TIMEOUT = agreement.timeout


def _both(monkeypatch, descriptions, timeout="5", timeouts=None):
    """Run _agree as processes 0 and 1 (one thread each, process_index and $JAX_CGX_AGREE_TIMEOUT_S
    per thread): their errors."""
    store, local, errors = _Store(), threading.local(), {}
    timeouts = timeouts or [timeout, timeout]
    monkeypatch.setattr(jax, "process_index", lambda: local.me)

    def timeout_here():
        with monkeypatch.context() as m:
            m.setenv(agreement.TIMEOUT_ENV, timeouts[local.me])
            return _TIMEOUT()

    monkeypatch.setattr(agreement, "timeout", timeout_here)

    def one(me):
        local.me = me
        if descriptions[me] is None:
            return  # never reaches the point
        try:
            agreement._agree(store, "jax_cgx/agree/x/0", (0, 1), json.dumps(descriptions[me]), "the point")
        except (ValueError, jax_cgx.PeerError) as err:
            errors[me] = str(err)

    threads = [threading.Thread(target=one, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_both_processes_see_a_mismatch_naming_both_settings(monkeypatch):
    errors = _both(monkeypatch, [_pairs(bits=4), _pairs(bits=8)])
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert message.startswith("jax_cgx: process 1 runs a different reduction (compressed_psum(n=1000, rows=1, "
                                  "dtype=float32, bits=8,"), message
        assert "than process 0 (compressed_psum(n=1000, rows=1, dtype=float32, bits=4," in message, message
        assert "they differ in bits." in message, message


def test_matching_processes_pass(monkeypatch):
    assert _both(monkeypatch, [_pairs(), _pairs()]) == {}


def test_a_process_that_never_arrives_is_named_after_the_timeout(monkeypatch):
    errors = _both(monkeypatch, [_pairs(), None], timeout="0.2")
    assert "process 0 waited 0.2 s at the point" in errors[0] and "for process 1, which did not reach" in errors[0]
    errors = _both(monkeypatch, [None, _pairs()], timeout="0.2")
    assert "process 1 waited 0.2 s at the point" in errors[1] and "for process 0, which did not reach" in errors[1]
    # a fault of a peer: jax_cgx.PeerError, a jax.errors.JaxRuntimeError as jax's own collectives' failures
    with pytest.raises(jax.errors.JaxRuntimeError, match="which did not reach this point") as info:
        agreement._raise_on({"seen": {"0": json.dumps(_pairs())}, "missing": [1]}, 0, 0, json.dumps(_pairs()),
                            "the point", 0.2)
    assert isinstance(info.value, jax_cgx.PeerError)


@pytest.mark.parametrize("bad", [0, 1])
def test_a_malformed_timeout_on_one_process_fails_every_process(monkeypatch, bad):
    timeouts = ["5", "5"]
    timeouts[bad] = "soon"
    errors = _both(monkeypatch, [_pairs(), _pairs()], timeouts=timeouts)
    assert set(errors) == {0, 1}
    assert errors[bad].startswith("JAX_CGX_AGREE_TIMEOUT_S='soon' is not a number of seconds"), errors[bad]
    other = errors[1 - bad]
    assert "they differ in JAX_CGX_AGREE_TIMEOUT_S." in other and "JAX_CGX_AGREE_TIMEOUT_S=malformed" in other


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_timeout_is_refused(monkeypatch, raw):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=agreement.TIMEOUT_ENV):
        agreement.timeout()
