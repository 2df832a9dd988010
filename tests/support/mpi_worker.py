"""One process of an ``mpirun -np N`` job: NCCL unique ids handed over by a real MPI allgather.

    mpirun -np 2 python tests/support/mpi_worker.py OUT_DIR

jax's runtime is started by jax_cgx.distributed.initialize() from Open MPI's environment (2 CPU
devices per process); the NCCL binding is nccl_worker's fake (no GPU needed: it makes unique ids
that start with b"p<process>" and records every nccl_init) and the devices are FakeDevice GPUs on
the processes' real layout. ``nccl.setup(..., id_exchange="mpi")`` then exchanges the ids through
mpi4py's ``MPI.COMM_WORLD.allgather`` (the key-value store is disabled, so nothing else can carry
them). The worker writes what it saw to OUT_DIR/process<rank>.json.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(out_dir: str) -> None:
    import jax
    from mpi4py import MPI
    from nccl_worker import FakeDevice, FakeNccl, fake_mesh

    from jax_cgx import distributed, nccl
    from jax_cgx._src.nccl import library, unique_ids

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    info = distributed.initialize()
    out = {"rank": rank, "size": size, "launcher": info.source,
           "jax": [jax.process_index(), jax.process_count()], "inits": []}

    def no_kv(*args, **kwargs):
        raise AssertionError("the key-value store was used, not MPI")

    unique_ids._exchange_kv = no_kv
    fake = FakeNccl(uid_prefix=f"p{rank}".encode())
    library.binding = lambda: fake
    devices = [FakeDevice(d.id, d.process_index, d.local_hardware_id) for d in jax.devices()]
    world = len(devices)
    mesh = fake_mesh((size, world // size), ("p", "l"), devices)  # every group rooted on process 0
    flipped = fake_mesh((size, world // size), ("p", "l"), devices[::-1])  # on the last process
    nccl.setup(mesh, id_exchange="mpi")
    nccl.setup(flipped, [("p", "l"), "p"], id_exchange="mpi")
    out["devices"] = [[d.id, d.process_index, d.local_hardware_id] for d in devices]
    out["inits"] = [dict(i, uid=i["uid"].hex()) for i in fake.inits]
    out["destroyed"] = nccl.teardown()
    with open(os.path.join(out_dir, f"process{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
