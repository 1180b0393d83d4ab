"""The Lightning integration on a real Trainer and a small real model (the example GPT
with dropout): a run SIGKILLed mid-epoch, preempted by SIGTERM, and SIGKILLed after an
epoch-end checkpoint, restarted each time as a new process, ends bitwise equal to an
uninterrupted run with the same seed; on one process, and on two DDP ranks under
torchrun, where only the last rank is hit and the other must follow it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from tests.integration_helpers import assert_ddp_resumes_exactly, assert_resumes_exactly


def test_interrupted_lightning_run_resumes_exactly(tmp_path: Path, shm_dir: str) -> None:
    # every 4 steps, 6 batches an epoch: 4 is mid-epoch; SIGTERM after step 10 saves at
    # the end of step 11; 12 ends epoch 2
    assert_resumes_exactly("examples.train_lightning", tmp_path, shm_dir, restored=[4, 11, 12])


def test_two_ddp_ranks_resume_exactly_and_save_together(tmp_path: Path, shm_dir: str) -> None:
    assert_ddp_resumes_exactly("examples.train_lightning", tmp_path, shm_dir, restored=[4, 11, 12])


def test_data_loader_position_is_the_batches_delivered() -> None:
    """Workers prefetch ahead; the saved position is what the loop received."""
    data = torch.utils.data.TensorDataset(torch.arange(40))

    def loader() -> ckpt.ResumableDataLoader:
        return ckpt.ResumableDataLoader(data, sampler=ckpt.ResumableSampler(data, seed=3), batch_size=4,
                                        num_workers=2)

    def batches(it: object) -> list[list[int]]:
        return [b[0].tolist() for b in it]

    ref = loader()
    epochs = [batches(ref) for _ in range(3)]
    first = loader()
    assert batches(first) == epochs[0]
    it = iter(first)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = first.state_dict()
    del it
    assert state == {"epoch": 1, "consumed": 12, "start": 0, "world_size": 1}
    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + batches(resumed) == epochs[1]
    assert resumed.state_dict() == {"epoch": 1, "consumed": 40, "start": 0, "world_size": 1}
    assert batches(resumed) == epochs[2]


def test_an_object_store_only_manager_works_with_the_lightning_io(tmp_path: Path, shm_dir: str) -> None:
    """root=None (no disk tier): the integration names the store when there is nothing to
    resume from (it used to die on mgr.disk.root), and resumes from the store when there is."""
    from ckpt.integrations.lightning import RESUME, LightningCheckpoint  # Lightning: imported by this test only

    url = f"file://{tmp_path}/store"
    with ckpt.CheckpointManager(None, object_store=url, memory_dir=shm_dir) as mgr:
        guard = LightningCheckpoint(mgr)
        with pytest.raises(ckpt.CheckpointError, match="store"):
            guard.io.load_checkpoint(RESUME)
        mgr.save(7, {"global_step": 7, "w": torch.ones(3)}, urgent=True).wait()
        assert guard.io.load_checkpoint(RESUME)["global_step"] == 7
