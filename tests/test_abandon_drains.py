"""``CheckpointManager.abandon()`` (an in-process recovery) waits for no drain it can drop:
the snapshots queued for their checksums and disk write stay sealed in memory, where the next
round restores the newest, and nothing of them reaches the disk (issue 50 point 6: the
survivor's abort waited for every queued drain)."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from ckpt import CheckpointManager
from ckpt.save.drain import SaveHandle
from ckpt.tiers.local import LocalDiskTier


def test_abandon_drops_queued_drains_and_the_newest_snapshot_restores_from_memory(root: Path, shm_dir: str):
    state = {"w": torch.arange(8, dtype=torch.float32)}
    mgr = CheckpointManager(root, memory_dir=shm_dir)
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:  # the drain thread busy: what is saved now queues behind it
        running.set()
        gate.wait()

    mgr._saves.drainer.submit(hold, SaveHandle(0, []))
    assert running.wait(60)
    handles = []
    for step in (1, 2):  # two slots: both snapshots sealed, their drains queued
        state["w"] += 1
        handles.append(mgr.save(step, state))
    threading.Timer(0.5, gate.set).start()  # the job running ends; the queued ones must not run
    mgr.abandon()
    assert all(isinstance(h.error, Exception) and "not drained" in str(h.error) for h in handles), handles
    assert LocalDiskTier(root).list() == []  # no drain ran: nothing reached the disk

    restored = {"w": torch.zeros(8)}
    with CheckpointManager(root, memory_dir=shm_dir, keep_memory=False) as again:
        assert again.restore(restored) == 2
    assert torch.equal(restored["w"], torch.arange(8, dtype=torch.float32) + 2)
