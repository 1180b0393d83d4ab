"""The Hugging Face integration on a real Trainer and a small real model (GPT-2 built
from a config, dropout on): a run SIGKILLed mid-epoch, preempted by SIGTERM, and
SIGKILLed after an epoch-end checkpoint, restarted each time as a new process, ends
bitwise equal to an uninterrupted run with the same seed; on one process, and on two DDP
ranks under torchrun, where only the last rank is hit and the other must follow it."""
from __future__ import annotations

from pathlib import Path

from tests.integration_helpers import assert_ddp_resumes_exactly, assert_resumes_exactly


def test_interrupted_hf_run_resumes_exactly(tmp_path: Path, shm_dir: str) -> None:
    # every 4 steps, 6 batches an epoch: 4 is mid-epoch; SIGTERM after step 10 saves 10
    # as step 11 begins; 12 ends epoch 2
    assert_resumes_exactly("examples.train_hf", tmp_path, shm_dir, restored=[4, 10, 12])


def test_two_ddp_ranks_resume_exactly_and_save_together(tmp_path: Path, shm_dir: str) -> None:
    """And a crash by an exception on one rank is timed for the restart, as in ``ckpt.resumable``
    (the same launch: ``assert_ddp_resumes_exactly``)."""
    assert_ddp_resumes_exactly("examples.train_hf", tmp_path, shm_dir, restored=[4, 10, 12])
