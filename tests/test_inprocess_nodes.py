"""In-process recovery across two simulated nodes on loopback (tests/inprocess_nodes.py): node 1
is lost mid-training (its launcher SIGKILLed, its workers dying with it, or all of them stopped
as if the host vanished; its memory dir and disk root wiped). Node 0's workers must keep their
processes, restore the lost ranks' shards from what survives off node 1 (the peer replicas node 0
holds with ``--peers 1``; else the job's shared object store) and finish bitwise equal to the run
they stand for."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.inprocess_nodes import lose_node_1, lost_shard_sources, run_nodes
from tests.session_cache import CleanRuns
from tests.test_inprocess import STEPS, clean_digests, finals, shrunk_digests

LOST_AT = 4
# half a second a step: the job is still training when node 1 is lost, however late a busy
# machine lets this process see step LOST_AT (it saw it once with every step done)
PACED = ["--step-s", "0.5"]
# the launcher's default: a busy machine can starve a live node launcher's beats for seconds
# (3 s here took a live node for a lost one at load 10); a launcher that dies is noticed by its
# lifeline whatever this is, a vanished node after it
HANG_S = 10.0


def check_node_0_kept(lost, node0: set[int], how: str = "its launcher's lifeline closed") -> list[dict]:
    """Node 0's workers finished in the processes that started; node 1's died with their launcher,
    which the job launcher saw as ``how``."""
    started = {e["worker"]: e["pid"] for e in lost.events if e["event"] == "start"}
    done = finals(lost.events)
    assert set(done) == node0, done
    assert all(e["pid"] == started[w] for w, e in done.items()), (started, done)
    assert lost.node1_workers_gone
    assert f"node 1 lost ({how}" in lost.log and "attempt 1" not in lost.log, lost.log[-3000:]
    recs = [e for e in lost.events if e["event"] == "recovery"]
    assert {r["worker"] for r in recs} == node0 and len({r["restored_step"] for r in recs}) == 1, recs
    return recs


def restored_from(tier: str, log: str, step: int, lost_ranks: list[int]) -> bool:
    """The survivors restored every lost rank's shard from ``tier``, and from nothing else."""
    return all(tiers == {tier} for tiers in lost_shard_sources(log, step, lost_ranks).values())


def shrinks_to_2(tmp_path: Path, clean_runs: CleanRuns, *, silent: bool, tier: str) -> None:
    """2 nodes x 2 ranks, no spare, with peer replicas (``tier`` "peer") or a shared object store
    ("object"): node 1 (ranks 2, 3) is lost past step 4; ranks 0 and 1 go on at world size 2, read
    ranks 2 and 3's shards from that tier (the object store: a step it committed, older than the
    newest in node 0's memory) and end bitwise equal to a relaunch at 2 ranks from the step they
    restored (itself taken from a clean 4-rank run)."""
    where = ["--peers", "1"] if tier == "peer" else ["--object-store", f"file://{tmp_path / 'objstore'}"]
    with tempfile.TemporaryDirectory(prefix="inprocess-nodes-", dir="/dev/shm") as shm:
        lost = lose_node_1(tmp_path / "a", Path(shm), ["--nproc", "2"],
                           ["--steps", str(STEPS), *where, *PACED], at_step=LOST_AT, hang_s=HANG_S, silent=silent)
    recs = check_node_0_kept(lost, {0, 1}, **({"how": "no beat for"} if silent else {}))
    assert "continuing at world size 2" in lost.log, lost.log[-3000:]
    assert all(r["world_size"] == 2 for r in recs) and all(e["world"] == 2 for e in finals(lost.events).values())
    restored = recs[0]["restored_step"]
    assert restored_from(tier, lost.log, restored, [2, 3]), lost.log[-3000:]
    expected = shrunk_digests(clean_runs, 4, 2, restored)
    assert len(expected) == 1 and {e["digest"] for e in finals(lost.events).values()} == expected


@pytest.mark.timeout(900)
def test_lost_node_shrinks_restoring_from_the_object_store(tmp_path, clean_runs):
    """Node 1's launcher killed: its lifeline closes, the node is lost at once."""
    shrinks_to_2(tmp_path, clean_runs, silent=False, tier="object")


def spare_takes_rank_1(tmp_path: Path, clean_runs: CleanRuns, *, silent: bool) -> None:
    """2 nodes x (1 rank + 1 spare), peer replicas on: node 1 (rank 1 and its spare) is lost past
    step 4; node 0's spare takes rank 1 (node 1's spare leaves the pool), reads rank 1's state from
    node 0's memory, and the job ends bitwise equal to an uninterrupted 2-rank run. That state is all
    replicated (model and optimizer): rank 1's shard from the replica node 0 holds when it holds
    that step's, else rank 0's shard from its slot (tests/test_inprocess_replicated.py), nothing else."""
    with tempfile.TemporaryDirectory(prefix="inprocess-nodes-", dir="/dev/shm") as shm:
        lost = lose_node_1(tmp_path / "a", Path(shm), ["--nproc", "1", "--spares", "1"],
                           ["--steps", str(STEPS), "--peers", "1", *PACED], at_step=LOST_AT, hang_s=HANG_S,
                           silent=silent)
    recs = check_node_0_kept(lost, {0, 1}, **({"how": "no beat for"} if silent else {}))
    assert "spare 1 takes rank 1" in lost.log, lost.log[-3000:]
    assert all(r["world_size"] == 2 for r in recs), recs
    assert lost_shard_sources(lost.log, recs[0]["restored_step"], [1])[1] <= {"peer"}, lost.log[-3000:]
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in finals(lost.events).values()} == clean


# extended: the spare's part is test_a_silent_node_holding_replicas_holds_nothing_up's (the same
# assertions), a killed launcher's lifeline test_lost_node_shrinks_restoring_from_the_object_store's
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_lost_node_a_spare_on_node_0_takes_its_rank(tmp_path, clean_runs):
    """Node 1's launcher killed: its lifeline closes, the node is lost at once."""
    spare_takes_rank_1(tmp_path, clean_runs, silent=False)


@pytest.mark.timeout(900)
def test_a_node_that_goes_silent_is_lost_after_hang_s(tmp_path, clean_runs):
    """Node 1's launcher and workers stopped, not killed (a host that vanished: its lifeline and
    its sockets stay open): the job launcher loses the node once its beats have been missing for
    ``--hang-s``; node 0's ranks, blocked in a collective with a stopped peer, are cut loose
    (``group.interrupt``) and go on at world size 2, the two lost ranks' shards read from the
    replicas node 0 holds (one step common to both)."""
    shrinks_to_2(tmp_path, clean_runs, silent=True, tier="peer")


@pytest.mark.timeout(900)
def test_a_silent_node_holding_replicas_holds_nothing_up(tmp_path, clean_runs):
    """Node 1 stopped, not killed: node 0's rank was sending its replica to node 1's stopped
    holder; leaving the round cuts that send off (``Replicator.abort``) instead of waiting out the
    peer timeout."""
    spare_takes_rank_1(tmp_path, clean_runs, silent=True)


@pytest.mark.timeout(900)
def test_a_job_that_cannot_shrink_is_relaunched_on_every_node(tmp_path, clean_runs):
    """2 nodes x 1 rank, no spare, ``--min-world 2``: rank 1 (node 1) dies at step 4 and the world
    may not shrink, so the job launcher relaunches the job and node 1's launcher takes part in the
    second attempt: both ranks restart in new processes, restore the newest step from their own
    node and end bitwise equal to an uninterrupted 2-rank run."""
    with tempfile.TemporaryDirectory(prefix="inprocess-nodes-", dir="/dev/shm") as shm:
        evs, logs = run_nodes(tmp_path / "a", Path(shm), ["--nproc", "1", "--min-world", "2", "--hang-s", str(HANG_S)],
                              ["--steps", str(STEPS), "--kill-worker", "1", "--kill-at", "4"])
    assert "falling back to a relaunch (attempt 1 of 1)" in logs[0], logs[0][-3000:]
    assert "the job is launched again (attempt 1)" in logs[1], logs[1][-3000:]
    starts: dict[int, set[int]] = {}
    for e in evs:
        if e["event"] == "start":
            starts.setdefault(e["worker"], set()).add(e["pid"])
    assert {w: len(p) for w, p in starts.items()} == {0: 2, 1: 2}, starts
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 1: STEPS}
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean

