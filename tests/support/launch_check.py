"""A compressed_psum check for the launch tests: run under jax_cgx.launch or mpirun.

    python tests/support/launch_check.py OUT_DIR [--fail-rank R] [--hang-rank R] [--exit R:STATUS:HOW:WHEN ...]
                                 [--catch-exit-rank R] [--linger-rank R] [--ignore-term-rank R]
                                 [--spawn-child]
                                 [--coordinator HOST:PORT --num-processes N --process-id I]

--hang-rank: every process sleeps (until stopped) once its rank has run its --exit /
--fail-rank. --exit: rank R exits with STATUS (an integer, or a message: status 1) through
HOW (sys.exit, exit: the builtin, raise: a ``raise SystemExit`` statement, held: a sys.exit
looked up before initialize, its SystemExit kept in a reference cycle as absl's app.run
does, hook: an uncaught RuntimeError under a sys.excepthook replaced after initialize, as
rich.traceback.install() does; STATUS is then ignored: 1, interrupt: an uncaught
KeyboardInterrupt, status 130 as Python gives Ctrl-C), WHEN (start: right after
initialize, end: after the psum, instead of jax.distributed.shutdown()).
--catch-exit-rank: that rank calls sys.exit(3), catches the SystemExit, keeps it and carries on.
--linger-rank: that rank sleeps 2 s after the psum. --ignore-term-rank: that rank ignores
SIGTERM; the others then end at once on SIGTERM (jax's own handler only logs it).
--spawn-child: every process starts a `sleep 600` grandchild in its process group.

Writes, in OUT_DIR: pid<rank> (first thing, for the no-leak checks), child<rank> (the
grandchild's pid), result<rank>.npy, exit<rank> (time.time() just before an --exit),
done<rank> (time.time() when the work is done), hook<rank> (written by an exit hook the program
registers before initialize(), as a logger or checkpoint writer would: it must run however the
process ends) and end<rank> (time.time() in the last exit hook, which runs after jax's shutdown:
absent if the process skipped it).
"""

import argparse
import atexit
import os
import pathlib
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("out_dir")
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--hang-rank", type=int, default=None)
p.add_argument("--exit", action="append", default=[], metavar="R:STATUS:HOW:WHEN")
p.add_argument("--catch-exit-rank", type=int, default=None)
p.add_argument("--linger-rank", type=int, default=None)
p.add_argument("--ignore-term-rank", type=int, default=None)
p.add_argument("--spawn-child", action="store_true")
p.add_argument("--coordinator", default=None)
p.add_argument("--num-processes", type=int, default=None)
p.add_argument("--process-id", type=int, default=None)
args = p.parse_args()
out = pathlib.Path(args.out_dir)
exits = {}
for spec in args.exit:
    r, status, how, when = spec.split(":")
    assert how in ("sys.exit", "exit", "raise", "held", "hook", "interrupt") and when in ("start", "end"), spec
    exits[int(r)] = (int(status) if status.lstrip("-").isdigit() else status, how, when)

def publish(name: str, text: str) -> None:
    """Write out/name whole or not at all: the test polls these files and reads a pid from each it
    finds, so one seen between its creation and its write would read empty (CI saw it once)."""
    part = out / f".{name}.part"
    part.write_text(text)
    os.replace(part, out / name)


# Registered before jax is imported, so it runs after jax's exit hook (atexit is last in, first out).
_rank = []
atexit.register(lambda: _rank and publish(f"end{_rank[0]}", repr(time.time())))

early_exit = sys.exit  # looked up before jax_cgx replaces it, as absl's sys.exit(main(argv)) does

import jax_cgx.distributed  # noqa: E402  (imports jax)

_rank.append(args.process_id if args.process_id is not None else jax_cgx.distributed.detect().process_index)
publish(f"pid{_rank[0]}", str(os.getpid()))
atexit.register(lambda: publish(f"hook{_rank[0]}", repr(time.time())))  # the program's own hook
# First, before anything touches a device; explicit arguments (if any) win over the environment.
info = jax_cgx.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402


def leave(rank: int) -> None:
    status, how, _ = exits[rank]
    publish(f"exit{rank}", repr(time.time()))
    if how == "sys.exit":
        sys.exit(status)
    elif how == "exit":
        exit(status)  # noqa: PLR1722 - the builtin on purpose
    elif how == "held":
        try:
            early_exit(status)
        except BaseException:
            exc = sys.exc_info()[1]  # noqa: F841 - the frame, its traceback and exc: a cycle
            raise
    elif how == "hook":
        sys.excepthook = lambda kind, value, tb: print(f"another hook: {kind.__name__}: {value}", file=sys.stderr)
        raise RuntimeError(f"rank {rank} failing under another excepthook")
    elif how == "interrupt":
        raise KeyboardInterrupt
    else:
        raise SystemExit(status)


def main() -> None:
    rank = info.process_index
    if args.spawn_child:
        publish(f"child{rank}", str(subprocess.Popen(["sleep", "600"]).pid))
    if args.ignore_term_rank is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term_rank == rank else signal.SIG_DFL)
    if rank in exits and exits[rank][2] == "start":
        leave(rank)
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} failing on purpose")
    if args.hang_rank is not None:
        time.sleep(600)  # stopped by the launcher (the failing rank, --timeout) or a signal

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    xs = np.random.default_rng(0).standard_normal((len(devices), 777)).astype(np.float32)
    x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("d")), lambda idx: xs[idx])
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config)[None], mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
    y = f(x)
    local = np.stack([np.asarray(s.data)[0] for s in y.addressable_shards])
    np.save(out / f"result{rank}.npy", local)
    print(f"rank {rank} of {info.process_count} ({info.source}): {len(devices)} devices, ok", flush=True)
    if args.linger_rank == rank:
        time.sleep(2)
    publish(f"done{rank}", repr(time.time()))
    if rank in exits:
        leave(rank)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if args.catch_exit_rank == info.process_index:
        try:
            sys.exit(3)
        except SystemExit as e:
            kept = e  # alive to the end, caught in the outermost frame: it must not become the status
    main()
