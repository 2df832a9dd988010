"""One process of the multi-process test of meshes with model axes (tests/data_parallel/test_model_axes.py).

    python tests/support/model_axes_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Each process has 4 CPU devices; 2 processes make the 8 devices of two meshes: ``("data",
"model")`` with the data axis across the processes (nodes = data, as large models train) and
``("model", "data")`` with the model axis across them. ``step(mesh)`` is what runs; this process's
shards of the gradients go to OUT_DIR/process<ID>.npz, keyed by their devices' mesh coordinates.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402

CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)
SPECS = {"b1": P("model"), "w1": P(None, "model"), "w2": P("model", None)}
LAYOUTS = {"data_across": ("data", "model"), "model_across": ("model", "data")}


def problem():
    rng = np.random.default_rng(5)
    params = {"b1": rng.standard_normal((64,)).astype(np.float32) * 0.1,
              "w1": rng.standard_normal((16, 64)).astype(np.float32) * 0.3,
              "w2": rng.standard_normal((64, 4)).astype(np.float32) * 0.3}
    x = rng.standard_normal((32, 16)).astype(np.float32)
    return params, x, np.tanh(x[:, :4])


def loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


def mesh_of(devices, layout: str) -> Mesh:
    """The 8 devices (process-major) as a 2 x 4 mesh: its first axis across the processes."""
    return Mesh(np.array(devices).reshape(2, 4), LAYOUTS[layout], axis_types=(AxisType.Auto,) * 2)


def step(mesh):
    grad_fn = jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, config=CONFIG, param_specs=SPECS)
    return jax.jit(grad_fn)


def placed(mesh):
    params, x, y = problem()

    def put(value, spec):
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])

    return {k: put(v, SPECS[k]) for k, v in params.items()}, put(x, P("data")), put(y, P("data"))


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    results = {}
    for layout in LAYOUTS:
        mesh = mesh_of(jax.devices(), layout)
        _, grads = step(mesh)(*placed(mesh))
        for k, g in grads.items():
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), g.ndim), (layout, k, g.sharding)
            for shard in g.addressable_shards:
                at = dict(zip(mesh.axis_names, (int(c) for c in np.argwhere(mesh.devices == shard.device)[0])))
                results[f"{layout}/{k}/data{at['data']}/model{at['model']}"] = np.asarray(shard.data)
    np.savez(os.path.join(out_dir, f"process{pid}.npz"), **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
