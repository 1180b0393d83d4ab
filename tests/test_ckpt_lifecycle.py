"""Retention, start-up clean-up, lineages (generations) and the per-rank lock."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt import CheckpointError, CheckpointManager
from tests.ckpt_helpers import assert_same, ckpt_dir, disk_steps, eventually, flip_byte, leftovers, restored, step_state


def save_steps(mgr: CheckpointManager, steps, salt: int = 0) -> None:
    for step in steps:
        mgr.save(step, step_state(step, salt))
        mgr.wait()


# -- retention ----------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_complete_checkpoints_and_the_newest_verified(root: Path, shm_dir: str) -> None:
    """keep_last=2 keeps the two newest, and also the newest *verified* one (invariant 16: the
    one to go back to when newer ones turn out unsound), which saving every step is two back."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=2) as mgr:
        for step in range(1, 6):
            save_steps(mgr, [step])
            kept = sorted({*range(max(1, step - 1), step + 1), *([step - 2] if step > 2 else [])})
            eventually(lambda kept=kept: disk_steps(root) == [(0, s) for s in kept])
        assert [(r["step"], r["tiers"], r["health"]) for r in mgr.list()] == [
            (3, ["disk"], "verified"), (4, ["memory", "disk"], "ok"), (5, ["memory", "disk"], "ok")]


def test_keep_last_does_not_count_a_damaged_checkpoint_as_one_to_keep(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=1, keep_memory=True) as mgr:
        save_steps(mgr, [1, 2])
        flip_byte(ckpt_dir(root, 2) / "manifest.json", 20)  # step 2's commit rots
        save_steps(mgr, [3])
        eventually(lambda: disk_steps(root) == [(0, 3)])
        # The newest complete one is kept even when it is the only one and older than a damaged one.
        flip_byte(ckpt_dir(root, 3) / "manifest.json", 20)
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=1) as mgr:
        rows = {r["step"]: r["status"] for r in mgr.list()}
        assert rows[3] == "complete"  # the memory slot's copy of step 3 is intact
        assert restored(mgr)[0] == 3


def test_keep_last_must_be_positive(root: Path, shm_dir: str) -> None:
    with pytest.raises(ValueError, match="newest complete checkpoint is never deleted"):
        CheckpointManager(root, memory_dir=shm_dir, keep_last=0)


# -- start-up clean-up --------------------------------------------------------------------


def test_leftovers_of_interrupted_saves_are_removed_at_start_up_and_nothing_else(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5) as mgr:
        save_steps(mgr, [1, 2])
    # What interrupted saves leave: a directory never committed, a temp file beside a
    # commit, an empty step directory.
    (ckpt_dir(root, 3) / "rank-00000.bin.tmp4242").parent.mkdir()
    (ckpt_dir(root, 3) / "rank-00000.bin.tmp4242").write_bytes(b"\0" * 1000)
    (ckpt_dir(root, 2) / "manifest.json.tmp4242").write_bytes(b"{")
    ckpt_dir(root, 4, generation=1).mkdir()
    # Not ours: must survive.
    (root / "notes.txt").write_text("operator notes")
    (root / "step-latest").mkdir()
    (root / "other").mkdir()
    assert leftovers(root) == ["step-000000000002.g0/manifest.json.tmp4242", "step-000000000003.g0",
                               "step-000000000003.g0/rank-00000.bin.tmp4242", "step-000000000004.g1"]
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5) as mgr:
        assert leftovers(root) == []
        assert sorted(p.name for p in root.iterdir()) == [".ckpt-guard-run", "notes.txt", "other",
                                                          "step-000000000001.g0", "step-000000000002.g0",
                                                          "step-latest"]
        step, state = restored(mgr)
    assert step == 2
    assert_same(state, step_state(2))


# -- lineages -------------------------------------------------------------------------------


def test_restoring_an_older_step_starts_a_new_generation_that_becomes_the_newest(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=10) as mgr:
        save_steps(mgr, range(1, 6))
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=10) as mgr:
        assert mgr.restore({}, step=3) == 3
        save_steps(mgr, [4], salt=1)  # the run goes on from 3 on another branch
    assert disk_steps(root) == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 4)]
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        step, state = restored(mgr)
        assert step == 4, "newest = newest step of the newest generation, not the abandoned step 5"
        assert_same(state, step_state(4, salt=1))
        assert_same(restored(mgr, 4)[1], step_state(4, salt=1))  # same step number: newest generation first
        assert_same(restored(mgr, 5)[1], step_state(5))  # the abandoned branch stays readable by step


def test_resuming_the_newest_step_continues_its_generation(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        save_steps(mgr, [1, 2])
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore({}) == 2
        save_steps(mgr, [3])
    assert disk_steps(root) == [(0, 1), (0, 2), (0, 3)]


def test_saving_without_restoring_starts_a_new_lineage(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        save_steps(mgr, [10, 11])
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        save_steps(mgr, [1], salt=2)  # a restarted run that forgot to restore
        step, state = restored(mgr)
    assert (step, disk_steps(root)[-1]) == (1, (1, 1))
    assert_same(state, step_state(1, salt=2))


# -- one manager per root, run and rank -----------------------------------------------------


def test_two_managers_on_the_same_root_and_run_are_refused(root: Path, shm_dir: str) -> None:
    first = CheckpointManager(root, memory_dir=shm_dir)
    try:
        with pytest.raises(CheckpointError, match="in use by another live process.*own checkpoint root"):
            CheckpointManager(root, memory_dir=shm_dir)
        with pytest.raises(CheckpointError, match="belongs to run 'default'"):
            CheckpointManager(root, memory_dir=shm_dir, run="second-job")
    finally:
        first.close()
    CheckpointManager(root, memory_dir=shm_dir).close()  # released by close()


def test_a_forked_child_does_not_keep_the_rank_locked(root: Path, shm_dir: str) -> None:
    """A data loader's workers are forked from the rank: once the rank lets go (or dies), the
    next process for that rank (a spare taking it) gets the slots although they still live."""
    first = CheckpointManager(root, memory_dir=shm_dir)
    (ready_r, ready_w), (go_r, go_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: running (its fork handlers done), it holds what it kept until told to go
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"r"
        first.close()
        CheckpointManager(root, memory_dir=shm_dir).close()
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


def test_another_run_on_the_same_root_is_refused_and_mixes_nothing_up(root: Path, shm_dir: str) -> None:
    """r2 on r1's root would prune r1's checkpoints and a restarted r1 would restore r2's
    state; r2 refuses before touching anything, and r1 restarts into its own state."""
    with CheckpointManager(root, memory_dir=shm_dir, run="r1", keep_last=3) as r1:
        for step in (1, 2, 3):
            r1.save(step, step_state(step))
        r1.wait()
    with pytest.raises(CheckpointError, match="belongs to run 'r1'.*its own root"):
        CheckpointManager(root, memory_dir=shm_dir, run="r2", keep_last=1)
    assert disk_steps(root) == [(0, 1), (0, 2), (0, 3)]
    with CheckpointManager(root, memory_dir=shm_dir, run="r1") as r1:
        step, got = restored(r1)
    assert step == 3
    assert_same(got, step_state(3))
