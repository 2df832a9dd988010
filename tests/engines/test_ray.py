"""jax_cgx on Ray: a local cluster of 2 Ray nodes (``ray.cluster_utils.Cluster``, on 127.0.0.1) with
2 actors on each, one per process, each starting jax's runtime with
``jax_cgx.distributed.initialize`` on the coordinator actor 0 offers (examples/ray_job.py's
``run_on_ray``, the recipe docs/distributed.md gives); the 4 processes train to the single-process
run's bits."""

import collections
import os
import sys

import pytest
from engines import ROOT, TRAIN, check_job, reference

ray = pytest.importorskip("ray", reason="Ray is not installed: run tools/install_engines.sh (.ci/run does)")
sys.path.insert(0, str(ROOT / "examples"))
import ray_job  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes():
    cluster = ray_job.local_cluster([2, 2])
    # The actors import engine_train (tests/support) and ray_job (examples) by name.
    path = os.pathsep.join([str(ROOT / "examples"), os.path.dirname(TRAIN)])
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": path, "XLA_FLAGS": ""}},
             log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_actors_on_two_ray_nodes_run_the_compressed_step_bitwise(two_nodes, tmp_path, tmp_path_factory):
    import engine_train

    per_node = collections.Counter(ray_job.nodes_of(4))
    assert sorted(per_node.values()) == [2, 2], per_node  # the job spans both Ray nodes
    ray_job.run_on_ray(engine_train.train_in, [str(tmp_path / "out")], num_processes=4)
    check_job(tmp_path / "out", 4, "arguments", reference(4, 3, tmp_path_factory.getbasetemp()), local_count=1)
