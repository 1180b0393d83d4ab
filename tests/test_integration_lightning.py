"""The Lightning integration on a real Trainer and a small real model (the example GPT
with dropout): a run SIGKILLed mid-epoch, preempted by SIGTERM, and SIGKILLed after an
epoch-end checkpoint, restarted each time as a new process, ends bitwise equal to an
uninterrupted run with the same seed."""
from __future__ import annotations

from pathlib import Path

import torch

import ckpt
from tests.integration_helpers import faulty_and_clean, shm_dir  # noqa: F401


def test_interrupted_lightning_run_resumes_exactly(tmp_path: Path, shm_dir: str) -> None:
    runs, faulty, clean = faulty_and_clean("examples.train_lightning", tmp_path, shm_dir)
    assert [r.rc for r in runs] == [-9, 143, -9, 0]
    # every 4 steps, 6 batches an epoch: 4 is mid-epoch, SIGTERM at 10 saves 11, 12 ends epoch 2
    assert [r.restored for r in runs] == [None, 4, 11, 12]
    assert "urgent checkpoint at step 11" in runs[1].log
    assert faulty == clean, "the resumed run diverged from the uninterrupted one"


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
    assert state == {"epoch": 1, "consumed": 12}
    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + batches(resumed) == epochs[1]
    assert resumed.state_dict() == {"epoch": 1, "consumed": 40}
    assert batches(resumed) == epochs[2]
