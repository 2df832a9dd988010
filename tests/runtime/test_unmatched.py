"""A process left in a collective its peers never run: ended in seconds, named (jax_cgx._src.unmatched).

Before, the xla backend hung until jax's shutdown barrier timed out (300 s), then aborted every
process with no Python exception. The watch's timeout is 3 s here (JAX_CGX_UNMATCHED_TIMEOUT_S);
its default, 20 s, is checked where it is read.
"""

import os
import re
import subprocess
import sys
import time

import pytest
from processes import SUPPORT

from jax_cgx._src import unmatched

WORKER = str(SUPPORT / "unmatched_worker.py")
TIMEOUT_S = 3


def _launch(tmp_path, *worker_args, env=None, timeout=150):
    environ = {**os.environ, unmatched.TIMEOUT_ENV: str(TIMEOUT_S), **(env or {})}
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "jax_cgx.launch", "-n", "2", "--devices-per-process", "2", WORKER,
                          str(tmp_path), *worker_args], capture_output=True, text=True, timeout=timeout,
                         env=environ, cwd=tmp_path)
    return run, time.monotonic() - t0


def _log(run) -> str:
    return f"rc={run.returncode}\nstdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("extra_rank", [0, 1])  # rank 0 also serves jax's coordination service
def test_one_extra_collective_ends_the_job_in_seconds_naming_the_process(tmp_path, extra_rank):
    run, seconds = _launch(tmp_path, "--steps", f"{extra_rank}:4")
    out = run.stdout + run.stderr
    assert run.returncode == 1, _log(run)
    assert f"jax_cgx.launch: process {extra_rank} exited with 1" in run.stderr, _log(run)
    waited = re.search(rf"jax_cgx: process {extra_rank} failed: it has waited (\d+) s in a jax call \({WORKER}:", out)
    assert waited and int(waited.group(1)) >= TIMEOUT_S, _log(run)
    assert f"since process {1 - extra_rank} finished the program: a collective no other process will join" in out
    assert "unmatched_worker.py\", line" in out  # where it waited: the program's line, in a stack
    assert (f"process {1 - extra_rank} finished the program; process {extra_rank} ended in a collective no "
            "other process joined") in out, _log(run)
    assert (tmp_path / f"done{1 - extra_rank}").exists() and not (tmp_path / f"done{extra_rank}").exists()
    assert seconds < 60, f"{seconds:.0f} s: not bounded by the watch (jax's barrier is 300 s)"


def test_a_process_that_fails_at_the_end_releases_its_finished_peer_at_once(tmp_path):
    # Before, the finished process waited in jax's barrier until the heartbeat timeout (100 s) aborted it.
    run, seconds = _launch(tmp_path, "--fail-rank", "1")
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "jax_cgx.launch: process 1 exited with 1" in run.stderr, _log(run)
    assert "RuntimeError: process 1 fails after its steps" in out
    assert ("jax_cgx: process 0 finished the program; process 1 failed (see its output); leaving without jax's "
            "shutdown barrier") in out, _log(run)
    assert "still running" not in run.stderr, _log(run)  # process 0 left by itself, not stopped by the launcher
    assert seconds < 60


@pytest.mark.parametrize("what", ["sleep", "jax"])
def test_a_process_working_alone_at_the_end_is_left_alone(tmp_path, what):
    # Longer than the timeout, after its peer finished: a sleep, or jax calls that each return.
    run, seconds = _launch(tmp_path, "--alone", f"0:{what}:{3 * TIMEOUT_S}")
    assert run.returncode == 0, _log(run)
    assert (tmp_path / "alone0").exists() and (tmp_path / "done1").exists()
    assert "failed" not in run.stdout + run.stderr, _log(run)


def test_with_the_watch_off_the_finished_process_leaves_after_the_shutdown_timeout_naming_the_other(tmp_path):
    # JAX_CGX_UNMATCHED_TIMEOUT_S=0; shutdown_timeout_seconds (jax's, 300 s by default) bounds the wait.
    env = {unmatched.TIMEOUT_ENV: "0", "UNMATCHED_SHUTDOWN_TIMEOUT_S": "6"}
    run, seconds = _launch(tmp_path, "--steps", "0:4", env=env)
    assert run.returncode == 1, _log(run)
    assert "jax_cgx.launch: process 1 exited with 1" in run.stderr, _log(run)
    assert ("jax_cgx: process 1 failed: it finished the program, but process 0 had not 6 s later "
            "(shutdown_timeout_seconds); exiting with status 1 instead of jax's abort") in run.stdout, _log(run)
    assert seconds < 60


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan"])
def test_a_bad_timeout_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(unmatched.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=unmatched.TIMEOUT_ENV):
        unmatched.timeout_from_env(None, "jax_cgx.distributed.initialize")


def test_the_timeout_defaults_to_20_s_and_0_is_off(monkeypatch):
    monkeypatch.delenv(unmatched.TIMEOUT_ENV, raising=False)
    assert unmatched.timeout_from_env(None, "f") == unmatched.DEFAULT_TIMEOUT_S == 20
    assert unmatched.timeout_from_env(0, "f") == 0
    monkeypatch.setenv(unmatched.TIMEOUT_ENV, "45")
    assert unmatched.timeout_from_env(None, "f") == 45
    assert unmatched.timeout_from_env(7, "f") == 7  # the argument wins
    with pytest.raises(ValueError, match="unmatched_timeout_s must be a finite number"):
        unmatched.timeout_from_env(True, "f")
