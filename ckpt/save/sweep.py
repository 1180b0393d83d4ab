"""Reclaiming the shared memory of jobs that are gone.

A crashed or deleted job leaves its slots in /dev/shm (they are meant to survive the
trainer). Start-up of the same job, or ``ckpt gc ROOT``, sweeps them once their steps
are durable, and a finished job those of its own dead ranks (``sweep_finished``);
``ckpt gc --orphans`` sweeps every namespace of this user whose owner
process is gone, without knowing the roots: those whose root no longer exists, and
those whose steps are all durable in it; the rest (steps held nowhere else) only
with ``force``. A live job's slots (its lock is held) are never touched.

At start-up, ``remove_leftovers`` also removes each durable volume's interrupted writes.

Peer replicas hold *other* nodes' shards, never on this root's disk: they go once
their (saved rank, step) is in the job's object store (which their owner record
names: ``durable_elsewhere``), or when the root is gone.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..tiers.base import DurableTier, complete_shards
from ..tiers.local import LocalDiskTier
from ..tiers.locations import durable_tier_for, is_url
from ..tiers.memory.namespace import (
    DEFAULT_SHM_DIR,
    namespaces_of_root,
    owner_gone,
    rank_dirs,
    read_owner,
    sweep_orphans,
    trusted_namespaces,
)

log = logging.getLogger(__name__)


def remove_leftovers(disk: LocalDiskTier | None, store: DurableTier | None, leads: Callable[[DurableTier], bool], *,
                     root: str, own: Path, memory_dir: str) -> None:
    """A job's start-up sweep, before anything is written: each volume's leader (``leads``)
    sweeps its own volume (nobody touches another node's disk): interrupted writes, and the
    memory slots of this root's dead jobs (namespaces but ``own``) whose steps are on disk."""
    leftovers: list[str] = []
    if store is not None and leads(store):
        leftovers += store.cleanup()
    if disk is not None and leads(disk):
        on_disk = complete_shards(disk)
        others = [n for n in namespaces_of_root(root, memory_dir) if n != own]
        leftovers += disk.cleanup() + sweep_orphans(others, on_disk)
    for leftover in leftovers:
        log.info("removed leftover of an interrupted save: %s", leftover)


def sweep_finished(home: DurableTier, own: Path) -> None:
    """A finished job's slots left by its dead or superseded ranks (killed, or renumbered
    when ``ckpt.inprocess`` shrank the world) in this node's namespace ``own``: nothing
    restores them once a newer step is durable in ``home``. Slots of a newer step stay (a
    rank that died in the last save)."""
    try:
        durable = [i for i in home.list() if i.complete]
        if durable:
            shards = {(r, i.id.generation, i.id.step) for i in durable for r in i.ranks}
            for gone in sweep_orphans([own], shards, older_than=max(i.id for i in durable)):
                log.info("removed a finished job's dead rank's memory slots: %s", gone)
    except Exception as e:  # housekeeping: the job's saves are durable; `ckpt gc --orphans` can do it later
        log.warning("could not sweep dead ranks' memory slots in %s: %s", own, e)


@dataclass
class Orphan:
    namespace: Path
    root: str | None  # the root (path or URL) its owner recorded
    bytes: int
    reason: str  # why it can go, or why it stays


def durable_elsewhere(spaces: list[Path]) -> set[tuple[int, int, int]]:
    """(saved rank, generation, step) of every shard durable in the object stores the owner
    records of ``spaces`` name (an unreachable store: nothing)."""
    stores = {o["object"] for ns in spaces for d in rank_dirs(ns)
              if (o := read_owner(d)) is not None and isinstance(o.get("object"), str)}
    found: set[tuple[int, int, int]] = set()
    for url in sorted(stores):
        try:
            found |= complete_shards(durable_tier_for(url))
        except Exception:  # unreachable or unreadable: nothing is known to be safe
            continue
    return found


def _in_use(rdir: Path) -> bool:
    with owner_gone(rdir) as gone:
        return gone is False


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def orphans(shm_dir: str = DEFAULT_SHM_DIR) -> list[Orphan]:
    """Namespaces of this user with no live owner process (none of their ranks' locks held)."""
    found = []
    for ns in trusted_namespaces(shm_dir):
        ranks = rank_dirs(ns)
        if any(_in_use(d) for d in ranks):
            continue
        owner = next((o for d in ranks if (o := read_owner(d)) is not None), None)
        root = owner.get("root") if owner else None
        found.append(Orphan(ns, root if isinstance(root, str) else None, _size(ns), ""))
    return found


def sweep_orphaned_jobs(shm_dir: str = DEFAULT_SHM_DIR, *, force: bool = False) -> tuple[list[Orphan], list[Orphan]]:
    """Remove orphaned namespaces (see the module docstring); returns (removed, kept)."""
    removed, kept = [], []
    for orphan in orphans(shm_dir):
        root = orphan.root
        if root is None or (not is_url(root) and not os.path.isdir(root)):
            orphan.reason = "its root is gone" if root else "no owner record"
            durable: set[tuple[int, int, int]] | None = None
        else:
            try:
                durable = complete_shards(durable_tier_for(root)) | durable_elsewhere([orphan.namespace])
                orphan.reason = f"its steps are durable in {root} or the job's object store"
            except Exception as e:  # an unreachable store: nothing is known to be safe
                durable, orphan.reason = set(), f"cannot list {root}: {e}"
        sweep_orphans([orphan.namespace], durable or set(), force=force or durable is None)
        if orphan.namespace.exists():
            orphan.reason = f"holds steps not durable in {root} (use --force)" if durable is not None else \
                orphan.reason
            orphan.bytes = _size(orphan.namespace)
            kept.append(orphan)
        else:
            removed.append(orphan)
    return removed, kept
