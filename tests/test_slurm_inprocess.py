"""examples/slurm/inprocess.sbatch on a real Slurm (tests/slurm_fixtures.py). One slurmd has no
spare node and cannot lose one, so nodes are simulated as tasks of one step (`srun -n3`, each
task a node launcher with its own CKPT_GUARD_NODE, memory dir and disk root; SIMULATED_NODES=1),
the last one a spare node. A worker killed: the spare node's worker takes its rank in process.
A node launcher killed (the task dies; `--no-kill --kill-on-bad-exit=0` keep the step): its
rank is replaced from the spare node. Both end bitwise equal to a clean 2-rank run; a real node
going DOWN is not tested here (docs/slurm.md)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.procs import free_port, wait_for
from tests.slurm_fixtures import SlurmCluster
from tests.test_inprocess import CHILD, STEPS, clean_digests, finals

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "inprocess.sbatch"
FAULT_AT = 4


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, work: Path, *child: str) -> str:
    work.mkdir(mode=0o755, parents=True)
    env = {"NPROC_PER_NODE": "1", "SPARE_NODES": "1", "SIMULATED_NODES": "1", "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PORT": str(free_port()),
           "CKPT_SECRET_DIR": str(work / "secrets")}
    out = slurm.run("sbatch", "--parsable", "--nodes=1", "--ntasks=3", "--ntasks-per-node=3",
                    f"--output={work / 'job.log'}", f"--chdir={REPO}", str(SBATCH), str(CHILD),
                    "--root", str(work / "{node}" / "ckpt"), "--memory-dir", str(work / "{node}" / "shm"),
                    "--events", str(work / "events.jsonl"), "--steps", str(STEPS), "--peers", "1",
                    "--step-s", "0.5", *child, env=env)
    return out.stdout.strip().split(";")[0]


def events(work: Path) -> list[dict]:
    path = work / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_killed_worker_and_a_killed_node_launcher_are_replaced_from_the_spare_node(slurm, tmp_path, clean_runs):
    base = Path(slurm.dir) / "inprocess"
    worker = submit(slurm, base / "worker", "--kill-worker", "1", "--kill-at", str(FAULT_AT))
    node = submit(slurm, base / "node")

    def node_1_may_go() -> bool:  # worker 0 past FAULT_AT, the spare node's worker warm
        evs = events(base / "node")
        return any(e["event"] == "warm" for e in evs) and any(
            e["event"] == "step" and e["worker"] == 0 and e["step"] >= FAULT_AT for e in evs)

    assert wait_for(node_1_may_go, timeout=300, interval=0.1), slurm.job(node)
    time.sleep(0.5)  # the spare's ready mark follows its warm-up
    [w1] = [e["pid"] for e in events(base / "node") if e["event"] == "start" and e["worker"] == 1]
    launcher_1 = int(Path(f"/proc/{w1}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(launcher_1, signal.SIGKILL)
    done = {name: slurm.wait_state(j, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
            for name, j in (("worker", worker), ("node", node))}
    logs = {name: (base / name / "job.log").read_text() for name in done}
    assert done["worker"]["JobState"] == "COMPLETED", (done["worker"], logs["worker"][-4000:])
    assert "spare 2 takes rank 1" in logs["worker"] and "attempt 1" not in logs["worker"], logs["worker"][-4000:]
    # the lost task makes the step's (and so the job's) exit code non-zero: training went on
    assert "node 1 lost (its launcher's lifeline closed" in logs["node"], logs["node"][-4000:]
    assert "spare 2 takes rank 1" in logs["node"] and "attempt 1" not in logs["node"], logs["node"][-4000:]
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    for name in done:
        ended = finals(events(base / name))
        assert {w: e["steps"] for w, e in ended.items()} == {0: STEPS, 2: STEPS}, (name, logs[name][-3000:])
        assert {e["digest"] for e in ended.values()} == clean, name
        assert not list((base / name / "secrets").iterdir())  # the job's secret left with it
