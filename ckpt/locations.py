"""From a ROOT argument (what a user types to ``ckpt``) to the tiers that hold it.

A local path means that directory's disk tier plus the shared-memory slots of the
manager that used it; a URL with a protocol (``s3://bucket/prefix``, ``file:///…``,
any fsspec URL) means an object-store tier. Callers never branch on the backend.
"""
from __future__ import annotations

import os

from fsspec.core import split_protocol

from .manager import memory_namespace
from .memory import DEFAULT_SHM_DIR
from .tiers.base import Tier
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier
from .tiers.object_store import ObjectStoreTier


def is_url(location: str | os.PathLike) -> bool:
    return split_protocol(os.fspath(location))[0] is not None


def tiers_for(location: str | os.PathLike, storage_options: dict | None = None, *, run: str | None = None,
              memory_dir: str = DEFAULT_SHM_DIR) -> list[Tier]:
    """The tiers behind ``location``, fastest first (the order restore tries them)."""
    if is_url(location):
        return [ObjectStoreTier(os.fspath(location), storage_options)]
    return [MemoryTier(memory_namespace(location, run, memory_dir)), LocalDiskTier(location)]
