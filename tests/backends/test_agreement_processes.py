"""Two processes that run different compressed reductions at the same point fail on every
process with one clear error naming both settings, on the xla and the tcp backend: no abort
inside gloo, no hang; matching ones run, agreeing once per compile (jax_cgx._src.backends.agreement).
One run of tests/support/agreement_worker.py serves every test here."""

import json

import pytest
from processes import run_all, worker_commands

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement")
    outcomes = run_all(worker_commands("agreement_worker.py", 2, out), timeout=240)
    results = []
    for pid, (_, log) in enumerate(outcomes):
        path = out / f"process{pid}.json"
        assert path.exists(), log[-4000:]
        results.append(json.loads(path.read_text()))
    return outcomes, results


@pytest.mark.parametrize("backend", ["xla", "tcp"])
@pytest.mark.parametrize("case, differ, settings", [
    ("bits", "bits", ("bits=4,", "bits=8,")),
    ("bucket", "bucket_size", ("bucket_size=64,", "bucket_size=512,")),
])
def test_a_mismatch_is_one_error_naming_both_settings(run, backend, case, differ, settings):
    _, results = run
    for pid, r in enumerate(results):
        message = r[f"{backend}_{case}"]
        assert message.startswith("ValueError: jax_cgx: process 1 runs a different reduction ("), (pid, message)
        assert "than process 0 (" in message and f"they differ in {differ}." in message, (pid, message)
        assert all(s in message for s in settings), (pid, message)
        assert f"backend='{backend}'" in message and "lowered into 'jit_step'" in message, (pid, message)


def test_sharded_collectives_are_checked_too(run):
    _, results = run
    for r in results:
        message = r["xla_scatter_bits"]
        assert "compressed_psum_scatter(" in message and "bits=2," in message and "bits=4," in message, message


@pytest.mark.parametrize("backend", ["xla", "tcp"])
def test_matching_reductions_run_and_agree_once_per_compile(run, backend):
    _, results = run
    for r in results:
        match = r[f"{backend}_match"]
        assert match["exchanges_first_call"] == 1, match  # one reduction, one store exchange
        assert match["exchanges_after"] == 0, match  # not when run, lowered again, or compiled anew
        assert match["max_error"] < 0.1, match


def test_a_process_that_never_reaches_the_point_is_named(run):
    _, results = run
    message = results[0]["xla_not_reached"]
    assert "process 0 waited 3 s" in message and "for process 1, which did not reach this point" in message, message
    assert "JAX_CGX_AGREE_TIMEOUT_S" in message, message


def test_an_uncaught_mismatch_exits_nonzero_without_abort(run):
    outcomes, _ = run
    for returncode, log in outcomes:
        assert returncode == 1, (returncode, log[-4000:])  # not 134 / -6: gloo's abort
        assert "runs a different reduction" in log and "bits=4," in log and "bits=8," in log, log[-4000:]
        assert "Received data size" not in log, log[-4000:]
