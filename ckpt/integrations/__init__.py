"""Plugging the checkpoint engine into the loops users already run."""
from .data import ResumableSampler
from .loop import resumable
from .rng import RNGState

__all__ = ["resumable", "RNGState", "ResumableSampler"]
