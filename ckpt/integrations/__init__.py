"""Plugging the checkpoint engine into the loops users already run.

The Lightning and Hugging Face integrations live in ``ckpt.integrations.lightning``
and ``ckpt.integrations.huggingface``; they are imported on demand, so ckpt itself
needs neither package.
"""
from .data import ResumableDataLoader, ResumableSampler
from .loop import SaveRequests, resumable
from .rng import RNGState

__all__ = ["resumable", "SaveRequests", "RNGState", "ResumableSampler", "ResumableDataLoader"]
