"""jax_cgx under a real SLURM (slurmctld, slurmd and munge started on this machine by
tests/support/slurm.py): ``srun`` and ``sbatch`` jobs whose processes find their places from SLURM
and train to the single-process run's bits, and a lost node: the job fails naming the task, and is
resumed from its orbax checkpoint on fewer tasks, resubmitted or requeued, the loss going on where
it was."""

import re
import sys
import time

import numpy as np
import pytest
from engines import TRAIN, check_job, log_of, reference
from slurm import LocalSlurm, unavailable

WHY_NOT = unavailable()
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no local SLURM: {WHY_NOT}")]
STEPS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalSlurm(tmp_path_factory.mktemp("cluster"), cpus=4) as slurm:
        yield slurm


def _batch_script(path, out, ntasks: int, body: str, *options: str):
    path.write_text("\n".join(["#!/bin/bash", f"#SBATCH --ntasks={ntasks}", f"#SBATCH --output={out}",
                               "#SBATCH --open-mode=append", *[f"#SBATCH {o}" for o in options], body, ""]))
    return path


def _losses(text: str) -> dict[int, float]:
    return {int(t): float(v) for t, v in re.findall(r"^step (\d+) loss ([\d.]+)$", text, re.M)}


def test_srun_and_sbatch_run_the_compressed_step_bitwise(cluster, tmp_path, tmp_path_factory):
    want = reference(4, 3, tmp_path_factory.getbasetemp())
    run = cluster.run(["srun", "--ntasks=4", "--kill-on-bad-exit=1", sys.executable, TRAIN, str(tmp_path / "srun")])
    assert run.returncode == 0, log_of(run) + cluster.logs()
    check_job(tmp_path / "srun", 4, "slurm", want)

    script = _batch_script(tmp_path / "job.sh", tmp_path / "sbatch.log", 4,
                           f"srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} {tmp_path / 'sbatch'}")
    run = cluster.run(["sbatch", "--wait", str(script)])
    assert run.returncode == 0, log_of(run) + (tmp_path / "sbatch.log").read_text() + cluster.logs()
    check_job(tmp_path / "sbatch", 4, "slurm", want)


def _lost_node(cluster, tmp_path, ckpt) -> str:
    """A 4-task job saving every 2 steps; task 2 is killed at step 5. Returns its log."""
    log = tmp_path / "lost.log"
    script = _batch_script(tmp_path / "lost.sh", log, 4,
                           f"srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} {tmp_path / 'lost'} --steps {STEPS} "
                           f"--checkpoint {ckpt} --save-every 2 --die-rank 2 --die-step 5")
    run = cluster.run(["sbatch", "--wait", str(script)], timeout=300)
    text = log.read_text()
    assert run.returncode != 0, "the job with a killed task succeeded:\n" + text
    assert re.search(r"task 2: Killed", text), text  # srun names the lost task
    return text


def _check_resumed(text_before: str, resumed_text: str, resumed_out, plain_out, tmp_path_factory):
    before, after = _losses(text_before), _losses(resumed_text)
    assert "resumed at step 4 from 4 devices on 2" in resumed_text, resumed_text
    assert sorted(after) == list(range(4, STEPS)), after
    # Step 4's loss is the restored parameters' on step 4's batch: what the 4-task job computed
    # before it lost task 2 (summed over other processes, so to float rounding): no jump.
    np.testing.assert_allclose(after[4], before[4], rtol=1e-6)
    # And the rest within 1% of the same training on 4 devices without a break.
    full = np.load(reference(4, STEPS, tmp_path_factory.getbasetemp()))["losses"]
    np.testing.assert_allclose([after[t] for t in range(4, STEPS)], full[4:], rtol=1e-2)
    # Bitwise what an uninterrupted 2-task run from the same checkpoint gives.
    check_job(resumed_out, 2, "slurm", None)
    for i in range(2):
        got, want = np.load(resumed_out / f"process{i}.npz"), np.load(plain_out / f"process{i}.npz")
        for name in ("w1", "w2", "losses"):
            np.testing.assert_array_equal(got[name], want[name])


def test_a_lost_node_is_resumed_on_fewer_tasks(cluster, tmp_path, tmp_path_factory):
    ckpt = tmp_path / "ckpt"
    before = _lost_node(cluster, tmp_path, ckpt)
    assert sorted(p.name for p in ckpt.glob("*.json")) == ["2.json", "4.json"]
    for name in ("resumed", "plain"):
        script = _batch_script(tmp_path / f"{name}.sh", tmp_path / f"{name}.log", 2,
                               f"srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} {tmp_path / name} "
                               f"--steps {STEPS} --checkpoint {ckpt} --save-every 100 --resume")
        run = cluster.run(["sbatch", "--wait", str(script)], timeout=300)
        assert run.returncode == 0, log_of(run) + (tmp_path / f"{name}.log").read_text()
    _check_resumed(before, (tmp_path / "resumed.log").read_text(), tmp_path / "resumed", tmp_path / "plain",
                   tmp_path_factory)


def test_a_requeued_job_resumes_on_fewer_tasks(cluster, tmp_path, tmp_path_factory):
    # sbatch --requeue: SLURM runs the same script again (SLURM_RESTART_COUNT=1) after `scontrol requeue`,
    # what a site's node-failure handling does; the second run resumes on the 2 tasks left.
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.log"
    body = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then\n'
            f"  srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} {tmp_path / 'first'} --steps {STEPS} "
            f"--checkpoint {ckpt} --save-every 2 --die-rank 2 --die-step 5\n"
            f"else\n"
            f"  srun --ntasks=2 --kill-on-bad-exit=1 {sys.executable} {TRAIN} {tmp_path / 'resumed'} "
            f"--steps {STEPS} --checkpoint {ckpt} --save-every 100 --resume\n"
            f"fi")
    script = _batch_script(tmp_path / "job.sh", log, 4, body, "--requeue")
    run = cluster.run(["sbatch", "--parsable", "--wait", str(script)], timeout=300)
    assert run.returncode != 0 and "task 2: Killed" in log.read_text(), log_of(run) + log.read_text()
    job = run.stdout.strip().split(";")[0]
    before = log.read_text()
    requeue = cluster.run(["scontrol", "requeue", job])
    assert requeue.returncode == 0, log_of(requeue)
    # SLURM holds a requeued job for the step credentials' lifetime (tests/support/slurm.py sets
    # cred_expire=15 s; 120 s by default) and must: started earlier (scontrol update StartTime=now),
    # slurmd still holds the first run's revoked credential and kills the batch job ("Job credential
    # revoked"), as it did on a busy CI machine. The job may also still read FAILED, the first run's
    # end, for a moment: wait for the second run to begin, then for its end.
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE")
    deadline, began = time.monotonic() + 300, False
    while True:
        state = cluster.job_state(job)
        began = began or state not in finished or len(log.read_text()) > len(before)
        if began and state in finished:
            break
        assert time.monotonic() < deadline, f"job {job} still {state}:\n{log.read_text()}\n{cluster.logs()}"
        time.sleep(0.5)
    assert state == "COMPLETED", f"{state}\n{log.read_text()}\n{cluster.show_job(job)}\n{cluster.logs()}"
    resumed_text = log.read_text()[len(before):]
    # The uninterrupted 2-task run from the same checkpoint, for the bitwise comparison.
    plain = cluster.run(["srun", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, TRAIN, str(tmp_path / "plain"),
                         "--steps", str(STEPS), "--checkpoint", str(ckpt), "--save-every", "100", "--resume"])
    assert plain.returncode == 0, log_of(plain)
    _check_resumed(before, resumed_text, tmp_path / "resumed", tmp_path / "plain", tmp_path_factory)
