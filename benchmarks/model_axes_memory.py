"""Per-device memory of a compiled gradient step on a mesh with a model axis, compressed or not.

A Megatron-style MLP (column- then row-parallel layer pairs) on 8 devices split into
``(data, model)`` = (8, 1), (4, 2) and (2, 4): ``jax.jit`` of ``data_parallel_value_and_grad``,
the parameters sharded over "model", the batch over "data". XLA's own figures per device
(``compiled.memory_analysis()``): arguments (parameters and batch), outputs (the loss and the
gradients) and temporaries (activations, fusion buffers, the codec's packed bytes), for float32
psum (``bits=32``) and 8- and 4-bit compression over "data"; and, for comparison, the compressed
step without ``param_specs`` (``Auto`` axes under ``jax.jit``: each gradient reduced whole and
returned replicated, as every compressed step was before jax_cgx knew the model axes)::

    python benchmarks/model_axes_memory.py                   # the table (markdown)
    python benchmarks/model_axes_memory.py --json out.json   # and the figures

The gradients each device holds scale with 1 / model, compressed or not: each device quantizes
its own shard (docs/multinode.md has the table).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402

DEVICES = 8


def model(width: int, layers: int):
    """Parameters (ShapeDtypeStructs) and their specs: ``layers`` pairs of a column-parallel
    ``(width, 4 width)`` and a row-parallel ``(4 width, width)`` matrix, with biases."""
    params, specs = {}, {}
    for i in range(layers):
        params[f"up{i}"] = jax.ShapeDtypeStruct((width, 4 * width), jnp.float32)
        params[f"up{i}_bias"] = jax.ShapeDtypeStruct((4 * width,), jnp.float32)
        params[f"down{i}"] = jax.ShapeDtypeStruct((4 * width, width), jnp.float32)
        specs[f"up{i}"], specs[f"up{i}_bias"], specs[f"down{i}"] = P(None, "model"), P("model"), P("model", None)
    return params, specs


def loss(params, x, y):
    layers = sum(1 for k in params if k.startswith("down"))
    h = x
    for i in range(layers):
        h = h + jax.nn.gelu(h @ params[f"up{i}"] + params[f"up{i}_bias"]) @ params[f"down{i}"]
    return jnp.mean((h - y) ** 2)


def measure(model_shards: int, bits: int, *, specs_given: bool = True, width: int = 512, layers: int = 4,
            rows: int = 64, bucket_mb: float | None = None) -> dict:
    """The compiled gradient step's per-device memory figures (bytes) on ``(DEVICES /
    model_shards, model_shards)`` devices at ``bits`` (32: an exact psum); ``specs_given=False``:
    without ``param_specs`` (the gradients reduced whole and replicated)."""
    mesh = jax.make_mesh((DEVICES // model_shards, model_shards), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:DEVICES])
    params, specs = model(width, layers)
    config = jax_cgx.CompressionConfig(bits=bits, bucket_size=512)
    options = {"param_specs": specs} if specs_given else {}
    if bucket_mb is not None:
        options["bucket_mb"] = bucket_mb
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, config=config, **options)
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    batch = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    compiled = jax.jit(grad_fn, in_shardings=(shard, batch, batch)).lower(params, x, x).compile()
    stats = compiled.memory_analysis()
    param_bytes = sum(p.size * p.dtype.itemsize for p in params.values())
    return {"model": model_shards, "data": DEVICES // model_shards, "bits": bits, "param_specs": specs_given,
            "param_bytes": param_bytes, "argument_bytes": stats.argument_size_in_bytes,
            "output_bytes": stats.output_size_in_bytes, "temp_bytes": stats.temp_size_in_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=None, help="data_parallel_value_and_grad's bucket_mb")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    rows = [measure(m, b, width=args.width, layers=args.layers, bucket_mb=args.bucket_mb)
            for m in (1, 2, 4) for b in (32, 8, 4)]
    rows += [measure(m, 8, specs_given=False, width=args.width, layers=args.layers, bucket_mb=args.bucket_mb)
             for m in (2, 4)]
    mib = 2.0**20
    print(f"model: {args.layers} layer pairs of width {args.width}, {rows[0]['param_bytes'] / mib:.1f} MiB of "
          f"float32 parameters; {DEVICES} CPU devices; jax {jax.__version__}; bucket_mb "
          f"{args.bucket_mb if args.bucket_mb is not None else 'default'}")
    print("| data x model | bits | param_specs | parameters and batch MiB | gradients MiB | temporaries MiB | "
          "total MiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        total = r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]
        print(f"| {r['data']} x {r['model']} | {r['bits']} | {'given' if r['param_specs'] else 'none (whole)'} | "
              f"{r['argument_bytes'] / mib:.1f} | {r['output_bytes'] / mib:.1f} | {r['temp_bytes'] / mib:.1f} | "
              f"{total / mib:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
