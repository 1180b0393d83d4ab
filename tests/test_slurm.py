"""examples/slurm/train.sbatch on a real Slurm (tests/slurm_fixtures.py): a 2-task job
(two torchrun agents meeting by c10d rendezvous, one rank each) preempted both ways ends
with the weights of an uninterrupted run.

- The time limit's warning: `--signal=B:USR1@120` sends USR1 to the batch shell alone
  (`scancel --batch --signal=USR1` delivers exactly that, without waiting for a limit);
  the script turns it into SIGTERM for the ranks, waits for their save, requeues itself.
- Preemption / `scontrol requeue`: Slurm sends SIGTERM to every process of the job and
  requeues it.
A requeued job waits ~120 s (BeginTime) unless its StartTime is set to now, as here, in a
later second than its requeue (start_again).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.procs import wait_for
from tests.slurm_fixtures import SlurmCluster

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS = 40


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, work: Path) -> str:
    work.mkdir(mode=0o755)
    env = {"CKPT_ROOT": str(work / "ckpt"), "NPROC_PER_NODE": "1", "PYTHONPATH": str(REPO),
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run", "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1"}
    out = slurm.run("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--output={work / 'job.log'}",
                    f"--chdir={work}", str(SBATCH), str(REPO / "examples" / "train_torchrun.py"),
                    "--root", str(work / "ckpt"), "--memory-dir", str(work / "shm"), "--steps", str(STEPS),
                    "--every", "5", "--step-time", "0.3", "--timeline", str(work / "timeline.jsonl"),
                    "--out", str(work / "out.json"), env=env)
    return out.stdout.strip().split(";")[0]


def start_again(slurm: SlurmCluster, job_id: str) -> None:
    """StartTime=now for a requeued job seen PENDING, set in a later second than its requeue.

    slurmd revokes the old incarnation's credential at the requeue with a time in whole
    seconds and refuses a credential issued in that same second ("Job N already killed, do
    not launch batch job"; slurmctld: "Killing non-startable batch JobId=N: Job credential
    revoked"): the job ends FAILED instead of running again. Slurm's own hold (BeginTime,
    AuthInfo cred_expire, 120 s) is what normally keeps the two apart. The requeue came before
    the job was seen PENDING, so a start in any second after now is a later one."""
    time.sleep(1.05 - time.time() % 1)
    slurm.scontrol("update", f"JobId={job_id}", "StartTime=now")


def steps_done(work: Path) -> int:
    timeline = work / "timeline.jsonl"
    return len(timeline.read_text().splitlines()) if timeline.exists() else 0


def test_preempted_job_resumes_bitwise(slurm: SlurmCluster) -> None:
    base = Path(slurm.dir) / "jobs"
    base.mkdir(mode=0o755)
    jobs = {name: submit(slurm, base / name) for name in ("uninterrupted", "time_limit", "requeue")}
    assert wait_for(lambda: all(steps_done(base / n) >= 10 for n in ("time_limit", "requeue")), timeout=180,
                    interval=0.2), {n: slurm.job(j) for n, j in jobs.items()}
    slurm.run("scancel", "--batch", "--signal=USR1", jobs["time_limit"])
    slurm.scontrol("requeue", jobs["requeue"])
    for name in ("time_limit", "requeue"):
        pending = slurm.wait_state(jobs[name], {"PENDING"})
        # held until its begin time; the reason reads "None" until the scheduler's next pass sets
        # it (a busy machine sees that)
        assert pending["Restarts"] == "1" and pending["Reason"] in ("BeginTime", "None"), pending
        start_again(slurm, jobs[name])
    done = {name: slurm.wait_state(j, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=240)
            for name, j in jobs.items()}
    logs = {name: (base / name / "job.log").read_text() for name in jobs}
    for name, info in done.items():
        assert info["JobState"] == "COMPLETED", (info, logs[name][-4000:])
    results = {name: json.loads((base / name / "out.json").read_text()) for name in jobs}
    assert results["uninterrupted"]["first_step"] == 0
    for name in ("time_limit", "requeue"):
        log = logs[name]
        assert "preempted: step" in log and "is durable; exiting" in log, log[-4000:]
        assert results[name]["first_step"] >= 10, results[name]   # resumed, not restarted from 0
        assert results[name]["digest"] == results["uninterrupted"]["digest"], log[-4000:]
    assert "time limit near (USR1)" in logs["time_limit"]
    assert "SIGTERM (preemption or requeue)" in logs["requeue"]
