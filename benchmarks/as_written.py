"""What a user gets from a script written from the README, in either import order, beside the harness.

``--order jax-first`` is how most JAX programs start: ``import jax``, ``jax.distributed.initialize()``,
then ``import jax_cgx``. ``--order jax-cgx-first`` imports jax_cgx before anything else (as
``jax_cgx.distributed.initialize()`` in the README does). Each then times, as the README writes them:

- ``--what allreduce``: ``compressed_pmean`` of ``--mib`` MiB of float32 per device (4-bit), and
  ``lax.pmean`` of the same, every call timed;
- ``--what step``: the README's plain ``jax.jit`` step, ``data_parallel_value_and_grad`` and Adam on
  benchmarks/train_step.py's 16.8 M-parameter MLP, every step timed.

``--compare`` runs the harness (``python -m jax_cgx.bench allreduce`` or ``benchmarks/train_step.py``)
and both orders ``--rounds`` times each, interleaved, as separate jobs in the same processes' places
(the same namespaces under benchmarks/netem/run.py), and prints each one's median beside the
harness's::

    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/as_written.py -- --compare --what allreduce

Run under ``jax_cgx.launch``, benchmarks/netem/run.py or any launcher that sets ``JAX_CGX_PROCESS_ID``,
``JAX_CGX_NUM_PROCESSES`` and ``JAX_CGX_COORDINATOR``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=("allreduce", "step"), default="allreduce", help="(default: %(default)s)")
    p.add_argument("--order", choices=("jax-first", "jax-cgx-first"), default="jax-first",
                   help="which is imported first (default: %(default)s)")
    p.add_argument("--mib", type=float, default=64, help="allreduce: MiB per device (default: %(default)s)")
    p.add_argument("--calls", type=int, default=12, help="timed calls or steps (default: %(default)s)")
    p.add_argument("--compare", action="store_true", help="run the harness and both orders, interleaved")
    p.add_argument("--rounds", type=int, default=3, help="--compare: rounds of the three (default: %(default)s)")
    p.add_argument("--output", help="the JSON results (process 0)")
    p.add_argument("--no-progress", action="store_true", help="(accepted for benchmarks/netem/run.py)")
    args = p.parse_args(argv)
    if args.calls < 3:
        p.error(f"--calls must be at least 3, got {args.calls}")
    return args


def as_written(args: argparse.Namespace) -> dict:
    """One README-written run in this process: every call's milliseconds."""
    if args.order == "jax-cgx-first":
        import jax_cgx  # noqa: F401
    import jax

    env = os.environ
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(env["JAX_CGX_COORDINATOR"], int(env["JAX_CGX_NUM_PROCESSES"]),
                               int(env["JAX_CGX_PROCESS_ID"]))
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cgx

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    config = jax_cgx.CompressionConfig(bits=4)
    if args.what == "allreduce":
        n = int(args.mib * 2**20) // 4
        x = jax.device_put(np.random.default_rng(0).standard_normal(n * mesh.size, np.float32),
                           NamedSharding(mesh, P("data")))

        def timed(reduce):
            f = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("data"), out_specs=P()))
            jax.block_until_ready(f(x))  # compiles
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                times.append((time.perf_counter() - t0) * 1e3)
            return times

        return dict(compressed_ms=timed(lambda v: jax_cgx.compressed_pmean(v, "data", config)),
                    plain_ms=timed(lambda v: jax.lax.pmean(v, "data")))

    import optax
    import train_digits

    sizes = (2048, 2048, 2048, 2048, 2048, 10)  # benchmarks/train_step.py's MLP
    optimizer = optax.adam(1e-3)
    grad_fn = jax_cgx.data_parallel_value_and_grad(train_digits.loss_fn, mesh=mesh, config=config)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # as the README writes it
    def train_step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(train_digits.init_params(jax.random.key(0), sizes), NamedSharding(mesh, P()))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    batch = 16 * mesh.size
    times = []
    for _ in range(args.calls):
        x, y = jax.device_put((rng.standard_normal((batch, sizes[0]), np.float32),
                               rng.integers(0, sizes[-1], batch).astype(np.int32)), NamedSharding(mesh, P("data")))
        t0 = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, x, y))
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(step_ms=times)


def harness(what: str, calls: int, mib: float, output: Path) -> list[str]:
    """The harness's command for the same measurement."""
    if what == "allreduce":
        return [sys.executable, "-m", "jax_cgx.bench", "allreduce", "--sizes-mib", f"{mib:g}", "--bits", "4",
                "--repeats", str(calls), "--no-progress", "--output", str(output)]
    return [sys.executable, str(HERE / "train_step.py"), "--compressors", "none", "onecall:4", "--steps",
            str(calls), "--no-progress", "--output", str(output)]


def compare(args: argparse.Namespace) -> None:
    """Every process runs the same jobs in the same order; process 0 reads and prints the results."""
    import numpy as np

    rank = int(os.environ.get("JAX_CGX_PROCESS_ID", "0"))
    rows: dict[str, list[float]] = {"harness": [], "jax-first": [], "jax-cgx-first": []}
    firsts: dict[str, list[float]] = {k: [] for k in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in rows:
                out = Path(tmp) / f"{name}-{r}.json"
                if name == "harness":
                    cmd = harness(args.what, args.calls, args.mib, out)
                else:
                    cmd = [sys.executable, __file__, "--what", args.what, "--order", name, "--mib", str(args.mib),
                           "--calls", str(args.calls), "--output", str(out)]
                proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"as_written: {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
                if rank:
                    continue
                data = json.loads(out.read_text())
                if name == "harness" and args.what == "allreduce":
                    rows[name].append(data[0]["compressed_ms"])
                elif name == "harness":
                    steps = next(d for d in data if d["compressor"] == "onecall:4")["steps_ms"]
                    rows[name].append(float(np.median(steps[3:])))
                    firsts[name].append(float(np.median(steps[1:7])))
                else:
                    times = data["compressed_ms" if args.what == "allreduce" else "step_ms"]
                    rows[name].append(float(np.median(times[1:] if args.what == "allreduce" else times[3:])))
                    if args.what == "step":
                        firsts[name].append(float(np.median(times[1:7])))
    if rank:
        return
    base = float(np.median(rows["harness"]))
    table = []
    for name, values in rows.items():
        row = dict(run=name, what=args.what, mib=args.mib, calls=args.calls, median_ms=float(np.median(values)), runs_ms=values, of_harness=float(np.median(values)) / base)
        if firsts[name]:
            row["steps_2_7_ms"] = float(np.median(firsts[name]))
        table.append(row)
        first = f", steps 2-7 {row['steps_2_7_ms']:.1f} ms" if "steps_2_7_ms" in row else ""
        print(f"{name:>14}: {row['median_ms']:7.1f} ms ({row['of_harness']:.2f}x the harness's){first}; runs "
              + " ".join(f"{v:.1f}" for v in values), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(table, indent=1))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare:
        compare(args)
        return
    sys.path.insert(0, str(HERE.parent / "examples"))
    result = dict(what=args.what, order=args.order, **as_written(args))
    import jax

    if jax.process_index() == 0 and args.output:
        Path(args.output).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
