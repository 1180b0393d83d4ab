"""Storage tiers behind one interface (see ``base.Tier``)."""
from .base import CheckpointId, CheckpointInfo, ShardReader, Tier

__all__ = ["CheckpointId", "CheckpointInfo", "ShardReader", "Tier"]
