"""Replicated state needs no peers (issue 50 point 5): under DDP every rank holds the model and
optimizer (``replicated=``), but only the first rank of each volume stores them, so a rank that
lost its node (its memory and disk) may find no copy of them in any tier it reads. Without peer
replicas or an object store, the survivors still have them: read from a survivor's memory slot
on the node, else sent from a survivor's live state (``ckpt/restore/share.py``); in process and
after a relaunch, bitwise equal to a clean run. Real launchers, gloo, no peers."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from tests.inprocess_nodes import lose_node_1
from tests.integration_helpers import torchrun
from tests.test_inprocess import CHILD, KILL_AT, STEPS, clean_digests, events, finals, launch


@pytest.fixture
def clean(clean_runs) -> set[str]:
    """The digest of an uninterrupted 2-rank run (run once a session)."""
    digests = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(digests) == 1
    return digests


@pytest.fixture
def shm():
    with tempfile.TemporaryDirectory(prefix="inprocess-replicated-", dir="/dev/shm") as d:
        yield Path(d)


@pytest.mark.timeout(600)
def test_a_spare_gets_the_replicated_state_sent_by_a_survivor(tmp_path, shm, clean):
    """2 ranks + 1 spare, each worker its own disk and memory (a node of its own); rank 1 dies
    with its node's memory and disk. The spare, on a node of its own, reads no copy of anything:
    rank 0 sends it the model and optimizer, in process, and the run ends bitwise equal."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2", "--spares", "1",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT), "--own-dirs",
                        "--memory-dir", str(shm)))
    assert "spare 2 takes rank 1" in log and "attempt 1" not in log, log[-3000:]
    assert re.search(r"rank 1 restored step \d+ \(model, optim from rank 0\)", log), log[-3000:]
    evs = events(tmp_path / "a.jsonl")
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 2: STEPS}
    assert {e["digest"] for e in finals(evs).values()} == clean


@pytest.mark.timeout(600)
def test_after_a_relaunch_the_replicated_state_comes_from_a_survivor(tmp_path, shm, clean):
    """The same script under plain torchrun (relaunch on a fault): rank 1 dies with its own
    memory and disk; after torchrun's restart it has nothing, rank 0 restores the newest step
    from memory and sends it the replicated state."""
    log = torchrun(CHILD, "--root", str(tmp_path / "t"), "--events", str(tmp_path / "t.jsonl"), "--steps", str(STEPS),
                   "--kill-worker", "1", "--kill-at", str(KILL_AT), "--own-dirs", "--memory-dir", str(shm), restarts=1)
    assert f"rank 1 restored step {KILL_AT} (model, optim from rank 0)" in log, log[-3000:]
    evs = events(tmp_path / "t.jsonl")
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 1: STEPS}
    assert {e["digest"] for e in finals(evs).values()} == clean


@pytest.mark.timeout(900)
def test_a_lost_node_without_peers_is_replaced_from_a_survivors_slot(tmp_path, shm, clean):
    """2 simulated nodes x (1 rank + 1 spare), no peer replicas, no object store: node 1 (rank 1,
    the holder of its volume's replicated keys) is lost; node 0's spare takes rank 1 and reads the
    model and optimizer from rank 0's memory slot on node 0 (its own shard held nothing else)."""
    lost = lose_node_1(tmp_path / "a", shm, ["--nproc", "1", "--spares", "1", "--relaunches", "0"],
                       ["--steps", str(STEPS), "--step-s", "0.5"], at_step=4, hang_s=10.0)
    assert "spare 1 takes rank 1" in lost.log and "attempt 1" not in lost.log, lost.log[-3000:]
    recs = [e for e in lost.events if e["event"] == "recovery"]
    assert len({r["restored_step"] for r in recs}) == 1, recs
    assert re.search(r"rank 1 restored step \d+ \(shard 0 from memory\)", lost.log), lost.log[-3000:]
    assert {e["digest"] for e in finals(lost.events).values()} == clean


@pytest.mark.timeout(900)
def test_state_of_its_own_lost_with_its_node_is_named_in_the_launchers_last_line(tmp_path, shm):
    """As above, but each rank's data loader position is its own state (not replicated): rank 1's
    is nowhere off node 1, so the spare cannot take its place; the job fails, and the launcher's
    last line says which rank read no copy of its shard, not only that a worker asked for a relaunch."""
    with pytest.raises(AssertionError) as failed:
        lose_node_1(tmp_path / "a", shm, ["--nproc", "1", "--spares", "1", "--relaunches", "0"],
                    ["--steps", str(STEPS), "--step-s", "0.5", "--loader-workers", "0"], at_step=4, hang_s=10.0)
    lines = [line for line in str(failed.value).splitlines() if "ckpt.inprocess.launch" in line]
    assert re.search(r"the job failed: worker \d asked for a relaunch: rank \d cannot restore: ", lines[-1]), lines[-3:]
    assert "rank(s) 1 read no copy of their own shard" in lines[-1], lines[-1]
