"""The memory tier: per-rank shared-memory slots that survive the trainer.

namespace.py  where a job's shared memory lives, and which of it this user may trust
slots.py      pre-allocated, pre-faulted slots; sealing; the slot pool (one per rank)
copier.py     the snapshot copy the trainer waits for (CPU threads, CUDA side stream)
reader.py     reading a sealed slot, re-checked against its seal
tier.py       ``MemoryTier``: the tier's read role plus the owner's snapshot API

Only the reading side is imported here (no torch): the copy lives in ``copier``.
"""
from .namespace import DEFAULT_SHM_DIR, memory_namespace, namespace_dir, namespaces_of_root, sweep_orphans
from .tier import MemoryTier

__all__ = ["DEFAULT_SHM_DIR", "MemoryTier", "memory_namespace", "namespace_dir", "namespaces_of_root",
           "sweep_orphans"]
