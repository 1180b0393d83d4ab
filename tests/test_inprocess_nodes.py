"""In-process recovery across two simulated nodes on loopback (tests/inprocess_nodes.py): node 1
is lost mid-training (its launcher SIGKILLed, its workers dying with it, its memory dir and disk
root wiped). Node 0's workers must keep their processes, restore the lost ranks' shards from the
peer replicas node 0 holds (``--peers 1``: node 1's memory and disk are gone) and finish bitwise
equal to the run they stand for."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from tests.inprocess_nodes import lose_node_1
from tests.test_inprocess import STEPS, events, finals, launch

LOST_AT = 4


def check_node_0_kept(lost, node0: set[int]) -> list[dict]:
    """Node 0's workers finished in the processes that started; node 1's died with their launcher."""
    started = {e["worker"]: e["pid"] for e in lost.events if e["event"] == "start"}
    done = finals(lost.events)
    assert set(done) == node0, done
    assert all(e["pid"] == started[w] for w, e in done.items()), (started, done)
    assert lost.node1_workers_gone
    assert "node 1 lost" in lost.log and "attempt 1" not in lost.log, lost.log[-3000:]
    recs = [e for e in lost.events if e["event"] == "recovery"]
    assert {r["worker"] for r in recs} == node0 and len({r["restored_step"] for r in recs}) == 1, recs
    return recs


def restored_from_peers(log: str, step: int, lost_ranks: list[int]) -> bool:
    """The survivors' restore lines name the peer replicas, and nothing else, as the source of
    every lost rank's shard (each survivor reads only the shards it needs)."""
    lines = re.findall(rf"rank \d+ restored step {step} \((.*?)\)", log)
    sources = {(int(r), tier) for line in lines for r, tier in re.findall(r"shard (\d+) from ([\w-]+)", line)}
    return {r for r, tier in sources if r in lost_ranks} == set(lost_ranks) and all(
        tier == "peer" for r, tier in sources if r in lost_ranks)


@pytest.mark.timeout(900)
def test_lost_node_shrinks_restoring_from_peer_replicas(tmp_path):
    """2 nodes x 2 ranks, no spare: node 1 (ranks 2, 3) is lost past step 4; ranks 0 and 1 go on
    at world size 2 and end bitwise equal to a relaunch at 2 ranks from the step they restored
    (itself taken from a clean 4-rank run)."""
    with tempfile.TemporaryDirectory(prefix="inprocess-nodes-", dir="/dev/shm") as shm:
        lost = lose_node_1(tmp_path / "a", Path(shm), ["--nproc", "2"], ["--steps", str(STEPS), "--peers", "1"],
                           at_step=LOST_AT, hang_s=3.0)
    recs = check_node_0_kept(lost, {0, 1})
    assert "continuing at world size 2" in lost.log, lost.log[-3000:]
    assert all(r["world_size"] == 2 for r in recs) and all(e["world"] == 2 for e in finals(lost.events).values())
    restored = recs[0]["restored_step"]
    assert restored_from_peers(lost.log, restored, [2, 3]), lost.log[-3000:]
    ref = tmp_path / "ref"
    launch(ref, tmp_path / "ref4.jsonl", "--nproc", "4", child=("--steps", str(restored)))
    launch(ref, tmp_path / "ref2.jsonl", "--nproc", "2", child=("--steps", str(STEPS), "--resume-step", str(restored)))
    expected = {e["digest"] for e in finals(events(tmp_path / "ref2.jsonl")).values()}
    assert len(expected) == 1 and {e["digest"] for e in finals(lost.events).values()} == expected


@pytest.mark.timeout(900)
def test_lost_node_a_spare_on_node_0_takes_its_rank(tmp_path):
    """2 nodes x (1 rank + 1 spare): node 1 (rank 1 and its spare) is lost past step 4; node 0's
    spare takes rank 1 (node 1's spare leaves the pool) and the job ends bitwise equal to an
    uninterrupted 2-rank run."""
    with tempfile.TemporaryDirectory(prefix="inprocess-nodes-", dir="/dev/shm") as shm:
        lost = lose_node_1(tmp_path / "a", Path(shm), ["--nproc", "1", "--spares", "1"],
                           ["--steps", str(STEPS), "--peers", "1"], at_step=LOST_AT, hang_s=3.0)
    recs = check_node_0_kept(lost, {0, 1})
    assert "spare 1 takes rank 1" in lost.log, lost.log[-3000:]
    assert all(r["world_size"] == 2 for r in recs), recs
    assert restored_from_peers(lost.log, recs[0]["restored_step"], [1]), lost.log[-3000:]
    launch(tmp_path / "clean", tmp_path / "clean.jsonl", "--nproc", "2", child=("--steps", str(STEPS)))
    clean = {e["digest"] for e in finals(events(tmp_path / "clean.jsonl")).values()}
    assert len(clean) == 1 and {e["digest"] for e in finals(lost.events).values()} == clean
