"""Plugging the checkpoint engine into the loops users already run."""
from .data import ResumableSampler
from .loop import resumable
from .risk import RiskListener
from .rng import RNGState
from .urgency import SaveRequests

__all__ = ["resumable", "RNGState", "ResumableSampler", "RiskListener", "SaveRequests"]
