"""jax_cgx.nccl on CPU: groups and keys, setup and lookup, and choosing the backend, over a fake binding.

Real NCCL is not needed: jax_cgx._src.nccl.library.binding is replaced by tests/support/nccl_worker.FakeNccl
and meshes are made of FakeDevice GPUs, except where the point is jax's own numbering.
"""

import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from nccl_worker import FakeDevice, FakeNccl, fake_mesh  # noqa: E402
from processes import SUPPORT, run_all, worker_commands

from jax_cgx import nccl
from jax_cgx._src import backends
from jax_cgx._src.backends import protocol
from jax_cgx._src.nccl import library, lifecycle, registry, unique_ids

WORKER = SUPPORT / "nccl_worker.py"


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Every test starts with no communicators and no loaded library, and leaves none."""
    registry.connected.reset()
    monkeypatch.setattr(library, "_loaded", None)
    monkeypatch.setattr(lifecycle, "_atexit_registered", True)  # tests register no exit hooks
    monkeypatch.delenv(nccl.LIBRARY_ENV, raising=False)
    monkeypatch.delenv(nccl.TIMEOUT_ENV, raising=False)
    yield
    registry.connected.reset()


@pytest.fixture
def fake(monkeypatch):
    binding = FakeNccl()
    monkeypatch.setattr(library, "binding", lambda: binding)
    return binding


def _ordered_subsets(names):
    return [p for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)
            for p in itertools.permutations(c)]


def _cpu_meshes():
    # The 8 virtual CPU devices (conftest) even where a GPU is JAX's default backend.
    devs = np.array(jax.devices("cpu"))
    perm = np.random.default_rng(1).permutation(8)
    return [
        Mesh(devs, ("x",)),
        Mesh(devs[perm].reshape(2, 4), ("a", "b")),
        Mesh(devs[perm[::-1]].reshape(2, 2, 2), ("a", "b", "c")),
    ]


# ------------------------------------------------------------- groups


@pytest.mark.parametrize("mesh", _cpu_meshes(), ids=lambda m: "x".join(map(str, m.devices.shape)))
def test_groups_rank_order_is_axis_index(mesh):
    names = mesh.axis_names
    subsets = _ordered_subsets(names)

    def body(x):
        idx = jnp.stack([jax.lax.axis_index(s if len(s) > 1 else s[0]) for s in subsets])
        return idx.reshape((1,) * len(names) + (len(subsets),))

    spec = P(*names)
    x = jax.device_put(np.zeros(mesh.devices.shape, np.int32), jax.NamedSharding(mesh, spec))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(*names, None)))
    out = np.asarray(f(x))  # out[coords..., s] = axis_index(subsets[s]) on mesh.devices[coords]
    rank_of = {}
    for coords in np.ndindex(mesh.devices.shape):
        rank_of[mesh.devices[coords].id] = out[coords]

    for s, axes in enumerate(subsets):
        gs = nccl.groups(mesh, axes)
        world = int(np.prod([mesh.shape[a] for a in axes]))
        assert len(gs) == 8 // world and all(len(g) == world for g in gs), axes
        assert sorted(d.id for g in gs for d in g) == list(range(8)), axes  # a partition
        for g in gs:
            assert [int(rank_of[d.id][s]) for d in g] == list(range(world)), (axes, [d.id for d in g])
            # Members of a group share every other mesh coordinate.
            others = [i for i, n in enumerate(names) if n not in axes]
            coords = [tuple(np.argwhere(mesh.device_ids == d.id)[0][others]) for d in g]
            assert len(set(coords)) == 1, axes
    # Groups come in the order of their other coordinates.
    gs = nccl.groups(mesh, names[-1])
    firsts = [tuple(np.argwhere(mesh.device_ids == g[0].id)[0][:-1]) for g in gs]
    assert firsts == sorted(firsts)


def test_groups_name_or_tuple_and_errors():
    mesh = _cpu_meshes()[1]
    assert nccl.groups(mesh, "a") == nccl.groups(mesh, ("a",))
    with pytest.raises(ValueError, match="not axes of the mesh"):
        nccl.groups(mesh, "z")
    with pytest.raises(ValueError, match="twice"):
        nccl.groups(mesh, ("a", "a"))
    with pytest.raises(ValueError, match="at least one"):
        nccl.groups(mesh, ())
    with pytest.raises(TypeError, match="AbstractMesh"):
        nccl.groups(mesh.abstract_mesh, "a")


# ------------------------------------------------------------- keys


def test_family_key_stable_and_distinct():
    m1, m2, m3 = _cpu_meshes()
    reordered = Mesh(np.array(jax.devices("cpu"))[::-1], ("x",))
    renamed = Mesh(np.array(jax.devices("cpu")), ("y",))
    keys = {
        "m1/x": nccl.family_key(m1, "x"),
        "reordered/x": nccl.family_key(reordered, "x"),
        "m2/a": nccl.family_key(m2, "a"),
        "m2/b": nccl.family_key(m2, "b"),
        "m2/ab": nccl.family_key(m2, ("a", "b")),
        "m2/ba": nccl.family_key(m2, ("b", "a")),
        "m3/ab": nccl.family_key(m3, ("a", "b")),
        "renamed/y": nccl.family_key(renamed, "y"),
        "other devices/x": nccl.family_key(fake_mesh((8,), ("x",), [FakeDevice(i + 8) for i in range(8)]), "x"),
    }
    assert len(set(keys.values())) == len(keys), keys
    for k in keys.values():
        assert isinstance(k, int) and 0 <= k < 2**63
    assert nccl.family_key(m2, "a") == nccl.family_key(m2, ("a",)) == keys["m2/a"]
    same = Mesh(m2.devices.copy(), ("a", "b"))
    assert nccl.family_key(same, ("a", "b")) == keys["m2/ab"]


def test_family_key_is_reproducible_across_processes():
    import subprocess

    code = ("import sys; sys.path.insert(0, %r); from nccl_worker import fake_mesh; from jax_cgx import nccl; "
            "print(nccl.family_key(fake_mesh((2, 4), ('a', 'b')), ('b', 'a')))") % str(WORKER.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "123"}).stdout
    assert int(out.split()[-1]) == nccl.family_key(fake_mesh((2, 4), ("a", "b")), ("b", "a"))


# ------------------------------------------------------------- setup over the fake binding


def test_setup_all_families(fake):
    mesh = fake_mesh((2, 4), ("a", "b"))
    comms = nccl.setup(mesh)
    assert list(comms.families) == [("a",), ("b",), ("a", "b")]
    assert comms.families[("a",)] == nccl.family_key(mesh, "a")
    assert len(fake.load_calls) == 1
    # one init per group, with that group's world and (ordinal, rank) members; one uid per group
    expected = [(axes, g) for axes in comms.families for g in nccl.groups(mesh, axes)]
    assert len(fake.inits) == len(expected) == 4 + 2 + 1 == fake.uid_calls
    for call, (axes, g) in zip(fake.inits, expected):
        assert call["key"] == comms.families[axes]
        assert call["world"] == len(g)
        assert call["members"] == [(d.local_hardware_id, r) for r, d in enumerate(g)]
        assert f"axes={axes!r}" in call["description"]
    assert len({c["uid"] for c in fake.inits}) == len(fake.inits)
    assert len(nccl.communicators()) == 8 * 3
    info = nccl.communicators()[0]
    assert isinstance(info, nccl.CommunicatorInfo) and info.world in (2, 4, 8)

    # idempotent
    again = nccl.setup(mesh)
    assert again == comms and len(fake.inits) == 7 and fake.uid_calls == 7
    assert "Communicators(mesh=Mesh(" in repr(comms) and "('a', 'b'): 0x" in repr(comms)

    for axes, key in comms.families.items():
        assert nccl.lookup(mesh, axes) == key
    assert nccl.lookup(mesh, ("b", "a")) is None  # another rank order: not set up
    assert nccl.lookup(mesh, "a") == comms.families[("a",)]
    assert nccl.lookup(mesh.abstract_mesh, ("a", "b")) == comms.families[("a", "b")]

    assert nccl.teardown(mesh) == 24
    assert sorted(fake.destroys) == sorted((k, False) for k in comms.families.values())
    assert nccl.lookup(mesh, "a") is None and nccl.communicators() == []
    assert nccl.teardown(mesh) == 0  # nothing left
    nccl.setup(mesh, "a")
    assert len(fake.inits) == 7 + 4


def test_setup_explicit_axes(fake):
    mesh = fake_mesh((2, 1, 4), ("a", "one", "b"))
    comms = nccl.setup(mesh, [("b", "a"), "a", ("one",)])
    assert list(comms.families) == [("b", "a"), ("a",)]  # a family of single devices is skipped
    first = nccl.groups(mesh, ("b", "a"))[0]
    assert fake.inits[0]["members"] == [(d.local_hardware_id, r) for r, d in enumerate(first)]
    assert [d.id for d in first] == [0, 4, 1, 5, 2, 6, 3, 7]  # b major
    # a tuple of names is one reduction, as psum's axis_name
    assert list(nccl.setup(mesh, ("a", "b")).families) == [("a", "b")]
    assert nccl.setup(mesh, ("one",)).families == {}
    # axes=None skips every family of world 1
    assert ("one",) not in nccl.setup(mesh).families and ("a", "one") in nccl.setup(mesh).families
    with pytest.raises(ValueError, match="not axes of the mesh"):
        nccl.setup(mesh, ["z"])
    with pytest.raises(ValueError, match="id_exchange"):
        nccl.setup(mesh, id_exchange="smoke")


def test_setup_process_local_devices_and_ordinals(fake):
    # Process 0 of 2 (as seen by this test): only its devices get communicators.
    devices = [FakeDevice(i, process_index=i // 4, local_hardware_id=i % 4) for i in range(8)]
    mesh = fake_mesh((2, 4), ("p", "l"), devices)
    nccl.setup(mesh, "l")  # groups within one process: no exchange needed
    assert [c["members"] for c in fake.inits] == [[(0, 0), (1, 1), (2, 2), (3, 3)]]
    assert fake.uid_calls == 1


def test_setup_needs_gpus():
    mesh = _cpu_meshes()[1]
    with pytest.raises(nccl.NcclError, match="need CUDA devices; the mesh has cpu devices.*backend='xla'"):
        nccl.setup(mesh)


def test_setup_init_failure_aborts_the_family(fake):
    mesh = fake_mesh((2, 4), ("a", "b"))
    fake.init_error = (nccl.family_key(mesh, "b"), 5)
    with pytest.raises(nccl.NcclError, match=r"axes=\('b',\) group 1 of 2.*fake failure"):
        nccl.setup(mesh)
    assert (nccl.family_key(mesh, "b"), True) in fake.destroys
    assert nccl.lookup(mesh, "a") is not None  # completed before
    assert nccl.lookup(mesh, "b") is None and nccl.lookup(mesh, ("a", "b")) is None


def test_at_exit_aborts(fake):
    mesh = fake_mesh((8,), ("x",))
    nccl.setup(mesh)
    lifecycle._at_exit()
    assert fake.destroys == [(-1, True)] and fake.comms == {}
    assert nccl.lookup(mesh, "x") is None
    lifecycle._at_exit()  # nothing left: no call
    assert fake.destroys == [(-1, True)]


def test_atexit_registered_once(fake, monkeypatch):
    hooks = []
    monkeypatch.setattr(lifecycle, "_atexit_registered", False)
    monkeypatch.setattr(lifecycle.atexit, "register", hooks.append)
    nccl.setup(fake_mesh((8,), ("x",)))
    nccl.setup(fake_mesh((2, 4), ("a", "b")))
    assert hooks == [lifecycle._at_exit]


def test_teardown_all_with_abort(fake):
    nccl.setup(fake_mesh((8,), ("x",)))
    nccl.setup(fake_mesh((2, 4), ("a", "b")))
    assert nccl.teardown(abort=True) == 8 + 24
    assert fake.destroys == [(-1, True)] and nccl.communicators() == []


# ------------------------------------------------------------- loading


def test_library_candidates(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nvidia", types.ModuleType("nvidia"))
    wheel = types.ModuleType("nvidia.nccl")
    wheel.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "nvidia.nccl", wheel)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").touch()  # else the real wheel's file list is consulted
    assert nccl.library_candidates() == [str(tmp_path / "lib" / "libnccl.so.2"), ""]
    monkeypatch.setenv(nccl.LIBRARY_ENV, "/opt/nccl/libnccl.so.2")
    assert nccl.library_candidates() == ["/opt/nccl/libnccl.so.2", str(tmp_path / "lib" / "libnccl.so.2"), ""]


def test_load_tries_candidates_and_caches(fake, monkeypatch, caplog):
    monkeypatch.setattr(library, "library_candidates", lambda: ["/bad/libnccl.so.2", "/wheel/libnccl.so.2", ""])
    monkeypatch.setenv(nccl.LIBRARY_ENV, "/bad/libnccl.so.2")
    fake.fail_paths = {"/bad/libnccl.so.2"}
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        assert nccl.load() == 23203
    assert fake.load_calls == ["/bad/libnccl.so.2", "/wheel/libnccl.so.2"]
    assert "JAX_CGX_NCCL_LIBRARY=/bad/libnccl.so.2 did not load" in caplog.text
    assert nccl.load() == 23203 and len(fake.load_calls) == 2  # cached


def test_load_not_found(fake, monkeypatch):
    monkeypatch.setattr(library, "library_candidates", lambda: ["/x/libnccl.so.2", ""])
    fake.fail_paths = "all"
    with pytest.raises(nccl.NcclNotFoundError) as err:
        nccl.load()
    msg = str(err.value)
    assert "/x/libnccl.so.2: /x/libnccl.so.2: cannot open" in msg and "libnccl.so.2 (default search)" in msg
    assert "pip install 'jax_cgx[cuda]'" in msg and "JAX_CGX_NCCL_LIBRARY" in msg
    with pytest.raises(nccl.NcclNotFoundError):  # setup says the same
        nccl.setup(fake_mesh((8,), ("x",)))


def test_load_without_extension_or_nccl(monkeypatch):
    monkeypatch.setattr(library, "binding", lambda: None)
    with pytest.raises(nccl.NcclNotFoundError, match=r"lacks.*JAX_CGX_CUDA=ON pip install \."):
        nccl.load()
    monkeypatch.setattr(library, "binding", lambda: FakeNccl(compiled=False))
    with pytest.raises(nccl.NcclNotFoundError, match="built without NCCL.*nvidia-nccl-cu13.*NCCL_HOME"):
        nccl.load()
    assert nccl.communicators() == []
    assert issubclass(nccl.NcclNotFoundError, nccl.NcclError) and issubclass(nccl.NcclError, RuntimeError)


# ------------------------------------------------------------- choosing the nccl backend


def _choose(requested, platform, mesh, axes):
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return backends.choose(requested, backends.Reduction("compressed_psum", "psum", axes, 2), mesh, platform)


def test_choosing_the_nccl_backend(fake, monkeypatch, caplog):
    mesh = fake_mesh((2, 4), ("a", "b"))
    sel = _choose
    assert sel("xla", "cuda", mesh, "a") == ("xla", "requested")
    assert sel("xla", "cpu", mesh, "a") == ("xla", "requested")
    backend, reason = sel("auto", "cpu", mesh, "a")
    assert backend == "xla" and "nccl: platform is cpu" in reason
    with pytest.raises(nccl.NcclError, match="CUDA GPUs only.*'cpu'.*backend='auto'"):
        sel("nccl", "cpu", mesh, "a")
    with pytest.raises(ValueError, match="backend"):
        sel("mpi", "cuda", mesh, "a")

    # CUDA, no setup yet
    backend, reason = sel("auto", "cuda", mesh, "a")
    assert backend == "xla" and "call jax_cgx.nccl.setup(mesh)" in reason
    with pytest.raises(nccl.NcclError, match=r"no NCCL communicator for axes 'a'.*jax_cgx\.nccl\.setup\(mesh\)"):
        sel("nccl", "cuda", mesh, "a")

    nccl.setup(mesh, ["a", ("a", "b")])
    with caplog.at_level(logging.DEBUG, logger="jax_cgx"):
        backend, reason = sel("nccl", "cuda", mesh, "a")
    assert backend == "nccl" and "communicators set up for axes 'a'" in reason
    assert "backend nccl for axes ('a',)" in caplog.text
    # auto takes the communicators set up for the axes (level with xla on an H100 since one segment)
    backend, reason = sel("auto", "cuda", mesh, "a")
    assert backend == "nccl" and "communicators set up for axes 'a'" in reason
    # a backend passed over by auto says why, and warns once per axes
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="jax_cgx"):
        m.setattr(backends.get("nccl"), "passed_over_by_auto", "measured slower here")
        m.setattr(protocol, "_warned", set())
        caplog.clear()
        backend, reason = sel("auto", "cuda", mesh, "a")
        assert backend == "xla" and "nccl: connected, but passed over: measured slower here" in reason
        assert "runs the xla backend for axes 'a'" in caplog.text and "backend='nccl'" in caplog.text
    assert sel("nccl", "cuda", mesh, ("a", "b"))[0] == "nccl"
    assert sel("nccl", "cuda", mesh.abstract_mesh, ("a", "b"))[0] == "nccl"
    backend, reason = sel("auto", "cuda", mesh, "b")
    assert backend == "xla" and "not for axes ('b',)" in reason and "jax_cgx.nccl.setup" in reason
    with pytest.raises(nccl.NcclError, match=r"not for axes \('b',\).*jax_cgx\.nccl\.setup"):
        sel("nccl", "cuda", mesh, "b")
    other = fake_mesh((2, 4), ("a", "b"), [FakeDevice(i) for i in range(8)][::-1])
    assert nccl.lookup(other, "a") is None
    with pytest.raises(nccl.NcclError, match="no communicators for this mesh"):
        sel("nccl", "cuda", other, "a")

    assert nccl.lookup(None, "a") is None
    with pytest.raises(nccl.NcclError, match="not inside shard_map"):
        sel("nccl", "cuda", None, "a")

    # Two meshes of one shape: an abstract mesh cannot choose.
    nccl.setup(other, "a")
    assert nccl.lookup(mesh.abstract_mesh, "a") is None
    backend, reason = sel("auto", "cuda", mesh.abstract_mesh, "a")
    assert backend == "xla" and "cannot tell them apart" in reason
    assert sel("nccl", "cuda", mesh, "a")[0] == "nccl"  # a concrete one can

    # A device's platform is "gpu" (what a trace sees on the mesh's devices), its lowering "cuda".
    from jax._src import xla_bridge

    with monkeypatch.context() as m:
        m.setattr(xla_bridge, "backends", lambda: {"cuda": None, "cpu": None})
        assert sel("nccl", "gpu", mesh, "a")[0] == "nccl"
        m.setattr(xla_bridge, "backends", lambda: {"rocm": None, "cpu": None})
        with pytest.raises(nccl.NcclError, match="CUDA GPUs only.*'rocm'"):
            sel("nccl", "gpu", mesh, "a")

    # Error feedback's residuals: the xla backend's alone.
    residual = backends.Reduction("compressed_psum", "psum", ("a",), 2, residual=True)
    backend, reason = backends.choose("auto", residual, mesh, "cuda")
    assert backend == "xla" and "residuals are computed by the xla backend only" in reason  # not merely passed over
    with pytest.raises(NotImplementedError, match=r"compressed_psum\(return_residual=True\).*xla backend only"):
        backends.choose("nccl", residual, mesh, "cuda")

    # An extension without NCCL, or none at all.
    fake.compiled = False
    backend, reason = sel("auto", "cuda", mesh, "a")
    assert backend == "xla" and "nccl: jax_cgx's CUDA extension has no NCCL support" in reason
    with pytest.raises(nccl.NcclNotFoundError, match="built without NCCL"):
        sel("nccl", "cuda", mesh, "a")
    monkeypatch.setattr(library, "binding", lambda: None)
    assert sel("auto", "cuda", mesh, "a")[0] == "xla"
    with pytest.raises(nccl.NcclNotFoundError, match="JAX_CGX_CUDA=ON"):
        sel("nccl", "cuda", mesh, "a")


# ------------------------------------------------------------- unique-id exchange in one process


class FakeKV:
    def __init__(self):
        self.store = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.store
        self.store[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_in_ms} ms")
        return self.store[key]


def _as_process(monkeypatch, index, count, kv):
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(jax, "process_count", lambda: count)
    monkeypatch.setattr(unique_ids, "_kv_client", lambda: kv)


def test_kv_exchange_in_one_process(monkeypatch):
    """Two 'processes' played in turn against one fake key-value store."""
    kv = FakeKV()
    devices = [FakeDevice(i, process_index=i // 2, local_hardware_id=i % 2) for i in range(4)]
    mesh = fake_mesh((2, 2), ("p", "l"), devices)
    fakes = [FakeNccl(uid_prefix=b"p0"), FakeNccl(uid_prefix=b"p1")]

    # Process 1 first: process 0 has published nothing yet.
    monkeypatch.setattr(library, "binding", lambda: fakes[1])
    _as_process(monkeypatch, 1, 2, kv)
    monkeypatch.setenv(nccl.TIMEOUT_ENV, "0.25")
    with pytest.raises(nccl.NcclError, match=r"timed out after 0.25 s waiting for process 0 .*axes=\('p',\) "
                                             r"group 0 of 2.*same mesh and axes.*JAX_CGX_NCCL_TIMEOUT_S"):
        nccl.setup(mesh)

    _as_process(monkeypatch, 0, 2, kv)
    monkeypatch.setattr(library, "binding", lambda: fakes[0])
    nccl.setup(mesh)
    assert len(kv.store) == 2 + 1  # groups of 'p' (2) and of ('p', 'l') (1) span processes; 'l' ones do not
    assert all(k.startswith("jax_cgx/nccl/uid/") and "/0/" in k for k in kv.store)

    registry.connected.reset()  # a fresh process
    _as_process(monkeypatch, 1, 2, kv)
    monkeypatch.setattr(library, "binding", lambda: fakes[1])
    nccl.setup(mesh)
    by_group = [{c["description"]: c for c in f.inits} for f in fakes]
    shared = set(by_group[0]) & set(by_group[1])
    assert len(shared) == 3
    for desc in shared:
        assert by_group[0][desc]["uid"] == by_group[1][desc]["uid"]
        assert by_group[0][desc]["uid"].startswith(b"p0")
    local = set(by_group[1]) - shared
    assert [by_group[1][d]["uid"][:2] for d in local] == [b"p1"]


def test_exchange_needs_a_method(fake, monkeypatch):
    devices = [FakeDevice(i, process_index=i // 2, local_hardware_id=i % 2) for i in range(4)]
    mesh = fake_mesh((4,), ("x",), devices)
    _as_process(monkeypatch, 0, 2, None)
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(nccl.NcclError, match=r"jax_cgx\.distributed\.initialize\(\) first"):
        nccl.setup(mesh)
    with pytest.raises(nccl.NcclError, match="needs jax.distributed"):
        nccl.setup(mesh, id_exchange="kv")


# ------------------------------------------------------------- two real processes


@pytest.mark.multiprocess
def test_two_processes_exchange_ids(tmp_path):
    nproc = 2
    for returncode, log in run_all(worker_commands(WORKER, nproc, tmp_path), timeout=240):
        assert returncode == 0, log[-4000:]
    results = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(nproc)]

    assert results[0]["groups"] == results[1]["groups"] and results[0]["keys"] == results[1]["keys"]
    key_names = {v: k for k, v in results[0]["keys"].items()}
    assert len(key_names) == 5
    for pid, res in enumerate(results):
        devices = {d[0]: d for d in res["devices"]}  # id -> (id, process, ordinal) as this process sees them
        inits = [i for i in res["inits"] if i["step"] == "first"]
        # mesh: p (2 groups), l (1 local group), p+l (1); flipped: p+l (1), p (2)
        assert len(inits) == 2 + 1 + 1 + 1 + 2, (pid, inits)
        for call in res["inits"]:
            mesh_axes = key_names[call["key"]]
            group = next(g for g in res["groups"][mesh_axes] if str(g) in call["description"])
            assert call["world"] == len(group)
            assert call["members"] == [[devices[d][2], r] for r, d in enumerate(group) if devices[d][1] == pid]
            root = devices[group[0]][1]
            assert bytes.fromhex(call["uid"]).startswith(f"p{root}".encode()), (mesh_axes, group, root)
        assert res["destroyed"] == 2 + 2 + 2 + 2 + 2  # this process's comms, 5 families x 2 devices
    for step in ("first", "again"):
        calls = [{(i["key"], i["description"]): i["uid"] for i in r["inits"] if i["step"] == step} for r in results]
        shared = set(calls[0]) & set(calls[1])
        assert shared and all(calls[0][k] == calls[1][k] for k in shared), step
    first = {i["description"]: i["uid"] for i in results[1]["inits"] if i["step"] == "first"}
    again = {i["description"]: i["uid"] for i in results[1]["inits"] if i["step"] == "again"}
    assert again and all(again[d] != first[d] for d in again)  # fresh ids after teardown
    err = results[1]["timeout_error"]
    assert err and "timed out after 1.5 s waiting for process 0" in err and "axes=('x',) group 0 of 1" in err


class FakeComm:
    """MPI.COMM_WORLD of one 'process': allgather answers with what `others` says."""

    def __init__(self, size, others):
        self.size, self.others, self.sent = size, others, []

    def Get_size(self):
        return self.size

    def allgather(self, obj):
        self.sent.append(obj)
        return self.others(obj)


def _fake_mpi(monkeypatch, comm):
    mpi4py = types.ModuleType("mpi4py")
    mpi4py.MPI = types.SimpleNamespace(COMM_WORLD=comm)
    monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi4py.MPI)


def test_mpi_exchange_in_one_process(monkeypatch):
    devices = [FakeDevice(i, process_index=i // 2, local_hardware_id=i % 2) for i in range(4)]
    mesh = fake_mesh((2, 2), ("p", "l"), devices)
    fakes = [FakeNccl(uid_prefix=b"p0"), FakeNccl(uid_prefix=b"p1")]
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # "auto" picks mpi under mpirun without jax.distributed

    comm0 = FakeComm(2, lambda obj: [obj, (1, {})])
    _fake_mpi(monkeypatch, comm0)
    _as_process(monkeypatch, 0, 2, None)
    monkeypatch.setattr(library, "binding", lambda: fakes[0])
    nccl.setup(mesh)
    assert len(comm0.sent) == 1  # one collective for every group

    registry.connected.reset()  # a fresh process
    comm1 = FakeComm(2, lambda obj: [comm0.sent[0], obj])
    _fake_mpi(monkeypatch, comm1)
    _as_process(monkeypatch, 1, 2, None)
    monkeypatch.setattr(library, "binding", lambda: fakes[1])
    nccl.setup(mesh, id_exchange="mpi")
    by_group = [{c["description"]: c["uid"] for c in f.inits} for f in fakes]
    shared = set(by_group[0]) & set(by_group[1])
    assert len(shared) == 3 and all(by_group[0][d] == by_group[1][d] for d in shared)

    # jax process indices that are not the MPI ranks, and a world of another size
    registry.connected.reset()
    _fake_mpi(monkeypatch, FakeComm(2, lambda obj: [obj, (0, {})]))
    with pytest.raises(nccl.NcclError, match=r"MPI ranks 0..1 are jax processes \[1, 0\]"):
        nccl.setup(mesh)
    _fake_mpi(monkeypatch, FakeComm(4, lambda obj: [obj]))
    with pytest.raises(nccl.NcclError, match="COMM_WORLD has 4 ranks but jax has 2 processes"):
        nccl.setup(mesh)


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (Debian: openmpi-bin; .ci/run installs it)")
def test_mpi_exchange_under_mpirun(tmp_path):
    """The ids of every group spanning both processes travel by a real MPI allgather (mpi4py, the
    `test` extra) under `mpirun -np 2`; the key-value store is disabled in the workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_CGX_", "XLA_FLAGS"))}
    run = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
         str(SUPPORT / "mpi_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(2)]
    uids = []
    for pid, res in enumerate(results):
        assert (res["rank"], res["size"], res["launcher"], res["jax"]) == (pid, 2, "openmpi", [pid, 2])
        process_of = {d: p for d, p, _ in res["devices"]}
        # mesh: p (2 groups), l (this process's own), p+l; flipped: p+l, p (2 groups)
        assert len(res["inits"]) == 2 + 1 + 1 + 1 + 2, res["inits"]
        for call in res["inits"]:
            first = int(re.search(r"devices \[(\d+)", call["description"])[1])
            assert bytes.fromhex(call["uid"]).startswith(f"p{process_of[first]}".encode()), call["description"]
        assert res["destroyed"] == 1 + 1 + 2 + 2 + 2 + 1 + 1  # one communicator per device of this process
        uids.append({call["description"]: call["uid"] for call in res["inits"]})
    shared = set(uids[0]) & set(uids[1])
    assert len(shared) == 6 and all(uids[0][d] == uids[1][d] for d in shared), (uids, shared)
    assert any(uids[0][d].startswith(b"p1".hex()) for d in shared), "the flipped mesh's ids come from process 1"


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 0.0, 1e300])
def test_nccl_timeouts_are_checked_as_tcps_are(value, monkeypatch):
    from jax_cgx._src.nccl import unique_ids

    with pytest.raises(ValueError, match="jax_cgx.nccl: the timeout must be > 0 and at most 1e\\+09 seconds"):
        unique_ids.timeout(value)
    monkeypatch.setenv("JAX_CGX_NCCL_TIMEOUT_S", str(value))
    with pytest.raises(ValueError, match="the timeout must be > 0"):
        unique_ids.timeout(None)
