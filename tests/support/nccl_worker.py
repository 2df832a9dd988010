"""Fakes of the NCCL binding and of GPU devices, and one process of the multi-process
NCCL setup test (tests/nccl/test_nccl_setup.py).

    python tests/support/nccl_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Each process has 2 CPU devices, dressed up as GPUs (FakeDevice); the fake binding makes
unique ids that start with b"p<process>" and records every nccl_init. The worker writes
what it saw to OUT_DIR/process<ID>.json.
"""

import itertools
import json
import os
import sys

if __name__ == "__main__":
    # Only as a worker: tests import the fakes from here, and must keep their 8 devices.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import numpy as np  # noqa: E402


class FakeDevice:
    """Enough of a jax.Device for jax.sharding.Mesh and jax_cgx.nccl."""

    def __init__(self, id, process_index=0, local_hardware_id=None, platform="gpu"):
        self.id = id
        self.process_index = process_index
        self.local_hardware_id = id if local_hardware_id is None else local_hardware_id
        self.platform = platform
        self.device_kind = "fake gpu"

    def __repr__(self):
        return f"FakeDevice(id={self.id}, process={self.process_index}, ordinal={self.local_hardware_id})"


def fake_mesh(shape, names, devices=None):
    import jax

    if devices is None:
        devices = [FakeDevice(i) for i in range(int(np.prod(shape)))]
    return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), names)


class FakeNccl:
    """The six functions of jax_cgx._cuda's NCCL binding, recording what they are asked."""

    def __init__(self, compiled=True, version=23203, fail_paths=None, uid_prefix=b"", init_error=None):
        self.compiled = compiled
        self.version = version
        self.fail_paths = fail_paths  # None: every path loads; a set: those fail; "all": all fail
        self.uid_prefix = uid_prefix
        self.init_error = init_error  # (key, ordinal) whose init raises
        self.load_calls = []
        self.uid_calls = 0
        self.inits = []  # dict(key, world, uid, members, description)
        self.destroys = []  # (key, abort)
        self.comms = {}  # (key, ordinal) -> (rank, world, description)
        self._counter = itertools.count()

    def nccl_compiled(self):
        return self.compiled

    def nccl_load(self, path):
        assert isinstance(path, str)
        self.load_calls.append(path)
        if self.fail_paths == "all" or (self.fail_paths and path in self.fail_paths):
            raise RuntimeError(f"{path or 'libnccl.so.2'}: cannot open shared object file: No such file or directory")
        return self.version

    def nccl_unique_id(self):
        assert self.load_calls, "nccl_unique_id before nccl_load"
        self.uid_calls += 1
        body = os.urandom(16) + next(self._counter).to_bytes(8, "little")
        return (self.uid_prefix + body).ljust(128, b"\0")

    def nccl_init(self, key, world, uid, members, description):
        assert isinstance(key, int) and 0 <= key < 2**63
        assert isinstance(uid, bytes) and len(uid) == 128
        assert isinstance(members, list) and members and all(isinstance(m, tuple) for m in members)
        self.inits.append(dict(key=key, world=world, uid=uid, members=list(members), description=description))
        for ordinal, rank in members:
            assert 0 <= rank < world
            if (key, ordinal) in self.comms:
                raise RuntimeError(f"communicator ({key}, {ordinal}) already registered")
            if self.init_error == (key, ordinal):
                raise RuntimeError("ncclInvalidUsage: fake failure")
            self.comms[key, ordinal] = (rank, world, description)

    def nccl_destroy(self, key, abort):
        self.destroys.append((key, abort))
        gone = [k for k in self.comms if key == -1 or k[0] == key]
        for k in gone:
            del self.comms[k]
        return len(gone)

    def nccl_communicators(self):
        return [(k, o, r, w, d) for (k, o), (r, w, d) in sorted(self.comms.items())]


def _record(fake, mark):
    return [dict(i, uid=i["uid"].hex(), step=mark) for i in fake.inits]


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

    from jax._src import distributed

    from jax_cgx import nccl
    from jax_cgx._src.nccl import library

    fake = FakeNccl(uid_prefix=f"p{pid}".encode())
    library.binding = lambda: fake
    devices = [FakeDevice(d.id, d.process_index, d.local_hardware_id) for d in jax.devices()]
    world = len(devices)
    mesh = fake_mesh((nproc, world // nproc), ("p", "l"), devices)  # rank 0 of every group on process 0
    flipped = fake_mesh((nproc, world // nproc), ("p", "l"), devices[::-1])  # on the last process
    out = {"devices": [[d.id, d.process_index, d.local_hardware_id] for d in devices], "inits": []}

    out["families"] = {str(k): v for k, v in nccl.setup(mesh).families.items()}
    nccl.setup(flipped, [("p", "l"), "p"])
    nccl.setup(mesh)  # idempotent: nothing new
    out["groups"] = {
        f"{name}/{'+'.join(axes)}": [[d.id for d in g] for g in nccl.groups(m, axes)]
        for name, m in (("mesh", mesh), ("flipped", flipped))
        for axes in (("p",), ("l",), ("p", "l"), ("l", "p"))
    }
    out["inits"] += _record(fake, "first")
    out["keys"] = {f"mesh/{'+'.join(a)}": nccl.family_key(mesh, a) for a in (("p",), ("l",), ("p", "l"))}
    out["keys"].update({f"flipped/{'+'.join(a)}": nccl.family_key(flipped, a) for a in (("p", "l"), ("p",))})

    # Teardown, then set up again: new ids under a new generation of key-value keys.
    out["destroyed"] = nccl.teardown()
    fake.inits.clear()
    nccl.setup(mesh, ["p"])
    out["inits"] += _record(fake, "again")

    # The timeout: only the last process sets up a new mesh whose groups process 0 roots.
    client = distributed.global_state.client
    if pid == nproc - 1:
        other = fake_mesh((world,), ("x",), devices)
        try:
            nccl.setup(other, timeout_s=1.5)
            out["timeout_error"] = None
        except nccl.NcclError as err:
            out["timeout_error"] = str(err)
        client.key_value_set("nccl_worker/done", "1")
    else:
        client.blocking_key_value_get("nccl_worker/done", 120_000)

    nccl.teardown()
    with open(os.path.join(out_dir, f"process{pid}.json"), "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
