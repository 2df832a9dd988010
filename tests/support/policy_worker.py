"""One process of the multi-process policy="auto" test (tests/policy/test_policy.py).

    python tests/support/policy_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--figures-only | --calibrate-only]

One CPU device per process. Every process measures different codec rates (process ``i``
reports its quantize throughput divided by ``i + 1``), so agreement is what makes their
figures, and so their decisions and programs, the same. Writes OUT_DIR/process<ID>.json:
the agreed figures, the decision on a buffer the slow link makes worth compressing, the
jaxpr's primitives, this device's result, and a near-tie's timing over the tcp backend
(each process times its own; they agree on the slowest). ``--figures-only``: only the
figures, or the error that computing them raised; ``--calibrate-only``: the same through
``jax_cgx.calibrate()``, then ``pricing.figures``.
"""

import dataclasses
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
from jax_cgx._src.policy import pricing, probes  # noqa: E402


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    measure = probes.measure_rates

    def skewed(device):  # a slower codec on every later process
        rates = measure(device)
        return dataclasses.replace(rates, quantize=rates.quantize / (pid + 1))

    probes.measure_rates = skewed
    if sys.argv[5:] in (["--figures-only"], ["--calibrate-only"]):
        try:
            if sys.argv[5] == "--calibrate-only":
                jax_cgx.calibrate()
            record = dict(figures=repr(pricing.figures(jax_cgx.CompressionConfig(policy="auto", min_size=16))))
        except ValueError as e:
            record = dict(error=str(e))
        _write(out_dir, pid, record)
        return

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    xs = np.random.default_rng(0).standard_normal((len(devices), 1 << 16)).astype(np.float32)
    x = jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("d")), lambda idx: xs[idx])
    config = jax_cgx.CompressionConfig(bits=4, policy="auto", min_size=16)  # the link is measured while tracing
    f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v[0], "d", config)[None],
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    jaxpr = str(f.trace(x).jaxpr)
    out = np.asarray(f(x).addressable_shards[0].data)[0]
    fig = pricing.figures(config)
    slow = pricing.decide(1 << 24, np.float32, len(devices), config.replace(link_gbps=0.01), log=False)
    timed = pricing._time_exchange(devices, 1 << 16, np.float32, config, "tcp")
    record = dict(figures=repr(fig), quantize=fig.rates.quantize, slow_link_compresses=slow.compress,
                  compressed_in_jaxpr="compressed_allreduce" in jaxpr, result=out.tolist(), timed=list(timed),
                  tcp_left=len(jax_cgx.tcp.communicators()))
    _write(out_dir, pid, record)


def _write(out_dir: str, pid: int, record: dict) -> None:
    with open(os.path.join(out_dir, f"process{pid}.json"), "w") as fh:
        json.dump(record, fh)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
