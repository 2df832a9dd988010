"""One process of a jax_cgx training job started by a cluster engine (srun, sbatch, mpirun, mpiexec,
a Ray actor), or the whole job in one process as the reference (tests/engines/).

    python tests/support/engine_train.py OUT_DIR [--steps N] [--reference WORLD]
        [--checkpoint DIR [--save-every K] [--resume]] [--die-rank R --die-step S]

``jax_cgx.distributed.initialize()`` finds the processes from the engine's environment (one CPU
device each). The run: a small MLP whose two weight matrices (no biases: an exact leaf's ``psum`` is
summed in gloo's order across processes, XLA's in one, so only compressed leaves are bitwise the
same in both) are sent at 4 bits (the default ``CompressionConfig()``) by ``compressed_mean`` with
error feedback (a per-device state: what ``resize_state`` carries to another world size), then Adam.
The global batch of step ``t`` is a function of ``t`` alone (64 rows split over the devices), so any
world size trains on the same data. ``--reference WORLD``: the same run in this one process on WORLD
simulated devices. Each process writes OUT_DIR/process<I>.npz (the final parameters, every step's
loss) and OUT_DIR/process<I>.json (what initialize() detected); the reference OUT_DIR/reference.npz.

Process 0 prints ``step T loss L`` after each step. ``--checkpoint``: orbax saves the parameters
and the whole optimizer state to DIR/<step> every ``--save-every`` steps; ``--resume`` restores the newest, saved on any number of devices
(``resize_state``), and trains on from there. ``--die-rank R --die-step S``: process R kills itself
with SIGKILL at step S, as a lost node.
"""

import argparse
import json
import os
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
import jax_cgx.distributed
import jax_cgx.optax as cgx_optax

AXIS = "data"
BATCH = 64
SHAPES = {"w1": (16, 128), "w2": (128, 8)}


def init_params() -> dict:
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in SHAPES.items()}


def batch(t: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + t)
    x = rng.standard_normal((BATCH, 16)).astype(np.float32)
    return x, np.sin(x[:, :8] * 2).astype(np.float32)


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def global_array(x, mesh, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def local_copy(x) -> np.ndarray:
    return np.asarray(x.addressable_shards[0].data)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", type=pathlib.Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reference", type=int, default=None, metavar="WORLD")
    p.add_argument("--checkpoint", type=pathlib.Path, default=None)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--die-step", type=int, default=None)
    return p.parse_args(argv)


def train(args: argparse.Namespace, info: jax_cgx.distributed.ProcessInfo) -> None:
    """The run, in a process whose jax runtime is started (``info``: its place)."""
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    world = mesh.size
    tx = optax.chain(cgx_optax.compressed_mean(AXIS, jax_cgx.CompressionConfig(), error_feedback=True),
                     optax.adam(1e-2))
    like = init_params()
    specs = cgx_optax.state_specs(jax.eval_shape(tx.init, like), AXIS)
    replicated = NamedSharding(mesh, P())
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def local(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(), specs, P())))
    params = {k: global_array(v, mesh, P()) for k, v in like.items()}
    state = init(params)
    start = 0
    if args.resume:
        import orbax.checkpoint as ocp

        saved = sorted((int(d.name) for d in args.checkpoint.iterdir() if d.name.isdigit()), reverse=True)
        if not saved:
            raise SystemExit(f"--resume: no checkpoint in {args.checkpoint}")
        start = saved[0]
        saved_world = json.loads((args.checkpoint / f"{start}.json").read_text())["world"]
        shaped = jax.eval_shape(lambda s: cgx_optax.resize_state(s, like, AXIS, world=saved_world), state)
        target = {"params": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated), like),
                  "state": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shaped)}
        restored = ocp.StandardCheckpointer().restore(args.checkpoint / str(start) / "tree", target)
        params = restored["params"]
        state = jax.jit(lambda s: cgx_optax.resize_state(s, like, AXIS, world=world),
                        out_shardings=shardings)(restored["state"])
        print(f"process {info.process_index}: resumed at step {start} from {saved_world} devices on {world}",
              flush=True)
    losses = []
    for t in range(start, args.steps):
        if t == args.die_step and info.process_index == args.die_rank:
            print(f"process {info.process_index}: killed at step {t} (a lost node)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(t)
        params, state, loss = step(params, state, global_array(x, mesh, P(AXIS)), global_array(y, mesh, P(AXIS)))
        losses.append(float(local_copy(loss)))
        if info.process_index == 0:
            print(f"step {t} loss {losses[-1]:.7f}", flush=True)
        if args.checkpoint is not None and (t + 1) % args.save_every == 0 and t + 1 < args.steps:
            import orbax.checkpoint as ocp

            ckpt = ocp.StandardCheckpointer()
            ckpt.save(args.checkpoint / str(t + 1) / "tree", {"params": params, "state": state})
            ckpt.wait_until_finished()
            if info.process_index == 0:
                (args.checkpoint / f"{t + 1}.json").write_text(json.dumps({"world": world}))
    name = "reference" if args.reference else f"process{info.process_index}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(args.out_dir / f"{name}.npz", losses=np.asarray(losses), start=start,
             **{k: local_copy(v) for k, v in params.items()})
    (args.out_dir / f"{name}.json").write_text(json.dumps(
        {"process_index": info.process_index, "process_count": info.process_count, "local_rank": info.local_rank,
         "local_count": info.local_count, "source": info.source, "world": world}))
    print(f"process {info.process_index} of {info.process_count} ({info.source}): {args.steps - start} steps, "
          f"loss {losses[-1]:.5f}", flush=True)


def train_in(info: jax_cgx.distributed.ProcessInfo, argv: list[str]) -> None:
    """:func:`train` with this script's arguments, in a process started otherwise (a Ray actor)."""
    train(parse(argv), info)


if __name__ == "__main__":
    args = parse()
    # Before jax's CPU backend starts (the first device use, after initialize).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.reference or 1}"
    train(args, jax_cgx.distributed.detect() if args.reference else jax_cgx.distributed.initialize())
