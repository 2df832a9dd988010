"""One process of the cross-process agreement tests (tests/backends/test_agreement_processes.py).

    python tests/support/agreement_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

One CPU device per process, the tcp backend set up. Every process runs the same cases in the
same order, with settings that differ by process where a case says so, and records each case's
error message (or "no error") in OUT_DIR/process<ID>.json. The last case, a mismatch, is not
caught: the process must exit non-zero, with the message, and neither abort nor hang.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402
from jax_cgx._src.backends import agreement  # noqa: E402

N = 4096


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    mesh = jax.make_mesh((nproc,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    jax_cgx.tcp.setup(mesh, timeout_s=60)
    local = np.random.default_rng(pid).standard_normal((1, N)).astype(np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    exchanges = []  # the store exchanges this process took part in
    real_agree = agreement._agree
    agreement._agree = lambda *args: (exchanges.append(args[1]), real_agree(*args))[1]

    def psum_of(config, name):
        def body(v):
            return jax_cgx.compressed_psum(v[0], "d", config)[None]
        body.__name__ = name  # the module's name: where the processes meet
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def scatter_of(config):
        def scatter(v):
            return jax_cgx.compressed_psum_scatter(v[0], "d", config, scatter_dimension=0, tiled=True)[None]
        return jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def outcome(f) -> str:
        try:
            jax.block_until_ready(f(x))
            return "no error"
        except Exception as err:  # the test checks the message
            return f"{type(err).__name__}: {err}"

    cfg = jax_cgx.CompressionConfig
    results = {}
    for backend in ("xla", "tcp"):
        results[f"{backend}_bits"] = outcome(psum_of(cfg(bits=4 if pid == 0 else 8, bucket_size=64,
                                                         backend=backend), "step"))
        results[f"{backend}_bucket"] = outcome(psum_of(cfg(bits=4, bucket_size=64 if pid == 0 else 512,
                                                           backend=backend), "step"))
        # Matching: it runs, and agrees once per compile: never again when run, lowered or compiled anew.
        f = psum_of(cfg(bits=8, bucket_size=128, backend=backend), "step")
        before = len(exchanges)
        out = np.asarray(f(x).addressable_shards[0].data)[0]
        once = len(exchanges) - before
        for _ in range(3):
            f(x).block_until_ready()
        f.lower(x).compile()
        jax.clear_caches()
        f(x).block_until_ready()
        results[f"{backend}_match"] = {"exchanges_first_call": once, "exchanges_after": len(exchanges) - before - once,
                                       "max_error": float(np.max(np.abs(out - exact(nproc))))}
    results["xla_scatter_bits"] = outcome(scatter_of(cfg(bits=2 if pid == 0 else 4, bucket_size=64)))
    # A process that never reaches the point: the other waits the timeout and says so.
    os.environ[agreement.TIMEOUT_ENV] = "3"
    if pid == 0:
        results["xla_not_reached"] = outcome(psum_of(cfg(bits=4, bucket_size=64), "only_on_process_0"))
    del os.environ[agreement.TIMEOUT_ENV]
    with open(os.path.join(out_dir, f"process{pid}.json"), "w") as fh:
        json.dump(results, fh)
    # Uncaught: the process exits with the error.
    psum_of(cfg(bits=4 if pid == 0 else 8, bucket_size=64), "last")(x).block_until_ready()


def exact(nproc: int) -> np.ndarray:
    return sum(np.random.default_rng(p).standard_normal((1, N)).astype(np.float32)[0] for p in range(nproc))


if __name__ == "__main__":
    main()
