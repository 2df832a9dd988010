"""compressed_psum against lax.psum over all devices, measured side by side, nccl-tests style.

Sizes sweep like nccl-tests' all_reduce_perf: ``-b`` smallest and ``-e`` largest buffer in
bytes (per device; suffixes K, M, G), ``-f`` the factor between them (or ``--sizes-mib``
for an explicit list). For every size the table gives, per bits/bucket/backend: the time
of psum and of compressed_psum (median of ``--repeats`` blocking calls), ``algbw`` (bytes
of the uncompressed buffer / time) and ``busbw`` (``algbw * 2(W-1)/W``, nccl-tests'
all-reduce bus bandwidth, again from the uncompressed size, so that compressed and plain
rows compare directly), the speedup over psum measured in the same run, and the max
absolute error against psum.

Every row times both reductions of the same float32 buffer (one per device) in the
same process, blocking on each call (many in-flight collectives on virtual CPU
devices can deadlock XLA's rendezvous). ``wire MiB`` is what one device sends: a
bandwidth-optimal all-reduce moves ``2(W-1)/W`` of the buffer; SRA moves ``W-1`` packed
chunks out and ``W-1`` back (jax_cgx.collectives.bytes_on_wire). On simulated CPU
devices there is no wire, so the time shows the cost of the codec, not the benefit of
moving fewer bytes; docs/results.md says which is which.

``--backends`` compares jax_cgx's backends (``xla``: XLA collectives; ``nccl``: one
custom call on jax_cgx's NCCL communicators, GPU only; ``tcp``: one CPU custom call on
jax_cgx's TCP connections, the codec pipelined with the wire). Under a launcher
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
from jax_cgx.bench._table import print_table, save
from jax_cgx.collectives import bytes_on_wire


def median_time(fn, x, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` blocking calls ``fn(x)``, after ``warmup`` untimed ones (at least one)."""
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str) -> int:
    """'64M' -> 67108864 (nccl-tests' size syntax: K, M, G are powers of 1024)."""
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in _SUFFIXES else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1M, 256K, 1073741824)") from None
    return int(value * _SUFFIXES[unit])


def sizes_in_bytes(args: argparse.Namespace) -> list[int]:
    """The buffer sizes of the sweep, per device, in bytes."""
    if args.sizes_mib:
        return [int(m * 2**20) for m in args.sizes_mib]
    if args.minbytes > args.maxbytes or args.stepfactor <= 1:
        raise SystemExit("bench allreduce: need -b <= -e and -f > 1")
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size = int(size * args.stepfactor)
    return sizes


def share_one_gpu(process_id: int, count: int) -> None:
    """Environment for `count` ranks on GPU 0: one NCCL host id each, sockets on lo, memory split."""
    os.environ.setdefault("NCCL_HOSTID", f"jax-cgx-rank-{process_id}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.85 / max(count, 1):.3f}")


def _progress(total: int, enabled: bool):
    """A rich progress bar on process 0 (a no-op elsewhere or without rich)."""
    try:
        from rich.progress import Progress
    except ImportError:
        enabled = False
    if not enabled:
        class _Quiet:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def advance(self, description: str = "") -> None:
                pass

        return _Quiet()

    class _Bar:
        def __enter__(self):
            self.p = Progress(transient=True)
            self.p.__enter__()
            self.task = self.p.add_task("all-reduce", total=total)
            return self

        def __exit__(self, *exc):
            return self.p.__exit__(*exc)

        def advance(self, description: str = "") -> None:
            self.p.update(self.task, advance=1, description=description)

    return _Bar()


def run(args: argparse.Namespace) -> list[dict]:
    if args.share_gpu:
        info = jax_cgx.distributed.detect()
        share_one_gpu(info.process_index, info.process_count)
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
    if "tcp" in backends:
        jax_cgx.tcp.setup(mesh)
    dtype = jnp.dtype(args.dtype)
    bus = 2 * (world - 1) / world if world > 1 else 1.0

    def reducer(reduce):
        body = lambda v: reduce(v[0])[None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def local(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data, np.float32)[0]

    psum = reducer(lambda v: jax.lax.psum(v, "d"))
    sizes = sizes_in_bytes(args)
    combos = list(itertools.product(args.bits, args.bucket_sizes, backends))
    records = []
    with _progress(len(sizes) * (1 + len(combos)), jax.process_index() == 0 and args.progress) as bar:
        for size in sizes:
            n = max(size // dtype.itemsize, 1)
            x = jax.make_array_from_callback(
                (world, n), sharding,
                lambda idx: np.random.default_rng(idx[0].start or 0).standard_normal((1, n)).astype(dtype),
            )
            t_psum = median_time(psum, x, args.repeats, args.warmup)
            exact = local(psum(x))
            bar.advance(f"{size / 2**20:g} MiB psum")
            like = jax.ShapeDtypeStruct((n,), dtype)
            wire_psum = bytes_on_wire(like, world, jax_cgx.CompressionConfig(bits=32))
            for bits, bucket, backend in combos:
                config = jax_cgx.CompressionConfig(
                    bits=bits, bucket_size=bucket, fusion_buffer_mb=max(1024, 2 * size / 2**20), backend=backend,
                    algorithm=args.algorithm, min_size=0,
                )
                compressed = reducer(lambda v, c=config: jax_cgx.compressed_psum(v, "d", c, impl=args.impl))
                t = median_time(compressed, x, args.repeats, args.warmup)
                err = float(np.max(np.abs(local(compressed(x)) - exact)))
                nbytes = n * dtype.itemsize
                records.append(
                    dict(
                        devices=world, platform=devices[0].platform, backend=backend, algorithm=args.algorithm,
                        dtype=dtype.name, size_bytes=nbytes, size_mib=nbytes / 2**20, count=n, bits=bits,
                        bucket_size=bucket, psum_ms=t_psum * 1e3, compressed_ms=t * 1e3,
                        psum_algbw_gbs=nbytes / t_psum / 1e9, psum_busbw_gbs=nbytes / t_psum / 1e9 * bus,
                        algbw_gbs=nbytes / t / 1e9, busbw_gbs=nbytes / t / 1e9 * bus, speedup=t_psum / t,
                        psum_wire_mib=wire_psum / 2**20,
                        compressed_wire_mib=bytes_on_wire(like, world, config) / 2**20,
                        max_abs_error=err, max_abs_sum=float(np.max(np.abs(exact))),
                    )
                )
                bar.advance(f"{size / 2**20:g} MiB {bits} bits {backend}")
    if "nccl" in backends:
        jax_cgx.nccl.teardown()
    if "tcp" in backends:
        jax_cgx.tcp.teardown()
    return records


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=parse_bytes, default=parse_bytes("1M"),
                   help="smallest buffer per device (bytes; K/M/G suffixes), default 1M")
    p.add_argument("-e", "--maxbytes", type=parse_bytes, default=parse_bytes("64M"),
                   help="largest buffer per device, default 64M")
    p.add_argument("-f", "--stepfactor", type=float, default=4, help="factor between sizes, default 4")
    p.add_argument("--sizes-mib", type=float, nargs="+", help="explicit sizes in MiB (instead of -b/-e/-f)")
    p.add_argument("-d", "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--bucket-sizes", "--bucket-size", type=int, nargs="+", default=[512], dest="bucket_sizes")
    p.add_argument("--backends", nargs="+", choices=["xla", "nccl", "tcp"],
                   help="jax_cgx backends to time (default: xla, plus nccl on GPUs); nccl and tcp are set up "
                        "with jax_cgx.nccl.setup / jax_cgx.tcp.setup")
    p.add_argument("--algorithm", default="sra", choices=["sra", "ring"])
    p.add_argument("--impl", default="auto", choices=["kernel", "reference", "auto"])
    p.add_argument("-n", "--repeats", type=int, default=10, help="timed calls per point (median)")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed calls first")
    p.add_argument("--share-gpu", action="store_true",
                   help="all ranks on GPU 0 of this machine (one NCCL host id per process)")
    p.add_argument("--output", help="also write the results to this .json or .csv file")
    p.add_argument("--plot", help="write busbw and speedup against size to this PNG (needs matplotlib)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def plot(records: list[dict], path: str) -> None:
    """busbw (GB/s) and speedup over psum against buffer size, one line per bits/bucket/backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_sp) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted({r["size_bytes"] for r in records})
    psum = {r["size_bytes"]: r["psum_busbw_gbs"] for r in records}
    ax_bw.plot(sizes, [psum[s] for s in sizes], "k--", label="psum")
    for key in sorted({(r["bits"], r["bucket_size"], r["backend"]) for r in records}):
        rows = sorted((r for r in records if (r["bits"], r["bucket_size"], r["backend"]) == key),
                      key=lambda r: r["size_bytes"])
        label = f"{key[0]} bits, bucket {key[1]}, {key[2]}"
        ax_bw.plot([r["size_bytes"] for r in rows], [r["busbw_gbs"] for r in rows], marker="o", label=label)
        ax_sp.plot([r["size_bytes"] for r in rows], [r["speedup"] for r in rows], marker="o", label=label)
    ax_sp.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    r0 = records[0]
    for ax, ylabel in ((ax_bw, "busbw (GB/s, uncompressed bytes)"), (ax_sp, "speedup over psum")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer per device (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_bw.legend(fontsize=7)
    ax_sp.legend(fontsize=7)
    fig.suptitle(f"compressed_psum vs psum: {r0['devices']} x {r0['platform']}, {r0['dtype']}, {r0['algorithm']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    records = run(args)
    if jax.process_index() != 0:
        return
    rows = [
        [
            f"{r['size_bytes']:,}",
            f"{r['count']:,}",
            r["dtype"],
            str(r["bits"]),
            str(r["bucket_size"]),
            r["backend"],
            f"{r['psum_ms'] * 1e3:.0f}",
            f"{r['psum_busbw_gbs']:.2f}",
            f"{r['compressed_ms'] * 1e3:.0f}",
            f"{r['algbw_gbs']:.2f}",
            f"{r['busbw_gbs']:.2f}",
            f"{r['speedup']:.2f}",
            f"{r['psum_wire_mib'] / r['compressed_wire_mib']:.2f}",
            f"{r['max_abs_error']:.3g}",
        ]
        for r in records
    ]
    r0 = records[0]
    title = (f"compressed_psum vs psum: {r0['devices']} x {r0['platform']} devices, {r0['algorithm']} "
             "(algbw/busbw from the uncompressed size, nccl-tests convention)")
    columns = ["size (B)", "count", "type", "bits", "bucket", "backend", "psum us", "psum busbw",
               "cgx us", "algbw GB/s", "busbw GB/s", "speedup", "fewer bytes", "max |err|"]
    print_table(title, columns, rows)
    if args.output:
        save(records, args.output)
    if args.plot:
        plot(records, args.plot)
