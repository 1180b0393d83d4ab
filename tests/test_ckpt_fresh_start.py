"""Never start over silently: a job that finds checkpoints it cannot restore (another
model, an unreadable commit record, a shard some rank lacks) raises with the reason,
from `restore()` and from `ckpt.resumable`; starting from scratch beside them is a
stated decision (`fresh_ok=True`, `CKPT_GUARD_START_FRESH=1`), logged, and the new run's
saves are what later restarts resume."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointError, CheckpointManager
from ckpt.errors import StateMismatch
from ckpt.restore.fresh_start import START_FRESH_ENV, JobListing, refuse_if_present
from ckpt.restore.plan import Inventory
from ckpt.tiers.local import LocalDiskTier
from ckpt.tiers.locations import tiers_for


def model(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, width)


@pytest.fixture
def saved(root: Path, shm_dir: str) -> Path:
    """Step 10 of a Linear(4, 3) run, on disk."""
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(10, {"model": model(3), "epoch": 1}).wait()
    return root


def test_another_model_raises_from_restore_and_from_the_loop(saved: Path, shm_dir: str) -> None:
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        with pytest.raises(StateMismatch, match=r"model.weight: checkpoint has shape \(3, 4\), target \(5, 4\)"):
            mgr.restore({"model": model(5), "epoch": 0})
        with pytest.raises(StateMismatch):
            next(iter(ckpt.resumable(mgr, {"model": model(5), "epoch": 0}, total=20, every=5, preemption=False)))


def test_an_unreadable_commit_record_raises_instead_of_starting_over(saved: Path) -> None:
    record = next(saved.glob("step-*/manifest.json"))
    record.write_text("{not json")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as no_slots:  # only the disk copy is left
        with CheckpointManager(saved, memory_dir=no_slots) as mgr:
            with pytest.raises(CheckpointError, match=r"step 10 \(generation 0\): unreadable in disk") as err:
                mgr.restore({"model": model(3), "epoch": 0})
    assert START_FRESH_ENV in str(err.value)


def test_a_fresh_start_on_purpose_is_logged_and_its_saves_are_resumed(saved: Path, shm_dir: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    other = model(5, seed=1)
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckpt.restore.fresh_start"):
            assert mgr.restore({"model": other, "epoch": 0}, fresh_ok=True) is None
        mgr.save(2, {"model": other, "epoch": 0}).wait()
    assert "STARTING FROM SCRATCH" in caplog.text and "model.weight" in caplog.text
    again = model(5, seed=2)
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        assert mgr.restore({"model": again, "epoch": 0}) == 2  # the new run's generation is the newer one
    assert torch.equal(again.weight, other.weight)
    assert [i.id.generation for i in LocalDiskTier(saved).list()] == [0, 1]  # the old run's step 10 is kept


def test_the_environment_variable_starts_the_loop_fresh(saved: Path, shm_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_FRESH_ENV, "1")
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        steps = list(ckpt.resumable(mgr, {"model": model(5), "epoch": 0}, total=3, preemption=False))
    assert steps == [0, 1, 2]


def test_an_explicit_step_is_never_replaced_by_a_fresh_start(saved: Path, shm_dir: str) -> None:
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        with pytest.raises(StateMismatch):
            mgr.restore({"model": model(5), "epoch": 0}, step=10, fresh_ok=True)


class _TwoRanks:
    """Rank 0 of a two-rank job whose rank 1 lists nothing (a replaced node's empty disk)."""

    world_size = 2

    def gather(self, obj: object) -> list:
        return [obj, {}]


def _refuse_on_rank_0(tiers: list) -> None:
    refuse_if_present(JobListing(_TwoRanks(), Inventory(tiers)))


def test_a_checkpoint_one_rank_has_no_copy_of_is_named(saved: Path) -> None:
    with pytest.raises(CheckpointError, match=r"step 10 \(generation 0\): rank\(s\) 1 have no copy of it"):
        _refuse_on_rank_0([LocalDiskTier(saved)])
    _refuse_on_rank_0([LocalDiskTier(saved.parent / "empty")])  # nothing anywhere: a first start


def test_a_step_sealed_in_memory_but_committed_nowhere_is_no_checkpoint(root: Path, shm_dir: str) -> None:
    """An interrupted first save (rank 0 sealed its slot, rank 1 never did) is not a
    checkpoint to refuse over: the job starts fresh."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_memory=True) as mgr:
        mgr.save(5, {"model": model(3)}).wait()
    memory = [t for t in tiers_for(root, memory_dir=shm_dir) if t.name == "memory"]
    assert [i.id.step for t in memory for i in t.list()] == [5]
    _refuse_on_rank_0(memory)
