"""In-process recovery (ckpt.inprocess) with real processes: ``python -m ckpt.inprocess.launch``
starts gloo ranks on loopback (tests/inprocess_child.py); a rank SIGKILLs itself mid-training.
The survivors must keep their processes and finish bitwise equal to the run they stand for:
with a warm spare, an uninterrupted run; shrinking, a relaunch from the same step at the new size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.tiers.memory import memory_namespace
from tests.ckpt_helpers import REPO
from tests.session_cache import CleanRuns

CHILD = REPO / "tests" / "inprocess_child.py"
STEPS, KILL_AT = 10, 4
ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def launch(root: Path, events: Path, *launcher: str, child: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", *launcher, str(CHILD), "--root", str(root),
           "--events", str(events), *child]
    proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def finals(evs: list[dict]) -> dict[int, dict]:
    return {e["worker"]: e for e in evs if e["event"] == "done"}


def clean_digests(clean_runs: CleanRuns, *launcher: str, child: tuple[str, ...]) -> set[str]:
    """The digests the ranks of an uninterrupted run of this command end with (run once a session)."""
    def run(workdir: Path) -> list[str]:
        launch(workdir / "root", workdir / "events.jsonl", *launcher, child=child)
        return [e["digest"] for e in finals(events(workdir / "events.jsonl")).values()]
    return set(clean_runs.digests(["inprocess", *launcher, "--", *child], run))


def shrunk_digests(clean_runs: CleanRuns, before: int, after: int, restored: int, *extra: str) -> set[str]:
    """What a job shrunk from ``before`` to ``after`` ranks at ``restored`` must end with: a clean
    ``before``-rank run to that step, relaunched at ``after`` ranks from it (run once a session);
    ``extra``: the child's other arguments, in both runs."""
    def run(workdir: Path) -> list[str]:
        launch(workdir / "root", workdir / "a.jsonl", "--nproc", str(before), child=("--steps", str(restored), *extra))
        launch(workdir / "root", workdir / "b.jsonl", "--nproc", str(after),
               child=("--steps", str(STEPS), "--resume-step", str(restored), *extra))
        return [e["digest"] for e in finals(events(workdir / "b.jsonl")).values()]
    return set(clean_runs.digests(["shrunk", str(before), str(after), str(restored), str(STEPS), *extra], run))


def check_survivors_kept(evs: list[dict], dead: int) -> list[dict]:
    """Every worker that finished is the process that started (pid unchanged); the recoveries seen."""
    started = {e["worker"]: e["pid"] for e in evs if e["event"] == "start"}
    done = finals(evs)
    assert dead not in done and done, done
    assert all(e["pid"] == started[w] for w, e in done.items()), (started, done)
    recs = [e for e in evs if e["event"] == "recovery"]
    assert {r["worker"] for r in recs} == set(done), recs
    return recs


# extended: the same spare round, with data loaders, is test_data_loader_workers_are_rebuilt_and_rewound_with_a_spare
# (every assertion of this one too); a spare of its own node, test_inprocess_replicated's spare test
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_killed_rank_spare_takes_its_place(tmp_path, clean_runs):
    """2 ranks + 1 warm spare: rank 1 dies at step 4; the spare takes rank 1 and the job ends
    bitwise equal to an uninterrupted 2-rank run, at most the step in flight lost."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2", "--spares", "1",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "spare 2 takes rank 1" in log, log[-3000:]
    assert all(r["world_size"] == 2 for r in recs), recs
    assert all(r["failed_at_step"] - r["restored_step"] <= 1 for r in recs if r["worker"] == 0), recs
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 2: STEPS}
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean


# extended: the same shrink, with data loaders, is test_data_loader_shrinking_splits_the_rest_of_the_epoch_anew
# (every assertion of this one too)
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_killed_rank_without_spare_shrinks(tmp_path, clean_runs):
    """3 ranks, no spare: rank 1 dies at step 4; ranks 0 and 2 go on at world size 2 and end
    bitwise equal to a relaunch at 2 ranks from the step they restored (itself taken from a
    clean 3-rank run)."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "3",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "continuing at world size 2" in log, log[-3000:]
    restored = {r["restored_step"] for r in recs}
    assert {r["failed_at_step"] for r in recs} == {KILL_AT}, recs
    assert len(restored) == 1 and KILL_AT - 1 <= min(restored) <= KILL_AT, recs
    assert all(e["world"] == 2 for e in finals(evs).values())
    assert not memory_namespace(tmp_path / "a", None).exists()  # the finished job took the dead rank's slots along
    expected = shrunk_digests(clean_runs, 3, 2, min(restored))
    assert len(expected) == 1 and {e["digest"] for e in finals(evs).values()} == expected


@pytest.mark.timeout(600)
def test_a_job_that_cannot_shrink_is_relaunched_whole(tmp_path, clean_runs):
    """2 ranks, no spare, ``--min-world 2``: rank 1 dies at step 4 and the world may not shrink,
    so the launcher relaunches the job (new processes for both ranks, on keys of a second
    attempt); it restores the newest checkpoint and ends bitwise equal to an uninterrupted run."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2", "--min-world", "2",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    assert "falling back to a relaunch (attempt 1 of 1)" in log and "fewer than --min-world" in log, log[-3000:]
    evs = events(tmp_path / "a.jsonl")
    starts = {}
    for e in evs:
        if e["event"] == "start":
            starts.setdefault(e["worker"], []).append(e["pid"])
    assert {w: len(set(p)) for w, p in starts.items()} == {0: 2, 1: 2}, starts  # every rank a new process
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 1: STEPS}
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean


LOADER, LOADER_KILL_AT = ("--loader-workers", "2"), 5  # 4 steps an epoch: 5 is mid-epoch


@pytest.mark.timeout(600)
def test_data_loader_workers_are_rebuilt_and_rewound_with_a_spare(tmp_path, clean_runs):
    """2 ranks + 1 warm spare; batches come from a ResumableDataLoader with 2 worker processes
    per rank, 4 steps an epoch; rank 1 dies at step 5, mid-epoch. Each rank's loader is built
    anew and resumes from the restored position (its workers prefetch from there), the old
    workers are gone (each rank ends with its current 2), and the job ends bitwise equal to
    an uninterrupted run with the same loaders. The spare round itself as in
    test_killed_rank_spare_takes_its_place (-m extended): no relaunch, at most the step in flight lost."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2", "--spares", "1",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(LOADER_KILL_AT), *LOADER))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "spare 2 takes rank 1" in log, log[-3000:]
    assert all(r["world_size"] == 2 for r in recs), recs
    assert all(r["failed_at_step"] - r["restored_step"] <= 1 for r in recs if r["worker"] == 0), recs
    assert {w: (e["steps"], e["children"]) for w, e in finals(evs).items()} == {0: (STEPS, 2), 2: (STEPS, 2)}
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS), *LOADER))
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean


@pytest.mark.timeout(600)
def test_data_loader_shrinking_splits_the_rest_of_the_epoch_anew(tmp_path, clean_runs):
    """3 ranks, no spare, the same loaders: rank 1 dies at step 5; ranks 0 and 2 rebuild their
    loaders at world size 2 (6 samples a step each instead of 4) over what the epoch had left,
    and end bitwise equal to a relaunch at 2 ranks from the step they restored. The shrink itself
    as in test_killed_rank_without_spare_shrinks (-m extended): no relaunch, the step in flight or
    the one before restored, the dead rank's slots gone with the finished job."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "3",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(LOADER_KILL_AT), *LOADER))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "continuing at world size 2" in log, log[-3000:]
    restored = {r["restored_step"] for r in recs}
    assert {r["failed_at_step"] for r in recs} == {LOADER_KILL_AT}, recs
    assert len(restored) == 1 and LOADER_KILL_AT - 1 <= min(restored) <= LOADER_KILL_AT, recs
    assert all(e["world"] == 2 for e in finals(evs).values())
    assert not memory_namespace(tmp_path / "a", None).exists()  # the finished job took the dead rank's slots along
    assert {w: e["children"] for w, e in finals(evs).items()} == {0: 2, 2: 2}
    expected = shrunk_digests(clean_runs, 3, 2, min(restored), *LOADER)
    assert len(expected) == 1 and {e["digest"] for e in finals(evs).values()} == expected


@pytest.mark.timeout(600)
def test_predictor_node_failed_evicts_only_that_rank(tmp_path):
    """3 ranks: at step 4 the predictor listener (as wired by ``run(listener=...)``) hears
    "node_failed" for GPU 1 of this node; the launcher evicts worker 1 (its LOCAL_RANK) alone,
    where ``ckpt.resumable`` would end every rank; workers 0 and 2 keep their processes."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "3",
                 child=("--steps", "8", "--node-failed-gpu", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    check_survivors_kept(evs, dead=1)
    assert "worker 1: evicted: the predictor reports node" in log and "evicting worker 0" not in log, log[-3000:]
    assert "attempt 1" not in log and "continuing at world size 2" in log, log[-3000:]
    assert {w: (e["steps"], e["world"]) for w, e in finals(evs).items()} == {0: (8, 2), 2: (8, 2)}


@pytest.mark.timeout(600)
def test_a_predictor_alarm_makes_every_rank_save_urgently(tmp_path):
    """2 ranks saving every 100 steps: in step 3 worker 0's listener hears the predictor's
    "checkpoint now"; at the next boundary both ranks agree and save step 4 urgently (as
    ``ckpt.resumable`` does), which becomes durable, and the run goes on to its end."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2",
                 child=("--steps", "8", "--save-every", "100", "--alarm-at", "3"))
    assert log.count("urgent checkpoint at step 4") == 2, log[-3000:]  # one line per rank
    assert "urgent checkpoint of step 4 durable in every tier" in log and "urgent checkpoint at step 5" not in log
    assert {w: e["steps"] for w, e in finals(events(tmp_path / "a.jsonl")).items()} == {0: 8, 1: 8}


@pytest.mark.timeout(600)
def test_a_rank_left_behind_is_evicted_by_the_progress_deadline(tmp_path):
    """3 ranks: worker 1 stops stepping after step 4 (alive, beating: not frozen); the others
    wait for it in step 5's collective. Past ``--progress-s`` the launcher evicts it as the
    watchdog would name it ("behind"), instead of every rank exiting 86; 0 and 2 go on."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "3", "--progress-s", "2",
                 child=("--steps", "8", "--stall-worker", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    check_survivors_kept(evs, dead=1)
    assert f"worker 1: behind: at step {KILL_AT}" in log and "frozen" not in log, log[-3000:]
    assert "attempt 1" not in log and "continuing at world size 2" in log, log[-3000:]
    assert {w: (e["steps"], e["world"]) for w, e in finals(evs).items()} == {0: (8, 2), 2: (8, 2)}


def test_node_failed_maps_the_event_to_the_workers_there():
    """Only current members on the event's node (and GPU, when it names one) are evicted."""
    import torch.distributed as dist

    from ckpt.inprocess import evictions, membership

    store = membership.of_attempt(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), 0, b"k" * 32)
    membership.publish(store, membership.Membership(0, (0, 1, 2, 3), (4,), "start", 0.0))
    for w, (node, gpu) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2)]):
        evictions.announce_place(store, w, node, gpu)
    evict = evictions.on_node_failed(store)
    evict({"node": "a", "gpu": 1, "reason": "critical XID 79 on GPU 1"})
    evicted = lambda: [w for w in range(5) if store.has(membership.evict_key(w))]  # noqa: E731
    assert evicted() == [1]
    evict({"node": "b", "reason": "lost"})  # no GPU named: the whole node
    assert evicted() == [1, 2, 3]
    evict({"node": "a", "gpu": 2})  # a spare's GPU: not a member, nothing to do
    evict({"gpu": 0})  # malformed: ignored
    assert evicted() == [1, 2, 3]
    assert b"GPU 1" in store.get(membership.evict_key(1))


def test_membership_rounds_through_the_store():
    """The launcher publishes rounds; a survivor finds the newest, a spare its own; the job's end
    releases a waiter at once."""
    import torch.distributed as dist

    from ckpt.inprocess import membership

    store = membership.of_attempt(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), 0, b"k" * 32)
    first = membership.Membership(0, (0, 1, 2), (3,), "start", 0.0)
    membership.publish(store, first)
    assert membership.wait_round(store, 0, 5.0) == first and not membership.changed(store, 0)
    membership.publish(store, membership.Membership(1, (0, 3, 2), (), "worker 1 died: spare 3", 1.0))
    membership.publish(store, membership.Membership(2, (0, 3), (), "worker 2 died: shrink", 2.0))
    newest = membership.latest_after(store, 0)
    assert membership.changed(store, 0) and newest.round == 2 and newest.rank_of(3) == 1 and newest.rank_of(2) is None
    assert membership.wait_round(store, 3, 0.05) is None  # bounded
    store.put(membership.DONE_KEY, "1")
    assert membership.wait_round(store, 3, 60.0) is None


def test_a_node_launcher_that_missed_rounds_acts_on_its_part_of_the_newest(monkeypatch):
    """Each node's launcher reads its node's part of a round (its members' ranks, its spares),
    not the whole round; one that missed rounds (slow, busy) reads the newest part, which is whole
    in itself: the ranks it hands out are the newest round's. A part forged by an outsider, or
    a part of another node or round replayed under this key, is never acted on."""
    import torch.distributed as dist

    from ckpt.inprocess import membership, node
    from ckpt.inprocess.protocol import WORKER_ENV

    started: dict[int, dict[str, str]] = {}

    class Worker:  # a worker process that never exits: the environment it was started with
        def __init__(self, _cmd, env):
            self.pid, started[int(env[WORKER_ENV])] = os.getpid(), env

        def poll(self):
            return None

    monkeypatch.setattr(node.subprocess, "Popen", Worker)
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = membership.of_attempt(raw, 0, b"k" * 32)
    hosts = {w: w // 3 for w in range(6)}  # 2 nodes: members 0, 1 and spare 2; members 3, 4 and spare 5
    publish = lambda r, members, spares: membership.publish(  # noqa: E731
        store, membership.Membership(r, members, spares, "test", 0.0), hosts, 2)
    publish(0, (0, 1, 3, 4), (2, 5))
    one = node.NodeLauncher(store, 1, master=("127.0.0.1", raw.port), command=["w"], attempt=0, hang_s=60.0,
                            progress_s=None)
    assert one.here == [3, 4] and {w: started[w]["RANK"] for w in (3, 4, 5)} == {3: "2", 4: "3", 5: "-1"}
    assert started[3]["WORLD_SIZE"] == "4"
    publish(1, (0, 2, 3, 4), (5,))  # worker 1 died: node 0's spare takes rank 1
    publish(2, (0, 2, 4), (5,))  # then worker 3 died with no spare ready: the world shrinks
    hosts[6] = 1  # the pool topped up on node 1
    publish(3, (0, 2, 4), (5, 6))
    assert membership.wait_round(store, 3, 0.0, 1) == membership.NodeRound(3, ((4, 2),), (5, 6), 3)
    assert membership.wait_round(store, 3, 0.0, 0).members == ((0, 0), (2, 1))
    one.poll()  # rounds 1 to 3 at once, from round 3's part alone
    assert one.current.round == 3 and one.here == [4] and sorted(started) == [3, 4, 5, 6]
    assert started[6]["RANK"] == "-1"
    for replayed in (membership.node_round_key(3, 1), membership.node_round_key(3, 0)):  # another round's, node's
        raw.set(membership.node_round_key(4, 1), raw.get(replayed))
        assert membership.latest_after(store, 3, 1) is None
    one.poll()
    assert one.current.round == 3 and store.rejected == 2 and sorted(started) == [3, 4, 5, 6]


def test_leaving_a_group_frees_it_and_a_new_round_joins():
    """``group.leave`` forgets the groups at once (no teardown wait) and shuts them down in the
    background; the next round's group forms on the same store."""
    import torch
    import torch.distributed as dist

    from ckpt.inprocess import group
    from tests.procs import wait_for

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group.join(store, 0, 0, 1, 30.0)
    side = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(1), group=side)
    group.leave()
    assert not dist.is_initialized()
    assert wait_for(lambda: group.leaked() == 0, timeout=60)
    group.join(store, 1, 0, 1, 30.0)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    group.leave()


def test_a_sticky_device_error_is_never_resumed_in_place():
    from ckpt.inprocess.runner import _must_leave

    assert _must_leave(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert _must_leave(RuntimeError("CUDA error: GPU has fallen off the bus"))
    assert _must_leave(RuntimeError("CUDA error: device-side assert triggered"))
    assert _must_leave(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert not _must_leave(RuntimeError("CUDA error: out of memory"))
    assert not _must_leave(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))


PEER_IN_A_COLLECTIVE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from ckpt.inprocess import group
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=300))
store.set("connected", "1")
group.join(store, 0, 1, 2, 300.0)
dist.all_reduce(torch.ones(1))
store.set("entering", "1")
try:
    dist.all_reduce(torch.ones(1))  # rank 0 leaves instead of joining it
    print("returned")
except RuntimeError as e:
    print("failed:", e)
"""


@pytest.mark.timeout(600)
def test_leaving_closes_the_connections_a_peer_in_a_collective_waits_on():
    """A survivor that sees a new round before its next step leaves while another is already in
    that step's collective: leaving closes this rank's side of the group's connections, so the
    other's collective fails at once ("Connection closed by peer") instead of waiting out the
    collective timeout (300 s here). Freeing the group closes them too, but the last round's
    objects (a DDP model) may still hold it, and gloo's shutdown and abort leave them open."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ckpt.inprocess import group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    peer = subprocess.Popen([sys.executable, "-c", PEER_IN_A_COLLECTIVE, str(store.port)], cwd=REPO,
                            env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        store.wait(["connected"])  # its store connection is not one of the group's
        group.join(store, 0, 0, 2, 300.0)
        dist.all_reduce(torch.ones(1))
        held = dist.group.WORLD  # as the last round's DDP model or optimizer would hold it
        store.wait(["entering"])
        group.leave()
        out, _ = peer.communicate(timeout=500)
    finally:
        peer.kill()
    del held
    assert "failed:" in out and "Connection closed by peer" in out, out[-2000:]
