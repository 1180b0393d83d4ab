"""``ckpt verify --manifests-only`` of a durable tier on many cores.

Checking a shard manifest is Python work (parse, bounds, every entry: 25-35 ms of CPU for a 70B
model's shard on a loaded core here), so threads share one core whatever their number; 16,384
shards are minutes.
Here the commit record is read once, its shards split into chunks, and each chunk checked by a
worker process that opened the same location itself (spawned: the parent may hold an object
store's event-loop thread, which a fork would copy half-alive), its own threads overlapping the
reads of an object store. A real 16k-GPU checkpoint is verified on a many-core host: the
default is every core this process may use.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from ..errors import DamagedCheckpoint, ManifestError
from .base import CheckpointId, DurableTier, ShardRef, TierReader
from .locations import durable_tier_for

MIN_SHARDS_PER_JOB = 32  # below this a worker's start (~1 s: imports) costs more than it saves
CHUNKS_PER_JOB = 8  # chunks a worker, so that a slow one does not hold up the end
_worker_tier: DurableTier | None = None


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def verify_manifests(tier: TierReader, location: str, ckpt_id: CheckpointId, *, jobs: int, threads: int = 8) -> None:
    """Every shard manifest ``tier`` holds of ``ckpt_id``, checked as ``tier.verify_manifests``
    checks them; raises the first damage found. ``jobs`` > 1: ``tier`` is the durable tier at
    ``location``, which the workers open again."""
    shards = tier.read_manifest(ckpt_id).shards
    jobs = min(jobs, len(shards) // MIN_SHARDS_PER_JOB)
    if jobs <= 1:
        tier.verify_manifests(ckpt_id, threads=threads, shards=shards)
        return
    size = -(-len(shards) // (jobs * CHUNKS_PER_JOB))
    chunks = [shards[i:i + size] for i in range(0, len(shards), size)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_start, initargs=(location,)) as pool:
        for fault in pool.map(_check, [ckpt_id] * len(chunks), chunks, [threads] * len(chunks)):
            if fault is not None:
                file, reason = fault
                raise DamagedCheckpoint(ckpt_id.step, file, reason, tier.name) if file else ManifestError(reason)


def _start(location: str) -> None:
    global _worker_tier
    _worker_tier = durable_tier_for(location)
    gc.freeze()  # the imported modules: a collection, triggered by the manifests' many objects, skips them


def _check(ckpt_id: CheckpointId, shards: list[ShardRef], threads: int) -> tuple[str, str] | None:
    """A chunk's fault as (file, reason), file "" for damage without one; None when sound
    (an exception with several arguments does not cross processes whole)."""
    assert _worker_tier is not None
    try:
        _worker_tier.verify_manifests(ckpt_id, threads=threads, shards=shards)
    except DamagedCheckpoint as e:
        return e.file, e.reason
    except (ManifestError, OSError, EOFError) as e:
        return "", f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    return None
