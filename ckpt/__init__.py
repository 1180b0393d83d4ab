"""ckpt-guard's checkpoint engine: tiered asynchronous checkpoints for PyTorch.

    from ckpt import CheckpointManager
    mgr = CheckpointManager("/nvme/ckpt/run-42", keep_last=3)
    mgr.save(step, {"model": model, "optim": optimizer, "epoch": 3})
    step = mgr.restore(state)

Names are imported on first use, so ``import ckpt`` (and the ``ckpt`` CLI) does not
pay for torch until something needs it.
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import BackgroundError, CheckpointError, DamagedCheckpoint, ManifestError, Preempted

_LAZY = {
    "CheckpointManager": ".manager",
    "load": ".restore.reshard",
    "match_by_position": ".restore.optim_names",
    "resumable": ".integrations",
    "SaveRequests": ".integrations",
    "RNGState": ".integrations",
    "ResumableSampler": ".integrations",
    "ResumableDataLoader": ".integrations",
}

__all__ = ["CheckpointManager", "load", "match_by_position", "resumable", "SaveRequests", "RNGState",
           "ResumableSampler", "ResumableDataLoader", "CheckpointError", "DamagedCheckpoint", "ManifestError",
           "BackgroundError", "Preempted"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
