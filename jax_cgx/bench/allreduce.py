"""compressed_psum against lax.psum over all devices, measured side by side, nccl-tests style;
with ``--ops`` also compressed_psum_scatter against lax.psum_scatter and compressed_all_gather
against lax.all_gather.

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
chunks out and ``W-1`` back (jax_cgx._src.collectives.bytes_on_wire). On simulated CPU
devices there is no wire, so the time shows the cost of the codec, not the benefit of
moving fewer bytes; docs/results.md says which is which.

``--ops psum psum_scatter all_gather``: the size is the larger side per device, as in
nccl-tests (a reduce-scatter's input, an all-gather's output; both ``tiled``), and busbw is
``algbw * (W-1)/W`` for these two. They run on the xla and nccl backends (tcp rows are
left out: the tcp backend runs all-reduces only).

``--backends`` compares jax_cgx's backends (``xla``: XLA collectives; ``nccl``: one
custom call on jax_cgx's NCCL communicators, GPU only; ``tcp``: one CPU custom call on
jax_cgx's TCP connections, the codec pipelined with the wire). Under a launcher
(``python -m jax_cgx.launch -n 4 benchmarks/allreduce.py ...``, mpirun, srun) every
process runs it and process 0 prints; ``--share-gpu`` lets all ranks use GPU 0 of
one machine, each as its own NCCL "host" (docs/nccl.md), which is how the
nccl backend is measured on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src.arguments import integer, number
from jax_cgx._src.collectives import bytes_on_wire
from jax_cgx._src.config.limits import QUANTIZED_BITS
from jax_cgx.bench._table import print_table, save


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
    size = int(value * _SUFFIXES[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte; give a size of at least 1")
    return size


def sizes_in_bytes(args: argparse.Namespace) -> list[int]:
    """The buffer sizes of the sweep, per device, in bytes."""
    if args.sizes_mib:
        return [int(m * 2**20) for m in args.sizes_mib]
    if args.minbytes > args.maxbytes or args.stepfactor <= 1:
        raise SystemExit("bench allreduce: need -b <= -e and -f > 1")
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size = max(size + 1, int(size * args.stepfactor))  # a factor near 1 must still move on
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
    algorithms = args.algorithm if isinstance(args.algorithm, list) else [args.algorithm]
    policies = args.policy if isinstance(args.policy, list) else [args.policy]
    if "auto" in policies and jax.process_index() == 0:
        # policy="auto"'s figures and decisions, as a user sees them with INFO logs.
        logging.basicConfig(format="%(message)s")
        logging.getLogger("jax_cgx").setLevel(logging.INFO)
    if args.two_level:
        # Nodes of JAX_CGX_LOCAL_COUNT processes (benchmarks/netem/run.py --nodes N --per-node M):
        # a ("node", "local") mesh, every reduction over both axes, flat or hierarchical.
        per_node = jax_cgx.distributed.detect().local_count * jax.local_device_count()
        if world % per_node:
            raise SystemExit(f"--two-level: {world} devices are not whole nodes of {per_node}")
        mesh = jax.make_mesh((world // per_node, per_node), ("node", "local"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=devices)
        axes = ("node", "local")
    else:
        mesh = jax.make_mesh((world,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
        axes = ("d",)
    axis = axes if len(axes) > 1 else axes[0]
    spec = P(axis)
    sharding = NamedSharding(mesh, spec)
    backends = args.backends or (["xla", "nccl"] if devices[0].platform == "gpu" and world > 1 else ["xla"])
    if "nccl" in backends:
        jax_cgx.nccl.setup(mesh)
    if "tcp" in backends:
        jax_cgx.tcp.setup(mesh)
    dtype = jnp.dtype(args.dtype)

    def reducer(reduce):
        body = lambda v: reduce(v[0])[None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    layouts = [False] if not args.two_level else [h == "hierarchical" for h in args.layouts]

    def local(out) -> np.ndarray:
        return np.asarray(out.addressable_shards[0].data, np.float32)[0]

    sizes = sizes_in_bytes(args)
    combos = [(op, *c) for op in args.ops
              for c in itertools.product(args.bits, args.bucket_sizes, backends, layouts, algorithms, policies)
              if (op == "psum" or c[2] != "tcp") and (op == "psum" or not c[3])
              # auto chooses the form over nodes itself: one row of it, not one per layout and algorithm
              and (c[5] == "always" or not args.two_level or (c[3] == layouts[0] and c[4] == algorithms[0]))]
    records = []
    with _progress(len(sizes) * (len(args.ops) + len(combos)), jax.process_index() == 0 and args.progress) as bar:
        for size in sizes:
            # The larger side per device: all of it for psum, W blocks (psum_scatter), W shards (all_gather).
            n = max(size // dtype.itemsize, 1) if args.ops == ["psum"] else max(size // dtype.itemsize // world, 1) * world
            nbytes = n * dtype.itemsize
            for op in args.ops:
                lax_op, cgx_op, bus = _OPS[op]
                m = n if op != "all_gather" else n // world  # values per device in
                x = jax.make_array_from_callback(
                    (world, m), sharding,
                    lambda idx, m=m: np.random.default_rng(idx[0].start or 0).standard_normal((1, m)).astype(dtype),
                )
                plain = reducer(lambda v, f=lax_op: f(v, axis))
                t_plain = median_time(plain, x, args.repeats, args.warmup)
                exact = local(plain(x))
                bar.advance(f"{size / 2**20:g} MiB {op}")
                like = jax.ShapeDtypeStruct((m,), dtype)
                wire_plain = bytes_on_wire(like, world, jax_cgx.CompressionConfig(bits=32), op=op)
                factor = bus(world) if world > 1 else 1.0
                for _, bits, bucket, backend, hierarchical, algorithm, policy in [c for c in combos if c[0] == op]:
                    config = jax_cgx.CompressionConfig(
                        bits=bits, bucket_size=bucket, fusion_buffer_mb=max(1024, 2 * size / 2**20), backend=backend,
                        algorithm=algorithm, min_size=0, policy=policy, pipeline_segments=args.segments,
                        hierarchical=hierarchical,
                    )
                    compressed = reducer(lambda v, c=config, f=cgx_op: f(v, axis, c, impl=args.impl))
                    t = median_time(compressed, x, args.repeats, args.warmup)
                    err = float(np.max(np.abs(local(compressed(x)) - exact)))
                    records.append(
                        dict(
                            op=op, devices=world, platform=devices[0].platform, backend=backend, policy=policy,
                            algorithm=("auto" if policy == "auto" and args.two_level
                                       else f"hierarchical {algorithm}" if hierarchical else algorithm),
                            mesh="x".join(map(str, mesh.devices.shape)), dtype=dtype.name, size_bytes=nbytes, size_mib=nbytes / 2**20,
                            count=n, bits=bits, bucket_size=bucket, psum_ms=t_plain * 1e3, compressed_ms=t * 1e3,
                            psum_algbw_gbs=nbytes / t_plain / 1e9, psum_busbw_gbs=nbytes / t_plain / 1e9 * factor,
                            algbw_gbs=nbytes / t / 1e9, busbw_gbs=nbytes / t / 1e9 * factor, speedup=t_plain / t,
                            psum_wire_mib=wire_plain / 2**20,
                            # Over nodes, policy="auto" may choose another form (and psum or not) per node
                            # layout: the bytes follow the form that ran, as the decisions were timed.
                            compressed_wire_mib=bytes_on_wire(like, world, config, op=op,
                                                              inner_world=mesh.shape["local"] if args.two_level else None)
                            / 2**20,
                            max_abs_error=err, max_abs_sum=float(np.max(np.abs(exact))),
                        )
                    )
                    bar.advance(f"{size / 2**20:g} MiB {op} {bits} bits {backend}")
    if "nccl" in backends:
        jax_cgx.nccl.teardown()
    if "tcp" in backends:
        jax_cgx.tcp.teardown()
    return records


# op -> (lax's collective, jax_cgx's, nccl-tests' bus factor); psum_scatter and all_gather tiled.
_OPS = {
    "psum": (jax.lax.psum, lambda v, axis, c, impl: jax_cgx.compressed_psum(v, axis, c, impl=impl),
             lambda w: 2 * (w - 1) / w),
    "psum_scatter": (lambda v, axis: jax.lax.psum_scatter(v, axis, tiled=True),
                     lambda v, axis, c, impl: jax_cgx.compressed_psum_scatter(v, axis, c, tiled=True, impl=impl),
                     lambda w: (w - 1) / w),
    "all_gather": (lambda v, axis: jax.lax.all_gather(v, axis, tiled=True),
                   lambda v, axis, c, impl: jax_cgx.compressed_all_gather(v, axis, c, tiled=True, impl=impl),
                   lambda w: (w - 1) / w),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=parse_bytes, default=parse_bytes("1M"),
                   help="smallest buffer per device (bytes; K/M/G suffixes), default 1M")
    p.add_argument("-e", "--maxbytes", type=parse_bytes, default=parse_bytes("64M"),
                   help="largest buffer per device, default 64M")
    p.add_argument("-f", "--stepfactor", type=number(1, above=True), default=4, help="factor between sizes, default 4")
    p.add_argument("--sizes-mib", type=number(0, above=True), nargs="+", help="explicit sizes in MiB (instead of -b/-e/-f)")
    p.add_argument("-d", "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bits", type=int, choices=QUANTIZED_BITS, nargs="+", default=[2, 4, 8], metavar="BITS")
    p.add_argument("--bucket-sizes", "--bucket-size", type=integer(1), nargs="+", default=[jax_cgx.CompressionConfig.bucket_size], dest="bucket_sizes")
    p.add_argument("--backends", nargs="+", choices=["xla", "nccl", "tcp"],
                   help="jax_cgx backends to time (default: xla, plus nccl on GPUs); nccl and tcp are set up "
                        "with jax_cgx.nccl.setup / jax_cgx.tcp.setup")
    p.add_argument("--ops", nargs="+", choices=list(_OPS), default=["psum"],
                   help="collectives to time against lax's (default: psum)")
    p.add_argument("--algorithm", default=["sra"], choices=["sra", "ring"], nargs="+",
                   help="the compressed all-reduce's algorithm(s), side by side (default sra)")
    p.add_argument("--two-level", action="store_true",
                   help="a ('node', 'local') mesh of JAX_CGX_LOCAL_COUNT processes per node (benchmarks/netem/run.py "
                        "--nodes N --per-node M), every reduction over both axes")
    p.add_argument("--layouts", nargs="+", choices=["flat", "hierarchical"], default=["flat", "hierarchical"],
                   help="with --two-level: the compressed psum flat over both axes (--algorithm), hierarchical "
                        "(exact within a node, compressed across nodes), or both side by side (default)")
    p.add_argument("--segments", type=integer(0), default=0,
                   help="CompressionConfig.pipeline_segments: messages per exchange, 0 = by size (default)")
    p.add_argument("--policy", default=["always"], choices=["always", "auto"], nargs="+",
                   help="CompressionConfig.policy of the compressed rows, side by side (auto: lax where the cost "
                        "model, measured in the first trace, finds it faster; with --two-level also the form it "
                        "chooses, in one row; default always)")
    p.add_argument("--impl", default="auto", choices=["kernel", "reference", "auto"])
    p.add_argument("-n", "--repeats", type=integer(1), default=10, help="timed calls per point (median)")
    p.add_argument("-w", "--warmup", type=integer(0), default=1, help="untimed calls first")
    p.add_argument("--share-gpu", action="store_true",
                   help="all ranks on GPU 0 of this machine (one NCCL host id per process)")
    p.add_argument("--output", help="also write the results to this .json or .csv file")
    p.add_argument("--plot", help="write busbw and speedup against size to this PNG (needs matplotlib)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def plot(records: list[dict], path: str) -> None:
    """busbw (GB/s) and speedup over lax against buffer size, one line per op/bits/bucket/backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_sp) = plt.subplots(1, 2, figsize=(11, 4))
    for op in sorted({r.get("op", "psum") for r in records}):
        lax_bw = {r["size_bytes"]: r["psum_busbw_gbs"] for r in records if r.get("op", "psum") == op}
        ax_bw.plot(sorted(lax_bw), [lax_bw[s] for s in sorted(lax_bw)], "--", label=f"lax.{op}")
    for key in sorted({(r.get("op", "psum"), r["bits"], r["bucket_size"], r["backend"]) for r in records}):
        rows = sorted((r for r in records if (r.get("op", "psum"), r["bits"], r["bucket_size"], r["backend"]) == key),
                      key=lambda r: r["size_bytes"])
        label = f"{key[0]}, {key[1]} bits, bucket {key[2]}, {key[3]}"
        ax_bw.plot([r["size_bytes"] for r in rows], [r["busbw_gbs"] for r in rows], marker="o", label=label)
        ax_sp.plot([r["size_bytes"] for r in rows], [r["speedup"] for r in rows], marker="o", label=label)
    ax_sp.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    r0 = records[0]
    for ax, ylabel in ((ax_bw, "busbw (GB/s, uncompressed bytes)"), (ax_sp, "speedup over lax")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer per device (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_bw.legend(fontsize=7)
    ax_sp.legend(fontsize=7)
    fig.suptitle(f"jax_cgx vs lax: {r0['devices']} x {r0['platform']}, {r0['dtype']}, mesh {r0['mesh']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    records = run(args)
    if jax.process_index() != 0:
        return
    rows = [
        [
            r.get("op", "psum"),
            f"{r['size_bytes']:,}",
            f"{r['count']:,}",
            r["dtype"],
            str(r["bits"]),
            str(r["bucket_size"]),
            r["backend"],
            r["algorithm"] + ("" if r.get("policy", "always") == "always" or r["algorithm"] == "auto" else ", auto"),
            f"{r['psum_ms'] * 1e3:.0f}",
            f"{r['psum_busbw_gbs']:.2f}",
            f"{r['compressed_ms'] * 1e3:.0f}",
            f"{r['algbw_gbs']:.2f}",
            f"{r['busbw_gbs']:.2f}",
            f"{r['speedup']:.2f}",
            f"{r['psum_wire_mib'] / r['compressed_wire_mib']:.2f}" if r["compressed_wire_mib"] else "-",
            f"{r['max_abs_error']:.3g}",
        ]
        for r in records
    ]
    r0 = records[0]
    title = (f"jax_cgx vs lax: {r0['devices']} x {r0['platform']} devices, mesh {r0['mesh']} "
             "(algbw/busbw from the uncompressed size, nccl-tests convention)")
    columns = ["op", "size (B)", "count", "type", "bits", "bucket", "backend", "form", "lax us", "lax busbw",
               "cgx us", "algbw GB/s", "busbw GB/s", "speedup", "fewer bytes", "max |err|"]
    print_table(title, columns, rows)
    if args.output:
        save(records, args.output)
    if args.plot:
        plot(records, args.plot)
