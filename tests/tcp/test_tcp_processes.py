"""The tcp backend across processes (one CPU device each, jax.distributed + gloo for the
xla backend): bitwise the xla backend's result on every process, and a peer that leaves
makes a call fail instead of hang."""

import sys

import numpy as np
import pytest
from bitwise import assert_same_bits
from processes import run_all, worker_commands

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("nproc", [2, 3])
def test_tcp_equals_xla_on_every_process(tmp_path, nproc):
    for returncode, log in run_all(worker_commands("tcp_worker.py", nproc, tmp_path, "compare"), timeout=300):
        assert returncode == 0, log[-4000:]
    results = [np.load(tmp_path / f"process{i}.npz") for i in range(nproc)]
    for name in results[0].files:
        if not name.startswith("tcp_"):
            continue
        for i, r in enumerate(results):
            assert_same_bits(r[name], r["xla_" + name[4:]], f"process {i}: {name} vs the xla backend")
            assert_same_bits(r[name], results[0][name], f"{name}: process {i} vs process 0")


def test_a_peer_that_leaves_fails_the_call(tmp_path):
    outcomes = run_all(worker_commands("tcp_worker.py", 2, tmp_path, "dead_peer"), timeout=120)
    assert outcomes[0][0] == 0, outcomes[0][1][-4000:]
    elapsed, message = (tmp_path / "process0.txt").read_text().split("\n", 1)
    assert "jax_cgx_tcp_allreduce" in message and ("closed the connection" in message or "no bytes moved" in message
                                                   or "Connection reset" in message), message
    assert float(elapsed) < 30
    # the type jax raises for its own collectives' failures: one `except` serves both backends
    assert message.startswith("(a JaxRuntimeError) "), message


def test_ranks_running_different_reductions_fail_with_both_named(tmp_path):
    for returncode, log in run_all(worker_commands("tcp_worker.py", 2, tmp_path, "mismatch"), timeout=120):
        assert returncode == 0, log[-4000:]
    for pid in range(2):
        message = (tmp_path / f"process{pid}.txt").read_text()
        assert "runs a different reduction" in message, message
        assert "n=1000," in message and "n=2000," in message, message


_SETUP_SCRIPT = """
import sys, time
import jax_cgx
jax_cgx.distributed.initialize()
import jax
import numpy as np
from jax.sharding import Mesh
import jax_cgx.tcp as tcp
p = jax.process_index()
d = {x.id: x for x in jax.devices()}
if sys.argv[1] == "order":  # the same families, listed in another order on each process
    mesh = Mesh(np.array([[d[0], d[2048]], [d[2049], d[1]]]), ("a", "b"))  # both axes cross processes
    tcp.setup(mesh, [("a",), ("b",)] if p == 0 else [("b",), ("a",)], timeout_s=20)
else:  # process 0 gives up waiting for a late peer, then both set up
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    if p == 0:
        try:
            tcp.setup(mesh, timeout_s=1)
            raise SystemExit("the first setup should have timed out")
        except tcp.TcpError:
            pass
    else:
        time.sleep(4)
    tcp.setup(mesh, timeout_s=30)
print("set up", len(tcp.communicators()), flush=True)
"""


@pytest.mark.parametrize("case", ["order", "retry"])
def test_setup_in_any_axes_order_and_after_a_failed_attempt(tmp_path, case):
    # Listed in two orders, the families were connected in two orders: each process waited on the
    # other until the timeout. A retry after a timeout met its own stale address in the store.
    script = tmp_path / "setup.py"
    script.write_text(_SETUP_SCRIPT)
    launch = [sys.executable, "-m", "jax_cgx.launch", "-n", "2", "--devices-per-process", "2", "--timeout", "120"]
    ((returncode, log),) = run_all([[*launch, str(script), case]], timeout=180)
    assert returncode == 0, log[-4000:]
    assert log.count("set up") == 2, log[-4000:]
