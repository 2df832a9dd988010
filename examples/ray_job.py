"""A jax_cgx job on Ray
====================

One actor per process, each starting jax's runtime with ``jax_cgx.distributed.initialize`` on the
coordinator actor 0 offers, then running the same function.

    python examples/ray_job.py [--address auto] [--processes 4] [--cpus-per-process 1] [--gpus-per-process 0]

Without ``--address`` it starts a local Ray cluster of 2 nodes (``ray.cluster_utils.Cluster``), so
that the processes really span Ray nodes; with one (``auto``: the cluster ``ray start`` made) it
joins that. Each process trains the quickstart's MLP for a few steps with 4-bit ``compressed_mean``
and process 0 prints the loss. ``run_on_ray`` is the recipe: copy it, or import it.

Why not Ray Train's ``JaxTrainer``: it starts jax's runtime itself only for TPUs and GPUs (on CPU it
starts none, so the processes would not see each other) and with ``jax.distributed.initialize``, not
jax_cgx's (no gloo for CPU collectives, no early exit of a failing process). Plain actors do both
here, on CPU and GPU alike. With ``--gpus-per-process 1`` Ray gives each actor its own GPU
(``CUDA_VISIBLE_DEVICES``), which it then drives as its only local device.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Any

import ray


@ray.remote
class JaxProcess:
    """One process of the job: jax's runtime started by jax_cgx in the actor's own process."""

    def coordinator(self) -> str:
        """``host:port`` for jax's coordinator service: this actor's node address and a port free there."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, coordinator: str, num_processes: int, process_id: int, fn: Callable, *args) -> Any:
        import jax

        import jax_cgx.distributed

        info = jax_cgx.distributed.initialize(coordinator, num_processes, process_id)
        try:
            return fn(info, *args)
        finally:
            jax.distributed.shutdown()  # every process, so that none waits in the shutdown barrier


def run_on_ray(fn: Callable, *args, num_processes: int, cpus: float = 1, gpus: float = 0) -> list:
    """``fn(info, *args)`` in ``num_processes`` actors forming one jax job (``info``: the process's
    :class:`jax_cgx.distributed.ProcessInfo`); returns each process's result, in process order.
    ``fn`` and ``args`` travel by pickle. Ray must be initialized (``ray.init``)."""
    actors = [JaxProcess.options(num_cpus=cpus, num_gpus=gpus).remote() for _ in range(num_processes)]
    try:
        coordinator = ray.get(actors[0].coordinator.remote())
        return ray.get([a.run.remote(coordinator, num_processes, i, fn, *args) for i, a in enumerate(actors)])
    finally:
        for a in actors:
            ray.kill(a)


def nodes_of(num_processes: int, cpus: float = 1) -> list[str]:
    """The Ray node each of ``num_processes`` actors lands on (how the job would be spread)."""
    actors = [JaxProcess.options(num_cpus=cpus).remote() for _ in range(num_processes)]
    try:
        return ray.get([a.node.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)


def local_cluster(cpus_per_node: list[float]):
    """A Ray cluster of ``len(cpus_per_node)`` nodes on this machine. (Its nodes take the host's own
    address, whose traffic the kernel keeps on this machine: cluster_utils' nodes given 127.0.0.1
    are not reachable by ``ray.init`` in Ray 2.60.)"""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node[0], "include_dashboard": False})
    for cpus in cpus_per_node[1:]:
        cluster.add_node(num_cpus=cpus)
    return cluster


def train(info, steps: int) -> list[float]:
    """The quickstart's MLP, data parallel over every process's devices, 4-bit gradient mean."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_cgx

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    loss_fn = lambda p, x, y: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)  # noqa: E731
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=jax_cgx.CompressionConfig())
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put({"w1": jax.random.normal(k1, (32, 256)) / 6, "w2": jax.random.normal(k2, (256, 1)) / 16},
                            replicated)
    x = jax.random.normal(k3, (64 * jax.device_count(), 32))
    x, y = jax.device_put((x, jnp.sin(x[:, :1])), rows)
    state = opt.init(params)
    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    if info.process_index == 0:
        print(f"process 0 of {info.process_count}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running Ray cluster ('auto': the one `ray start` made); "
                                     "default: a local cluster of 2 nodes started here")
    p.add_argument("--processes", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--cpus-per-process", type=float, default=1, help="(default: %(default)s)")
    p.add_argument("--gpus-per-process", type=float, default=0, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="(default: %(default)s)")
    args = p.parse_args()
    cluster = None
    if args.address is None:
        per_node = max(1, args.processes // 2) * args.cpus_per_process
        cluster = local_cluster([per_node, args.processes * args.cpus_per_process - per_node])
    ray.init(address=cluster.address if cluster else args.address)
    try:
        losses = run_on_ray(train, args.steps, num_processes=args.processes, cpus=args.cpus_per_process,
                            gpus=args.gpus_per_process)
        print(f"{args.processes} processes on Ray: every process's losses the same: "
              f"{all(one == losses[0] for one in losses)}; final loss {losses[0][-1]:.4f}")
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
