"""Failures in the background path never go unsaid: a full disk (the disk tier's failure, not
the rank's) is one error line and the ``ckpt_tier_full`` metric while training goes on with
memory; any other failure (permission denied) makes the next save()/wait() raise
BackgroundError naming the step and the cause. Earlier checkpoints stay intact and
restorable, and saving works again once the cause is gone.

Disk full uses a real size-limited tmpfs (needs root to mount; skipped otherwise).
Permission denied uses chmod 0500 as a normal user, and the immutable attribute
(chattr +i, EPERM) as root, whom permission bits do not stop.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from ckpt import BackgroundError, CheckpointError, CheckpointManager
from tests.ckpt_helpers import assert_same, ckpt_dir, disk_steps, restored, small_tmpfs, step_state, writes_denied
from tests.procs import free_port

STATE_MIB = 2.2  # size of one step_state() checkpoint


def settle(handle, timeout: float = 30) -> None:
    """Wait until a save's drain finished (well or not) without consuming its error."""
    deadline = time.monotonic() + timeout
    while not handle.done:
        assert time.monotonic() < deadline, "the drain never finished"
        time.sleep(0.01)


def assert_restores_from_disk(root: Path, tmp_path: Path, newest: int, older: list[int]) -> None:
    """Only the disk tier (a memory_dir without slots): newest and older steps read back exactly."""
    empty = tmp_path / f"no-slots-{time.monotonic_ns()}"
    empty.mkdir()
    with CheckpointManager(root, memory_dir=str(empty)) as mgr:
        assert [r["status"] for r in mgr.list()] == ["complete"] * len(mgr.list())
        step, state = restored(mgr)
        assert step == newest
        assert_same(state, step_state(newest))
        for s in older:
            assert_same(restored(mgr, s)[1], step_state(s))


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 6 MiB filesystem: room for two checkpoints, not three."""
    with small_tmpfs(tmp_path / "small", "6m") as mnt:
        yield mnt / "ckpt"


def disk_full_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "disk tier fail" in r.getMessage()]


def test_a_full_disk_is_said_once_and_training_goes_on_with_memory(full_disk: Path, shm_dir: str, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Issue 49: a full disk is the disk tier's failure, not the rank's: save() and wait() go on,
    one error line and a metric say so, the earlier checkpoints stay, memory holds the newest."""
    port = free_port()
    with CheckpointManager(full_disk, memory_dir=shm_dir, keep_last=5, metrics_port=port) as mgr:
        for step in (1, 2):
            mgr.save(step, step_state(step))
            mgr.wait()
        for step in (3, 4):
            mgr.save(step, step_state(step))  # the copy into memory succeeds; the drain cannot fit it
            mgr.wait()
        assert disk_steps(full_disk) == [(0, 1), (0, 2)]
        assert not list(full_disk.rglob("*.tmp*")), "a failed write must not leave its temp file filling the disk"
        (line,) = disk_full_lines(caplog)
        assert "No space left on device" in line and "training goes on with the memory tier" in line
        assert mgr.metrics.registry.get_sample_value("ckpt_tier_full", {"rank": "0", "tier": "disk"}) == 1
    assert_restores_from_disk(full_disk, tmp_path, newest=2, older=[1])
    # Steps 3 and 4 never reached the disk: close() kept the slots, which hold the newest.
    with CheckpointManager(full_disk, memory_dir=shm_dir) as mgr:
        step, state = restored(mgr)
    assert step == 4
    assert_same(state, step_state(4))


def test_saving_to_disk_resumes_once_space_is_freed(full_disk: Path, shm_dir: str, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(full_disk, memory_dir=shm_dir, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, step_state(step))
        mgr.wait()
        settle(mgr.save(3, step_state(3)))
        settle(mgr.save(4, step_state(4)))  # no error: training goes on
        shutil.rmtree(ckpt_dir(full_disk, 1))  # the operator frees space
        mgr.save(5, step_state(5))
        mgr.wait()
        assert len(disk_full_lines(caplog)) == 1
        assert any("has room again: step 5" in r.getMessage() for r in caplog.records)
    assert disk_steps(full_disk) == [(0, 2), (0, 5)]
    assert_restores_from_disk(full_disk, tmp_path, newest=5, older=[2])


def test_full_shared_memory_is_a_clear_error_at_save(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "tiny-shm", "1m") as tiny:
        with CheckpointManager(tmp_path / "ckpt", memory_dir=str(tiny)) as mgr:
            with pytest.raises(CheckpointError, match="not enough space .*enlarge /dev/shm or pass memory_dir="):
                mgr.save(1, step_state(1))
            mgr.save(2, {"small": step_state(2)["bias"]})  # what fits still saves
            mgr.wait()
            assert [r["step"] for r in mgr.list()] == [2]


def test_permission_denied_raises_at_wait_and_keeps_the_newest_complete_checkpoint(
        shm_dir: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=1) as mgr:
        mgr.save(1, step_state(1))
        mgr.wait()
        with writes_denied(root) as cause:
            mgr.save(2, step_state(2))
            with pytest.raises(BackgroundError, match=f"step 2.*{cause}.*{root.name}"):
                mgr.wait()
            settle(mgr.save(3, step_state(3)))
            with pytest.raises(BackgroundError, match=cause):
                mgr.save(4, step_state(4))
            assert disk_steps(root) == [(0, 1)], "keep_last=1 must not drop the only complete checkpoint"
        assert_restores_from_disk(root, tmp_path, newest=1, older=[])
        mgr.save(5, step_state(5))  # writable again: saving resumes
        mgr.wait()
    # keep_last=1 and the newest verified one (invariant 16): step 1, ok with step 5 newer
    assert disk_steps(root) == [(0, 1), (0, 5)]
    assert_restores_from_disk(root, tmp_path, newest=5, older=[1])


def test_a_failure_reported_by_wait_is_not_raised_again_by_the_next_save(shm_dir: str, tmp_path: Path) -> None:
    # A training loop that logs a BackgroundError from wait() and goes on must not lose
    # its next checkpoint to a second report of the same failure.
    root = tmp_path / "ckpt"
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, step_state(1))
        mgr.wait()
        with writes_denied(root):
            mgr.save(2, step_state(2))
            with pytest.raises(BackgroundError):
                mgr.wait()
        mgr.save(3, step_state(3))
        mgr.wait()
    assert disk_steps(root) == [(0, 1), (0, 3)]
