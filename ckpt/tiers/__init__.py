"""Storage tiers by role (see ``base``): every tier reads, durable tiers are also written."""
from .base import CheckpointId, CheckpointInfo, DurableTier, ShardReader, TierReader

__all__ = ["CheckpointId", "CheckpointInfo", "DurableTier", "ShardReader", "TierReader"]
