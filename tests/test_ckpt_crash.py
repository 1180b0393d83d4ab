"""Crash consistency: a trainer saving in a loop is SIGKILLed (at random moments, and at
exact points of the snapshot, the drain and the renames), and each time the next
process restores a complete checkpoint bitwise equal to one the trainer saved.

The trainers are real processes forked by tests/crash_child.py; see its docstring
for the fault-injection points.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpt import CheckpointManager
from ckpt.errors import CheckpointError, DamagedCheckpoint
from ckpt.restore.execute import read_shard
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.memory import MemoryTier, memory_namespace, sweep_orphans
from tests.ckpt_helpers import CrashServer, assert_same, disk_steps, leftovers, restored, step_state, steps_logged

# Where a trainer is killed, by the point of the save it is in.
FAULT_POINTS = {
    "snapshot-mid-copy": {"call": "copy", "when": "half"},
    "snapshot-after-unseal": {"call": "unlink", "match": "/slot-", "when": "after"},
    "seal-before-rename": {"call": "rename", "match": "/slot-", "when": "before"},
    "seal-after-rename": {"call": "rename", "match": "/slot-", "when": "after"},
    "drain-mid-data-write": {"call": "pwrite", "match": ".bin.tmp", "when": "half"},
    "drain-before-data-fsync": {"call": "fsync", "match": ".bin.tmp", "when": "before"},
    "rename-data-before": {"call": "rename", "match": ".bin.tmp", "when": "before"},
    "rename-data-after": {"call": "rename", "match": ".bin.tmp", "when": "after"},
    "rename-shard-manifest-before": {"call": "rename", "match": "rank-00000.json.tmp", "when": "before"},
    "rename-shard-manifest-after": {"call": "rename", "match": "rank-00000.json.tmp", "when": "after"},
    "commit-before-rename": {"call": "rename", "match": "manifest.json.tmp", "when": "before"},
    "commit-after-rename": {"call": "rename", "match": "manifest.json.tmp", "when": "after"},
    "retention-mid-delete": {"call": "unlink", "match": "/manifest.json", "when": "after"},
}


def check_recovery(root: Path, shm: str, report: dict, newest_before: int | None) -> int | None:
    """What a restarted trainer must find after a kill; returns the step restored."""
    called = steps_logged(report["events"], "saving")
    returned = steps_logged(report["events"], "saved")
    with CheckpointManager(root, memory_dir=shm) as mgr:
        assert leftovers(root, shm) == [], "start-up must remove what the killed save left"
        # Every copy in every tier is complete and holds exactly what was saved for its step.
        for tier in mgr.tiers:
            for info in tier.list():
                assert info.complete, f"a crash left a damaged commit: {info}"
                assert_same(read_shard(tier, info.id, 0), step_state(info.id.step), f"{tier.name} step {info.id.step}")
        step, state = restored(mgr)
    assert step is not None or (newest_before is None and not returned), "a saved step was lost"
    if step is not None:
        assert_same(state, step_state(step))
        # Never older than the last save() that returned (the memory tier has it), never
        # newer than the last save() that was called.
        assert step >= max(returned + [newest_before or 0]), (step, returned[-3:], report)
        assert step <= max(called + [newest_before or 0]), (step, called[-3:], report)
    return step


def test_sigkill_at_each_point_of_a_save_leaves_the_newest_saved_step_restorable(
        crash_server: CrashServer, root: Path, shm_dir: str) -> None:
    rng = random.Random(1234)
    newest = None
    kills = 0
    for nth in (1, 3):
        for name, fault in FAULT_POINTS.items():
            report = crash_server.run(root=str(root), shm=shm_dir, keep_last=2, seed=rng.random(), pause=0.005,
                                      fault={**fault, "nth": nth}, kill_after=60)
            assert report["killed_by"] == "self" and report["signal"] == 9, (name, report)
            assert any(e.startswith("fault ") for e in report["events"]), (name, report)
            newest = check_recovery(root, shm_dir, report, newest)
            kills += 1
    assert kills >= 26 and newest is not None and newest > 5


def test_sigkill_at_random_moments_never_yields_a_torn_checkpoint(
        crash_server: CrashServer, root: Path, shm_dir: str) -> None:
    rng = random.Random(99)
    newest = None
    for _ in range(16):
        report = crash_server.run(root=str(root), shm=shm_dir, keep_last=2, seed=rng.random(),
                                  pause=rng.choice([0, 0.003, 0.02]), kill_after=rng.uniform(0.05, 0.6))
        assert report["killed_by"] == "parent" and report["signal"] == 9, report
        newest = check_recovery(root, shm_dir, report, newest)
    assert newest is not None


def test_killed_trainer_restores_from_memory_when_the_disk_drain_never_ran(
        crash_server: CrashServer, root: Path, shm_dir: str) -> None:
    # The drain thread is parked at its first data write: nothing ever reaches the disk.
    report = crash_server.run(root=str(root), shm=shm_dir, steps=2, hang_at_end=True, kill_on_event="saved 2",
                              fault={"call": "pwrite", "match": ".bin.tmp", "when": "before", "action": "hang"})
    assert report["killed_by"] == "parent", report
    assert disk_steps(root) == []
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert [(r["step"], r["tiers"]) for r in mgr.list()] == [(1, ["memory"]), (2, ["memory"])]
        step, state = restored(mgr)
    assert step == 2
    assert_same(state, step_state(2))


def test_leftovers_of_a_killed_drain_are_removed_at_start_up(
        crash_server: CrashServer, root: Path, shm_dir: str) -> None:
    crash_server.run(root=str(root), shm=shm_dir, steps=3)  # steps 1..3 durable (1: verified, kept)
    report = crash_server.run(root=str(root), shm=shm_dir,
                              fault={"call": "pwrite", "match": ".bin.tmp", "when": "half"})
    assert report["killed_by"] == "self"
    assert leftovers(root) == ["step-000000000004.g0", "step-000000000004.g0/rank-00000.bin.tmp"
                               + str(report["pid"])]
    with CheckpointManager(root, memory_dir=shm_dir):
        assert leftovers(root) == []
        assert disk_steps(root) == [(0, 1), (0, 2), (0, 3)]


def test_second_manager_on_the_same_root_and_run_is_refused_while_the_first_lives(
        crash_server: CrashServer, root: Path, shm_dir: str, tmp_path: Path) -> None:
    # The holder is another live process, parked after its save; the zygote SIGKILLs it
    # once this test has appended "probed" to its log.
    events = tmp_path / "holder.log"
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(crash_server.run, root=str(root), shm=shm_dir, steps=1, hang_at_end=True,
                             events=str(events), kill_on_event="probed")
        deadline = time.monotonic() + 30
        while "durable" not in (events.read_text() if events.exists() else ""):
            assert time.monotonic() < deadline and not holder.done(), "the holder never finished its save"
            time.sleep(0.01)
        try:
            with pytest.raises(CheckpointError, match="in use by another live process"):
                CheckpointManager(root, memory_dir=shm_dir)
            with pytest.raises(CheckpointError, match="belongs to run 'default'"):
                CheckpointManager(root, memory_dir=shm_dir, run="other-job")  # would mix up their checkpoints
        finally:
            with open(events, "a") as f:
                f.write("probed\n")
        assert holder.result()["killed_by"] == "parent"
    # After the SIGKILL the kernel dropped the lock: a restarted trainer gets in.
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert restored(mgr)[0] == 1


def test_reading_the_slots_of_a_live_trainer_never_returns_a_torn_checkpoint(
        crash_server: CrashServer, root: Path, shm_dir: str) -> None:
    # What `ckpt verify`/`ckpt restore` do while a job runs: read its shared-memory slots
    # while it overwrites them. Each read is the exact state of its step, or refused.
    tier = MemoryTier(memory_namespace(root, None, shm_dir))
    events = root.parent / "live.log"
    good = refused = 0
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(crash_server.run, root=str(root), shm=shm_dir, events=str(events),
                              kill_on_event="reader done")
        try:
            while "saved 3" not in (events.read_text() if events.exists() else ""):
                assert not trainer.done(), trainer.result()
                time.sleep(0.01)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                for info in tier.list()[::-1]:
                    try:
                        values = read_shard(tier, info.id, 0)
                    except (DamagedCheckpoint, OSError):
                        refused += 1
                        continue
                    assert_same(values, step_state(info.id.step), f"step {info.id.step} read from a live slot")
                    good += 1
        finally:
            with open(events, "a") as f:
                f.write("reader done\n")
        assert trainer.result()["killed_by"] == "parent"
    assert good > 10, (good, refused)


def test_a_reseal_of_the_same_bytes_is_not_an_overwrite(root: Path, shm_dir: str) -> None:
    """A reader that finds the seal replaced by the drain's checksummed one (same snapshot)
    keeps what it read; one whose slot was unsealed and refilled meanwhile is refused."""
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, step_state(1)).wait()
        slot = next(s for s in mgr.memory.pool.slots if s.holds)
        manifest = slot.sealed()
        tier = MemoryTier(memory_namespace(root, None, shm_dir))
        [info] = tier.list()
        ref = tier.read_manifest(info.id).shards[0]

        reader = tier.open_shard(info.id, ref)
        slot.seal(manifest)  # what the drain's re-seal does: a new seal file, the same bytes
        reader.close()

        reader = tier.open_shard(info.id, ref)
        slot.unseal()  # a live job reusing the slot: its bytes change from here on
        slot.seal(manifest)
        with pytest.raises(DamagedCheckpoint, match="overwritten while being read"):
            reader.close()


def test_a_finished_job_removes_the_slots_its_dead_ranks_left(root: Path, shm_dir: str) -> None:
    """A rank that died (or was renumbered when the world shrank) leaves its slots, its lock
    free. The job's finished close removes them once a newer step is durable; a slot of a
    step not yet durable anywhere is kept while nothing newer is."""
    ns = memory_namespace(root, None, shm_dir)
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=1, keep_memory=True) as mgr:
        for step in (1, 2):
            mgr.save(step, step_state(step)).wait()
    (ns / "rank-00000").rename(ns / "rank-00003")  # a dead rank's directory: steps 1 and 2, lock free
    assert sweep_orphans([ns], set(), older_than=CheckpointId(0, 2)) == []  # step 2 is not older: kept
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=1) as mgr:
        mgr.save(3, step_state(3)).wait()
        assert [s for _, s in disk_steps(root)] == [3] and (ns / "rank-00003").is_dir()
    assert not ns.exists()  # its own slots and the dead rank's are gone, and the namespace with them
