"""One process of the two-process test of a NaN under optax.MultiSteps (tests/optax/test_not_finite.py).

    python tests/support/not_finite_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Each process has 2 CPU devices; the "data" axis spans both processes. A NaN on one device of
process 1 at mini-step 1; with jax_cgx.optax.skip_not_finite every device of both processes
skips that mini-step. Writes OUT_DIR/process<ID>.npz: the final parameters of the run with the bad
batch and of the run without it, and the skip state after the bad mini-step.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402
from jax_cgx.optax import compressed_mean, skip_not_finite, state_specs  # noqa: E402

CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)


def batches(world: int, bad: bool) -> list[np.ndarray]:
    out = []
    for step in range(6):
        g = np.random.default_rng(step).standard_normal((world, 32, 64)).astype(np.float32)
        if step == 1:
            if not bad:
                continue
            g[world - 1, 5, 7] = np.nan  # one value on the last device (process 1's)
        out.append(g)
    return out


def run(mesh, bad: bool):
    inner = optax.chain(compressed_mean("data", CONFIG, layer_min_size=1, error_feedback=True), optax.sgd(0.1))
    tx = optax.MultiSteps(inner, every_k_schedule=2, should_skip_update_fn=skip_not_finite("data"))
    params = {"w": jnp.zeros((32, 64), jnp.float32)}
    specs = state_specs(jax.eval_shape(tx.init, params), "data")
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(params, state, g):
        updates, state = tx.update({"w": g[0]}, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    skips = []
    for g in batches(mesh.size, bad):
        x = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("data")), lambda idx, g=g: g[idx])
        params, state = step(params, state, x)
        skips.append(int(np.asarray(state.skip_state["num_not_finite"].addressable_shards[0].data)))
    return np.asarray(params["w"].addressable_shards[0].data), np.array(skips)


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    bad, skips = run(mesh, bad=True)
    clean, _ = run(mesh, bad=False)
    np.savez(os.path.join(out_dir, f"process{pid}.npz"), bad=bad, clean=clean, skips=skips)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
