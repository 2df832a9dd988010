"""One process of the multi-process tcp backend tests (tests/tcp/test_tcp_processes.py).

    python tests/support/tcp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR MODE

One CPU device per process. MODE ``compare``: compressed_psum and compressed_pmean with the tcp and the xla
backend, nearest and stochastic, float32 and bfloat16; writes OUT_DIR/process<ID>.npz.
MODE ``dead_peer``: every process runs a reduction once, then the last one exits without
running it again; the others must get an error, not hang; they write OUT_DIR/process<ID>.txt with
the message and how long it took. MODE ``mismatch``: every process reduces a different size (programs that differ);
each writes its error message to OUT_DIR/process<ID>.txt.
"""

import os
import sys
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402


def main() -> None:
    pid, nproc, port, out_dir, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    mesh = jax.make_mesh((nproc,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    jax_cgx.tcp.setup(mesh, timeout_s=60 if mode == "compare" else 10)

    def reduce(config, x, key=None, fn=jax_cgx.compressed_psum):
        f = jax.jit(jax.shard_map(lambda v: fn(v[0], "d", config, key=key)[None],
                                  mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), x)
        return f, x

    if mode == "compare":
        results = {}
        # The mean too: the tcp backend divides in its own decode (and its own chunk's).
        for n, dtype, stochastic, fn in [(300_001, jnp.float32, False, jax_cgx.compressed_psum),
                                         (300_001, jnp.float32, True, jax_cgx.compressed_psum),
                                         (4097, jnp.bfloat16, True, jax_cgx.compressed_psum),
                                         (300_001, jnp.float32, False, jax_cgx.compressed_pmean),
                                         (4097, jnp.bfloat16, True, jax_cgx.compressed_pmean)]:
            local = np.asarray(jax.random.normal(jax.random.key(pid), (1, n)).astype(dtype))
            key = jax.random.key(7) if stochastic else None
            for backend in ("tcp", "xla"):
                config = jax_cgx.CompressionConfig(bits=3, bucket_size=256, stochastic=stochastic, backend=backend,
                                                   pipeline_segments=5, min_size=16)
                f, x = reduce(config, local, key, fn)
                out = np.asarray(f(x).addressable_shards[0].data)[0]
                results[f"{backend}_{fn.__name__}_{n}_{np.dtype(dtype).name}_{stochastic}"] = out.view(np.uint8)
        np.savez(os.path.join(out_dir, f"process{pid}.npz"), **results)
        jax_cgx.tcp.teardown()
        jax.distributed.shutdown()
        return
    def error_of(n: int, run_first: bool = False) -> str:
        """The error a tcp reduction of n values raises here ("no error" if none). ``run_first``: run
        once on every process, then the last one leaves: the next call takes jax's fast dispatch path
        with a step that returns the reduction's result as it is (it raised ValueError there)."""
        f, x = reduce(jax_cgx.CompressionConfig(backend="tcp", min_size=16), np.ones((1, n), np.float32))
        try:
            if run_first:
                jax.block_until_ready(f(x))
                if pid == nproc - 1:
                    os._exit(0)
            jax.block_until_ready(f(x))
            return "no error"
        except Exception as err:  # the test checks the message, and the type of a peer's fault
            return ("(a JaxRuntimeError) " if isinstance(err, jax.errors.JaxRuntimeError) else "") + str(err)

    path = os.path.join(out_dir, f"process{pid}.txt")
    if mode == "mismatch":
        with open(path, "w") as fh:
            fh.write(error_of(1000 * (pid + 1)))
        os._exit(0)
    # dead_peer: the last process leaves after compiling; the others' call must fail, not hang.
    start = time.monotonic()
    message = error_of(1 << 20, run_first=True)
    with open(path, "w") as fh:
        fh.write(f"{time.monotonic() - start:.3f}\n{message}")
    os._exit(0)  # jax.distributed's shutdown would wait for the process that left


if __name__ == "__main__":
    main()
