"""A data-parallel training step with compressed_pmean next to pmean
=================================================================


    python examples/quickstart.py [--bits 4] [--bucket-size 128] [--steps 20] [--devices 8]
    python -m jax_cgx.launch -n 2 --devices-per-process 4 examples/quickstart.py
    mpirun -np 2 python examples/quickstart.py

By default it runs on 8 simulated CPU devices in one process; under a launcher, on all
processes' devices. Each device computes the gradient of a
small MLP on its shard of the batch; the gradients are averaged once with jax.lax.pmean
and once with jax_cgx.compressed_pmean. It prints the error of the compressed mean, the
step times, the bytes each device puts on the wire, and the first and last loss of both runs.

Simulated devices share one process's memory: nothing crosses a network, so there the
compressed step can only be slower (it adds the codec's work and saves no wire time). The
demo says so, and prints what the cost model predicts for the same step between machines
on 1, 10 and 100 Gbit/s links, from this machine's measured codec throughput, next to the
speedup measured on emulated links and the command that measures it.
"""

import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--bucket-size", type=int, default=None, help="values per bucket (default: CompressionConfig's, 128)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on GPU)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    return p.parse_args()


args = parse_args()
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )

import jax_cgx.distributed  # noqa: E402

# Joins the other processes under jax_cgx.launch, mpirun or SLURM; a no-op when run alone.
PROCESS = jax_cgx.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402
from jax_cgx import bytes_on_wire  # noqa: E402
from jax_cgx.cost_model import LinkModel, figures, predict  # noqa: E402


def report(*args) -> None:
    if PROCESS.process_index == 0:
        print(*args, flush=True)


def global_array(value, sharding):
    """The same host value on every process, as one array over the whole mesh."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def init(key, sizes):
    params = []
    for k, (a, b) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)})
    return params


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    out = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def main() -> None:
    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    config = jax_cgx.CompressionConfig(bits=args.bits)  # buckets of 128, leaves under 1024 values exact
    if args.bucket_size is not None:
        config = config.replace(bucket_size=args.bucket_size)
    sizes = [256, args.width, args.width, 16]
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda v: global_array(v, replicated), init(jax.random.key(0), sizes))
    n_params = sum(v.size for v in jax.tree.leaves(params))

    # A regression problem: y = tanh(x @ A), 64 examples per device.
    kx, ka = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (world * 64, sizes[0]))
    y = jnp.tanh(x @ jax.random.normal(ka, (sizes[0], sizes[-1])) / 8)
    batch = tuple(global_array(v, NamedSharding(mesh, P("data"))) for v in (x, y))

    def make_step(reduce):
        def local(params, x, y):
            # Differentiate this device's copy: the gradient of the replicated (invariant)
            # params would come out already summed over "data" by a float32 psum that JAX
            # inserts, leaving nothing for the reduction below to compress.
            mine = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(mine, x, y)
            grads = reduce(grads)
            new = jax.tree.map(lambda p, g: p - 0.4 * g, params, grads)
            return new, jax.lax.pmean(loss, "data"), grads

        spec = jax.tree.map(lambda _: P(), params)
        return jax.jit(
            jax.shard_map(local, mesh=mesh, in_specs=(spec, P("data"), P("data")), out_specs=(spec, P(), spec))
        )

    steps = {
        "pmean": make_step(lambda g: jax.lax.pmean(g, "data")),
        f"compressed_pmean ({args.bits} bits)": make_step(lambda g: jax_cgx.compressed_pmean(g, "data", config)),
    }
    report(f"jax_cgx {jax_cgx.__version__}: {world} x {devices[0].platform} devices "
          f"({PROCESS.process_count} process(es)), MLP {sizes} "
          f"({n_params:,} parameters, {n_params * 4 / 2**20:.1f} MiB of float32 gradients)")

    # Error of one compressed mean, on the same gradients.
    _, _, exact = steps["pmean"](params, *batch)
    _, _, approx = steps[f"compressed_pmean ({args.bits} bits)"](params, *batch)
    num = sum(jnp.sum((a - e) ** 2) for a, e in zip(jax.tree.leaves(approx), jax.tree.leaves(exact)))
    den = sum(jnp.sum(e**2) for e in jax.tree.leaves(exact))
    report(f"relative L2 error of the compressed mean gradient: {float(jnp.sqrt(num / den)):.2e} "
           f"({ERROR_NOTE.get(args.bits, 'see docs/algorithm.md for the bound')})")

    wire = {
        "pmean": bytes_on_wire(params, world, jax_cgx.CompressionConfig(bits=32)),
        f"compressed_pmean ({args.bits} bits)": bytes_on_wire(params, world, config),
    }
    for name, step in steps.items():
        p, losses, times = params, [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            p, loss, _ = jax.block_until_ready(step(p, *batch))  # one step in flight at a time
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        report(f"{name:>28}: step {median * 1e3:7.1f} ms (median), {wire[name] / 2**20:7.2f} MiB on the wire "
              f"per device per step, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if PROCESS.process_count == 1 and devices[0].platform == "cpu":
        between_machines(params, batch, world, config)
    report(MEASURED)
    report(NEXT_STEP)


# What the printed error means. Each value is rounded to one of 2**bits levels of its bucket's
# [min, max] range (512 values a bucket), so a gradient's error is a fraction of its buckets' ranges,
# not of its norm: tens of percent at 2-4 bits on a random MLP's small gradients, each extra bit
# halving it. Training tolerates it (the losses printed below fall alike), and error feedback
# (jax_cgx.optax.compressed_mean) carries what one step loses into the next.
ERROR_NOTE = {
    2: "expected at 2 bits: 4 levels per bucket; the training loss below is what matters",
    3: "expected at 3 bits: 8 levels per bucket; the training loss below is what matters",
    4: "expected at 4 bits: 16 levels per bucket's range, each extra bit halves it; the loss below is what matters",
    8: "expected at 8 bits: 256 levels per bucket's range, about 16x less than at 4 bits",
}

# Measured on emulated links (docs/performance.md): the same kind of step, bigger (16.8 M parameters).
MEASURED = """\
Measured, not predicted (docs/performance.md, with buckets of 512, the default until 2026-11-29): a
16.8 M-parameter step on 2 processes over emulated 1 Gbit/s links runs 2.7x faster with 4-bit
compressed_mean than with pmean, 3.15x with
reduce_in_backward; the same step in PyTorch DDP, in the same processes, 1.56x with its fp16 hook
and 2.34x with PowerSGD. Reproduce (Linux, root: network namespaces and tc; torch for the ddp: steps):
  sudo python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/train_step.py -- \\
      --link-gbps 1 --compressors none maxmin:4 maxmin:4+backward ddp:fp16 ddp:powersgd:2"""
NEXT_STEP = """
Next, in your own training step (docs/guide.md: "compressed_psum / compressed_pmean", "optax"):
  - a jax.jit step of your own: jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=config)
    in place of jax.value_and_grad, with the batch sharded over the mesh's "data" axis;
  - your own shard_map: jax_cgx.compressed_pmean(grads, "data", config) in place of jax.lax.pmean
    (differentiate a jax.lax.pcast(params, "data", to="varying") copy, as this demo does);
  - optax: optax.chain(jax_cgx.optax.compressed_mean("data", config), optax.adam(1e-3));
  - several processes: python -m jax_cgx.launch -n 2 examples/quickstart.py (one host), mpirun or srun."""
LINKS_GBPS = (1, 10, 100)
LATENCY_S = 50e-6  # per message: a switched Ethernet hop


def between_machines(params, batch, world: int, config) -> None:
    """What the step would take with each device on a machine of its own, from the cost model."""
    x, y = (np.asarray(a)[: a.shape[0] // world] for a in batch)  # one device's shard
    local = jax.jit(jax.value_and_grad(loss_fn))
    jax.block_until_ready(local(params, x, y))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(local(params, x, y))
        times.append(time.perf_counter() - t0)
    compute = sorted(times)[2]
    rates = figures(config.replace(link_gbps=1.0)).rates  # this machine's codec, measured once
    nbytes = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(params))
    report(f"\nThese {world} devices are simulated in one process: no byte crosses a network, so the times above\n"
           "are compute and memory traffic, and compression only adds its codec's work. With each device on a\n"
           "machine of its own, the cost model (jax_cgx.cost_model) predicts, from this machine's\n"
           f"codec (quantize {rates.quantize / 1e9:.1f} GB/s, dequantize {rates.dequantize / 1e9:.1f} GB/s), "
           f"one device's gradient ({compute * 1e3:.1f} ms) and {LATENCY_S * 1e6:.0f} us per message:")
    report(f"{'link':>12}  {'pmean step':>12}  {f'{config.bits}-bit step':>12}  speedup")
    for gbps in LINKS_GBPS:
        p = predict(nbytes, world, config.bits, config.bucket_size, LinkModel(gbps * 1e9 / 8, LATENCY_S), rates)
        plain, compressed = compute + p["psum"], compute + p["compressed"]
        report(f"{f'{gbps} Gbit/s':>12}  {plain * 1e3:9.1f} ms  {compressed * 1e3:9.1f} ms  {plain / compressed:6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
