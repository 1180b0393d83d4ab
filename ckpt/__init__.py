"""ckpt-guard's checkpoint engine: tiered asynchronous checkpoints for PyTorch.

    from ckpt import CheckpointManager
    mgr = CheckpointManager("/nvme/ckpt/run-42", keep_last=3)
    mgr.save(step, {"model": model, "optim": optimizer, "epoch": 3})
    step = mgr.restore(state)
"""
from .errors import BackgroundError, CheckpointError, DamagedCheckpoint, ManifestError
from .manager import CheckpointManager
from .integrations import RNGState, ResumableDataLoader, ResumableSampler, SaveRequests, resumable
from .restore import load

__all__ = ["CheckpointManager", "load", "resumable", "SaveRequests", "RNGState", "ResumableSampler",
           "ResumableDataLoader", "CheckpointError", "DamagedCheckpoint", "ManifestError", "BackgroundError"]
