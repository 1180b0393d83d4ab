"""Plugging the checkpoint engine into the loops users already run.

The Lightning and Hugging Face integrations live in ``ckpt.integrations.lightning``
and ``ckpt.integrations.huggingface``; they are imported on demand, so ckpt itself
needs neither package.
"""
from .data import ResumableDataLoader, ResumableSampler
from .loop import resumable, save_at_boundary
from .risk import RiskListener
from .rng import RNGState
from .urgency import SaveRequests

__all__ = ["resumable", "save_at_boundary", "SaveRequests", "RNGState", "ResumableSampler", "ResumableDataLoader",
           "RiskListener"]
