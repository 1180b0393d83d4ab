"""From a location a user types (a checkpoint root) to the tiers that hold its checkpoints.

A local path means that directory's disk tier plus the shared-memory slots of the jobs
that used it; a URL with a protocol (``s3://bucket/prefix``, ``file:///…``, any fsspec
URL) means an object-store tier. Callers never branch on the backend.
"""
from __future__ import annotations

import os

from .base import DurableTier, TierReader
from .local import LocalDiskTier
from .memory import DEFAULT_SHM_DIR, MemoryTier, memory_namespace, namespaces_of_root
from .peer import PeerTier, is_replica_namespace, replica_namespace


def is_url(location: str | os.PathLike) -> bool:
    """True for ``proto://…`` (an object store, ``file://`` included), False for a plain path."""
    text = os.fspath(location)
    if "://" not in text and "::" not in text:
        return False  # a plain path: no need to import fsspec
    from fsspec.core import split_protocol

    return split_protocol(text)[0] is not None


def object_store_tier(location: str | os.PathLike, storage_options: dict | None = None) -> DurableTier:
    """The object-store tier at ``location``: any fsspec URL, a plain path meaning fsspec's
    local files (``CheckpointManager(object_store=...)`` means a store whatever is typed)."""
    from .object_store import ObjectStoreTier  # fsspec/s3fs: only for jobs that use a store

    return ObjectStoreTier(os.fspath(location), storage_options)


def durable_tier_for(location: str | os.PathLike, storage_options: dict | None = None) -> DurableTier:
    """The durable tier at ``location``: its disk tier, or the object store at a URL."""
    return object_store_tier(location, storage_options) if is_url(location) else LocalDiskTier(location)


def tiers_for(location: str | os.PathLike, storage_options: dict | None = None, *, run: str | None = None,
              memory_dir: str = DEFAULT_SHM_DIR, rank: int = 0) -> list[TierReader]:
    """Tiers of a checkpoint root, fastest first: this host's memory slots, the peer
    replicas this host holds for other nodes' ranks of the same job, then the disk; or,
    for a URL, the object store there (``storage_options`` go to fsspec/s3fs).

    Without ``run``, the memory slots of every run that used this root are found from
    their owner records, so an operator needs only the path after a crash."""
    durable = durable_tier_for(location, storage_options)
    if is_url(location):
        return [durable]
    if run is not None:
        spaces = [memory_namespace(location, run, memory_dir)]
        spaces += [ns for ns in [replica_namespace(os.path.realpath(location), run, memory_dir)] if ns.is_dir()]
    else:
        spaces = (namespaces_of_root(os.path.realpath(location), memory_dir)
                  or [memory_namespace(location, None, memory_dir)])
    replicas = [ns for ns in spaces if is_replica_namespace(ns)]
    own = [MemoryTier(ns, rank) for ns in spaces if ns not in replicas]
    return [*own, *(PeerTier(ns) for ns in replicas), durable]
