"""A tensor-parallel training step over two levels: the nodes are the data axis, the processes of a
node the model axis, and only the data axis is compressed.

Each process holds its shard of a Megatron-style MLP (``benchmarks/model_axes_memory.py``'s model:
column- then row-parallel layer pairs, split over "model"); XLA's partitioner runs the
tensor-parallel forward and backward over "model" (inside a node); the gradients' mean over "data"
(between nodes) is ``data_parallel_value_and_grad``'s, exact (``bits=32``: XLA's psum) or compressed,
each device sending its own shard. One SGD step per compressor in turn (round robin: every one sees
the same load), the median of the steps after the warm-up::

    sudo python benchmarks/netem/run.py --nodes 2 --per-node 2 --rate 1gbit \\
        --script benchmarks/model_axes_step.py -- --steps 20
    python -m jax_cgx.launch -n 4 benchmarks/model_axes_step.py --model-size 2   # one machine, no link

``--model-size`` defaults to the processes per node (``JAX_CGX_LOCAL_COUNT``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, nargs="+", default=[32, 8, 4], help="32: exact (default: %(default)s)")
    p.add_argument("--policy", choices=("always", "auto"), nargs="+", default=["always"],
                   help="the compressed rows' policy, each a row (default: %(default)s)")
    p.add_argument("--width", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="layer pairs (default: %(default)s)")
    p.add_argument("--rows", type=int, default=32, help="batch rows per data group (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="steps per row (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default: %(default)s)")
    p.add_argument("--model-size", type=int, help="devices along 'model' (default: the processes per node)")
    p.add_argument("--output", help="process 0 writes the rows to this .json or .csv file")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress lines")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    import jax_cgx

    args = parse_args(argv)
    jax_cgx.distributed.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_cgx.bench._table import print_table, save

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_axes_memory import loss, model

    devices = jax.devices()
    model_size = args.model_size or int(os.environ.get("JAX_CGX_LOCAL_COUNT", "1"))
    if len(devices) % model_size:
        raise SystemExit(f"model_axes_step: {len(devices)} devices do not split into groups of --model-size {model_size}")
    data = len(devices) // model_size
    # Process-major devices: a node's processes (consecutive ranks) are one data group's model axis.
    mesh = Mesh(np.array(devices).reshape(data, model_size), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shapes, specs = model(args.width, args.layers)
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(shapes))
        return {k: jax.random.normal(kk, s.shape) / np.sqrt(s.shape[0]) for kk, (k, s) in zip(keys, shapes.items())}

    init = jax.jit(init, out_shardings=shard)
    rows = args.rows * data

    def make_batch(i):
        @jax.jit
        def draw(key):
            x = jax.random.normal(key, (rows, args.width))
            return x, jnp.tanh(x)
        return jax.jit(draw, out_shardings=(batch, batch))(jax.random.key(1000 + i))

    rows_of = []
    for bits in args.bits:
        for policy in (["always"] if bits == 32 else args.policy):
            rows_of.append((bits, policy))
    trainers = []
    for bits, policy in rows_of:
        config = jax_cgx.CompressionConfig(bits=bits, bucket_size=512, policy=policy)
        grad_fn = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, config=config, param_specs=specs)

        def step(params, x, y, grad_fn=grad_fn):
            value, grads = grad_fn(params, x, y)
            return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

        trainers.append({"bits": bits, "policy": policy, "params": init(jax.random.key(0)), "times": [], "losses": [],
                         "step": jax.jit(step, donate_argnums=0, out_shardings=(shard, NamedSharding(mesh, P())))})
    lead = jax.process_index() == 0
    batches = [make_batch(i) for i in range(4)]
    for i in range(args.steps):
        for t in trainers:
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            t["params"], value = t["step"](t["params"], x, y)
            value = float(value)
            t["times"].append(time.perf_counter() - start)
            t["losses"].append(value)
        if lead and args.progress:
            print(f"model_axes_step: step {i + 1}/{args.steps}", file=sys.stderr, flush=True)
    local_bytes = sum(int(np.prod(s.shape)) * 4 for s in shapes.values()) // model_size
    records = []
    for t in trainers:
        timed = t["times"][args.warmup:]
        config = jax_cgx.CompressionConfig(bits=t["bits"], bucket_size=512)
        local = jax_cgx.optax.shard_shapes(shapes, specs, mesh)
        records.append({
            "compressor": "none" if t["bits"] == 32 else f"maxmin:{t['bits']}" + ("+auto" if t["policy"] == "auto" else ""),
            "bits": t["bits"], "policy": t["policy"], "data": data, "model": model_size,
            "step_ms": statistics.median(timed) * 1e3,
            "step_ms_p10": float(np.percentile(timed, 10)) * 1e3, "step_ms_p90": float(np.percentile(timed, 90)) * 1e3,
            "final_loss": t["losses"][-1], "shard_bytes": local_bytes,
            "wire_bytes": jax_cgx.bytes_on_wire(local, data, config) if data > 1 else 0,
            "parameters": sum(int(np.prod(s.shape)) for s in shapes.values()), "jax": jax.__version__,
        })
    base = next((r["step_ms"] for r in records if r["bits"] == 32), None)
    for r in records:
        r["speedup"] = base / r["step_ms"] if base else None
    if lead:
        print_table(
            f"tensor-parallel step: {records[0]['parameters']:,} parameters, data {data} x model {model_size}, "
            f"{args.rows} rows per data group, median of {args.steps - args.warmup} steps",
            ["bits", "policy", "step ms", "p10-p90 ms", "speedup", "wire per device per step", "loss"],
            [[str(r["bits"]), r["policy"], f"{r['step_ms']:.1f}", f"{r['step_ms_p10']:.0f}-{r['step_ms_p90']:.0f}",
              "-" if r["speedup"] is None else f"{r['speedup']:.2f}", f"{r['wire_bytes'] / 2**20:.2f} MiB",
              f"{r['final_loss']:.4f}"] for r in records])
        if args.output:
            save(records, args.output)
    return records


if __name__ == "__main__":
    main()
