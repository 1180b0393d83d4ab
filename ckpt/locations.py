"""From a location a user types (a checkpoint root) to the tiers that hold its checkpoints.

A local path means that directory's disk tier plus the shared-memory slots of the jobs
that used it; a URL with a protocol (``s3://bucket/prefix``, ``file:///…``, any fsspec
URL) means an object-store tier. Callers never branch on the backend.
"""
from __future__ import annotations

import os

from fsspec.core import split_protocol

from .memory import DEFAULT_SHM_DIR, namespace_dir, namespaces_of_root
from .tiers.base import Tier
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier
from .tiers.object_store import ObjectStoreTier


def memory_namespace(root: str | os.PathLike, run: str | None, memory_dir: str = DEFAULT_SHM_DIR):
    """The shared-memory directory of the job with this root and run (the CLI finds it too)."""
    return namespace_dir(os.path.realpath(root), run or "default", memory_dir)


def is_url(location: str | os.PathLike) -> bool:
    """True for ``proto://…`` (an object store, ``file://`` included), False for a plain path."""
    return split_protocol(os.fspath(location))[0] is not None


def tiers_for(location: str | os.PathLike, storage_options: dict | None = None, *, run: str | None = None,
              memory_dir: str = DEFAULT_SHM_DIR, rank: int = 0) -> list[Tier]:
    """Tiers of a checkpoint root, fastest first: this host's memory slots, then the disk;
    or, for a URL, the object store there (``storage_options`` go to fsspec/s3fs).

    Without ``run``, the memory slots of every run that used this root are found from
    their owner records, so an operator needs only the path after a crash."""
    if is_url(location):
        return [ObjectStoreTier(os.fspath(location), storage_options)]
    if run is not None:
        spaces = [memory_namespace(location, run, memory_dir)]
    else:
        spaces = namespaces_of_root(os.path.realpath(location), memory_dir) or [memory_namespace(location, None, memory_dir)]
    return [*(MemoryTier(ns, rank) for ns in spaces), LocalDiskTier(location)]
