"""The Hugging Face integration on a real Trainer and a small real model (GPT-2 built
from a config, dropout on): a run SIGKILLed mid-epoch, preempted by SIGTERM, and
SIGKILLed after an epoch-end checkpoint, restarted each time as a new process, ends
bitwise equal to an uninterrupted run with the same seed."""
from __future__ import annotations

from pathlib import Path

from tests.integration_helpers import faulty_and_clean, shm_dir  # noqa: F401


def test_interrupted_hf_run_resumes_exactly(tmp_path: Path, shm_dir: str) -> None:
    runs, faulty, clean = faulty_and_clean("examples.train_hf", tmp_path, shm_dir)
    assert [r.rc for r in runs] == [-9, 143, -9, 0]
    # every 4 steps, 6 batches an epoch: 4 is mid-epoch, SIGTERM at 10 saves 10, 12 ends epoch 2
    assert [r.restored for r in runs] == [None, 4, 10, 12]
    assert "urgent checkpoint at step 10" in runs[1].log
    assert faulty == clean, "the resumed run diverged from the uninterrupted one"
