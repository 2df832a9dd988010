"""compressed_psum against lax.psum over all local devices, measured side by side.

Every row times both reductions of the same float32 buffer (one per device) in the
same process, blocking on each call (many in-flight collectives on virtual CPU
devices can deadlock XLA's rendezvous). ``wire MiB`` is what one device sends: a
bandwidth-optimal all-reduce moves ``2(W-1)/W`` of the buffer; SRA moves ``W-1`` packed
chunks out and ``W-1`` back (jax_cgx.allreduce.bytes_on_wire). On simulated CPU
devices there is no wire, so the time shows the cost of the codec, not the benefit of
moving fewer bytes; docs/results.md says which is which.

``--backends`` compares jax_cgx's backends (``xla``: XLA collectives; ``nccl``: one
custom call on jax_cgx's NCCL communicators, GPU only). Under a launcher
(``python -m jax_cgx.launch -n 4 benchmarks/allreduce.py ...``, mpirun, srun) every
process runs it and process 0 prints; ``--share-gpu`` lets all ranks use GPU 0 of
one machine, each as its own NCCL "host" (ARCHITECTURE.md §5), which is how the
nccl backend is measured on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx.allreduce import bytes_on_wire
from jax_cgx.bench._memory import reuse_large_allocations
from jax_cgx.bench._table import print_table, save


def _median_time(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _share_one_gpu(process_id: int, count: int) -> None:
    """Environment for `count` ranks on GPU 0: one NCCL host id each, sockets on lo, memory split."""
    os.environ.setdefault("NCCL_HOSTID", f"jax-cgx-rank-{process_id}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.85 / max(count, 1):.3f}")


def run(args: argparse.Namespace) -> list[dict]:
    if args.share_gpu:
        info = jax_cgx.distributed.detect()
        _share_one_gpu(info.process_index, info.process_count)
        jax_cgx.distributed.initialize(local_device_ids=[0])
    else:
        jax_cgx.distributed.initialize()
    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    sharding = NamedSharding(mesh, P("d"))
    backends = args.backends or (["xla", "nccl"] if devices[0].platform == "gpu" and world > 1 else ["xla"])
    if "nccl" in backends:
        jax_cgx.nccl.setup(mesh)

    def reducer(reduce):
        body = lambda v: reduce(v[0])[None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def local(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data)[0]

    psum = reducer(lambda v: jax.lax.psum(v, "d"))
    records = []
    for mib in args.sizes_mib:
        n = int(mib * 2**20) // 4
        x = jax.make_array_from_callback(
            (world, n), sharding, lambda idx: np.random.default_rng(idx[0].start or 0).standard_normal(
                (1, n), dtype=np.float32)
        )
        t_psum = _median_time(psum, x, args.repeats)
        exact = local(psum(x))
        wire_psum = bytes_on_wire(jax.ShapeDtypeStruct((n,), jnp.float32), world, jax_cgx.CompressionConfig(bits=32))
        for bits, backend in itertools.product(args.bits, backends):
            config = jax_cgx.CompressionConfig(
                bits=bits, bucket_size=args.bucket_size, fusion_buffer_mb=1024, backend=backend,
                algorithm=args.algorithm,
            )
            compressed = reducer(lambda v, c=config: jax_cgx.compressed_psum(v, "d", c, impl=args.impl))
            t = _median_time(compressed, x, args.repeats)
            err = float(np.max(np.abs(local(compressed(x)) - exact)))
            records.append(
                dict(
                    devices=world,
                    platform=devices[0].platform,
                    backend=backend,
                    algorithm=args.algorithm,
                    size_mib=mib,
                    count=n,
                    bits=bits,
                    bucket_size=args.bucket_size,
                    psum_ms=t_psum * 1e3,
                    compressed_ms=t * 1e3,
                    speedup=t_psum / t,
                    psum_wire_mib=wire_psum / 2**20,
                    compressed_wire_mib=bytes_on_wire(jax.ShapeDtypeStruct((n,), jnp.float32), world, config) / 2**20,
                    max_abs_error=err,
                    max_abs_sum=float(np.max(np.abs(exact))),
                )
            )
    if "nccl" in backends:
        jax_cgx.nccl.teardown()
    return records


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64], help="float32 MiB per device")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--impl", default="auto", choices=["kernel", "reference", "auto"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backends", nargs="+", choices=["xla", "nccl"],
                   help="jax_cgx backends to time (default: xla, plus nccl on GPUs)")
    p.add_argument("--algorithm", default="sra", choices=["sra", "ring"])
    p.add_argument("--share-gpu", action="store_true",
                   help="all ranks on GPU 0 of this machine (one NCCL host id per process)")
    p.add_argument("--output", help="also write the results to this .json or .csv file")


def main(args: argparse.Namespace) -> None:
    reuse_large_allocations()
    records = run(args)
    if jax.process_index() != 0:
        return
    rows = [
        [
            f"{r['size_mib']:g}",
            f"{r['count']:,}",
            str(r["bits"]),
            r["backend"],
            f"{r['psum_ms']:.2f}",
            f"{r['compressed_ms']:.2f}",
            f"{r['speedup']:.2f}",
            f"{r['psum_wire_mib']:.2f}",
            f"{r['compressed_wire_mib']:.2f}",
            f"{r['psum_wire_mib'] / r['compressed_wire_mib']:.2f}",
            f"{r['max_abs_error']:.3g}",
        ]
        for r in records
    ]
    title = f"compressed_psum vs psum, {records[0]['devices']} x {records[0]['platform']} devices, bucket {args.bucket_size}"
    columns = ["MiB", "count", "bits", "backend", "psum ms", "cgx ms", "speedup", "psum wire MiB", "cgx wire MiB",
               "fewer bytes", "max |err|"]
    print_table(title, columns, rows)
    if args.output:
        save(records, args.output)
