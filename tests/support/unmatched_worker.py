"""Processes that run different numbers of compressed collectives (tests/runtime/test_unmatched.py).

    python -m jax_cgx.launch -n 2 tests/support/unmatched_worker.py OUT_DIR --steps R:N ... [--alone R:WHAT:SECONDS]

Each process runs a compressed_pmean step N times (3 unless ``--steps`` says otherwise for its
rank), reading every result, then writes ``done<rank>``. ``--alone R:WHAT:SECONDS``: rank R then
works on by itself for SECONDS, after its peers finished: ``sleep`` (one long time.sleep) or
``jax`` (small jitted computations on its own devices, one after another): neither is a collective
nobody joins, so neither may be ended. ``--fail-rank R``: rank R raises after its steps.
"""

import argparse
import os
import pathlib
import time

import jax_cgx

p = argparse.ArgumentParser()
p.add_argument("out_dir", type=pathlib.Path)
p.add_argument("--steps", nargs="*", default=[])
p.add_argument("--alone", default=None)
p.add_argument("--fail-rank", type=int, default=None)
args = p.parse_args()

# UNMATCHED_SHUTDOWN_TIMEOUT_S: jax's shutdown timeout (300 s), shorter for the test with the watch off.
info = jax_cgx.distributed.initialize(shutdown_timeout_seconds=int(os.environ.get("UNMATCHED_SHUTDOWN_TIMEOUT_S", 300)))
import jax  # noqa: E402 - after initialize, as a user's script does
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rank = info.process_index
steps = dict(map(int, s.split(":")) for s in args.steps).get(rank, 3)
mesh = jax.make_mesh((jax.device_count(),), ("d",))
config = jax_cgx.CompressionConfig(bits=4, min_size=16)
step = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_pmean(v, "d", config), mesh=mesh, in_specs=P("d"),
                             out_specs=P("d")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                           np.ones((jax.local_device_count(), 4096), np.float32))
for _ in range(steps):
    x = step(x)
    float(np.asarray(x.addressable_shards[0].data).sum())
(args.out_dir / f"done{rank}").write_text(str(time.time()))
if rank == args.fail_rank:
    raise RuntimeError(f"process {rank} fails after its steps")

if args.alone:
    who, what, seconds = args.alone.split(":")
    if int(who) == rank:
        if what == "sleep":
            time.sleep(float(seconds))
        else:
            local = jax.jit(lambda a: (a @ a.T).sum())
            y = np.ones((64, 64), np.float32)
            deadline = time.monotonic() + float(seconds)
            while time.monotonic() < deadline:
                float(local(y))
                time.sleep(0.01)
        (args.out_dir / f"alone{rank}").write_text(str(time.time()))
