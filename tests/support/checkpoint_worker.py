"""One process of the orbax checkpoint test (tests/optax/test_checkpoint.py).

    python tests/support/checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT DIR MODE

Each process has 4 CPU devices; the mesh spans both processes' 8. For every case of
checkpoint_cases.py (and an adaptive Planner), MODE ``full`` runs SAVE_AT + MORE steps without a
break, saving the parameters and the whole state with orbax after SAVE_AT of them; MODE ``resume``
(new processes) restores that checkpoint into a freshly built run and takes the MORE steps after it.
Each writes the parameters after every step it took past SAVE_AT to DIR/<MODE>-process<ID>.npz.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from checkpoint_cases import CASES, PARAMS, Run, gradients  # noqa: E402

import jax_cgx  # noqa: E402

SAVE_AT, MORE = 3, 3


def planner_run(mode: str, directory: str) -> dict:
    """The Planner's plan (its state_dict) across the same break; each step's plan recorded."""
    like = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
    planner = jax_cgx.adaptive.Planner(like, budget_bits=3, candidates=(2, 3, 4, 6), bucket_sizes=(64, 512),
                                       every=1, min_gain=0.0)
    path = os.path.join(directory, "planner")
    start = 0
    if mode == "resume":
        planner.load_state_dict(ocp.StandardCheckpointer().restore(path))
        start = SAVE_AT
    out = {}
    for t in range(start, SAVE_AT + MORE):
        mean = {k: g.mean(0) * (10.0 ** (t % 3) if k == "w" else 1.0) for k, g in gradients(t, 8).items()}
        planner.observe(t, mean)
        if t >= SAVE_AT:
            state = planner.state_dict()
            out.update({f"planner/{t}/{k}": np.asarray(v) for k, v in state.items()})
        if mode == "full" and t == SAVE_AT - 1:
            ckpt = ocp.StandardCheckpointer()
            ckpt.save(path, planner.state_dict())
            ckpt.wait_until_finished()
    return out


def main() -> None:
    pid, nproc, port, directory, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    results = {}
    for case in CASES:
        run = Run(case, mesh).init()
        path = os.path.join(directory, case.replace("+", "_"))
        start = 0
        if mode == "resume":
            # The target: a fresh run's parameters and state, whose shardings orbax restores into.
            restored = ocp.StandardCheckpointer().restore(path, {"params": run.params, "state": run.state})
            run.params, run.state = restored["params"], restored["state"]
            start = SAVE_AT
        for t in range(start, SAVE_AT + MORE):
            params = run.step(t)
            if t >= SAVE_AT:
                results.update({f"{case}/{t}/{k}": v for k, v in params.items()})
            if mode == "full" and t == SAVE_AT - 1:
                ckpt = ocp.StandardCheckpointer()
                ckpt.save(path, {"params": run.params, "state": run.state})
                ckpt.wait_until_finished()
    results.update(planner_run(mode, directory))  # every process: orbax's save is collective
    np.savez(os.path.join(directory, f"{mode}-process{pid}.npz"), **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
