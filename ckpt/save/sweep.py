"""Reclaiming the shared memory of jobs that are gone.

A crashed job leaves its slots in /dev/shm (they are meant to survive the trainer). They
go once their owner is gone and their newest steps are durable (``tiers/memory/owners.py``
decides from the owner records alone): at any job's start-up (every dead namespace of this
user in its memory_dir but its own job's: ``reclaim_dead``, besides this root's dead jobs
whose steps are on its disk), from the node agent's timer, and with ``ckpt gc --orphans``
(which also lists the roots of records that predate the durable record, and frees jobs whose
root is gone; steps held nowhere else only with ``force``). A finished job removes its own
slots and those of its dead ranks and its peer replicas (``sweep_finished``). A live job's
slots (its lock is held) are never touched.

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

from ..tiers.base import CheckpointId, DurableTier, complete_shards
from ..tiers.local import LocalDiskTier
from ..tiers.locations import durable_tier_for, is_url
from ..tiers.memory.namespace import DEFAULT_SHM_DIR, namespaces_of_root, rank_dirs, read_owner, sweep_orphans
from ..tiers.memory.owners import Holding, grace_s, reclaim, remove_holding, survey

log = logging.getLogger(__name__)


def remove_leftovers(disk: LocalDiskTier | None, store: DurableTier | None, leads: Callable[[DurableTier], bool], *,
                     root: str, run: str, own: Path, memory_dir: str) -> None:
    """A job's start-up sweep, before anything is written: each volume's leader (``leads``)
    sweeps its own volume (nobody touches another node's disk): interrupted writes, and the
    memory slots of this root's dead jobs (namespaces but ``own``) whose steps are on disk;
    each node's first rank, every dead job's durable slots in ``memory_dir``."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        reclaim_dead(memory_dir, job=(root, run))
    leftovers: list[str] = []
    if store is not None and leads(store):
        leftovers += store.cleanup()
    if disk is not None and leads(disk):
        on_disk = complete_shards(disk)
        others = [n for n in namespaces_of_root(root, memory_dir) if n != own]
        leftovers += disk.cleanup() + sweep_orphans(others, on_disk)
    for leftover in leftovers:
        log.info("removed leftover of an interrupted save: %s", leftover)


def reclaim_dead(memory_dir: str, *, job: tuple[str, str] | None = None) -> list[Holding]:
    """Remove this user's dead namespaces whose newest steps are durable, but those of ``job``
    (root, run: its restart restores from them); warn of those past the grace time."""
    removed, stale = reclaim(memory_dir, keep=lambda h: any(r.job == job for r in h.ranks))
    for h in removed:
        log.info("removed the shared memory of a job that is gone (its steps are durable): %s", h.path)
    for h in stale:
        log.warning("%s: %.0f MiB of shared memory held by a job that is gone, its newest step durable nowhere "
                    "else, for %.1f h (root %s); `ckpt gc --orphans --force` frees it", h.path, h.bytes / 2**20,
                    h.idle_s / 3600, h.owner().get("root"))
    return removed


def sweep_finished(home: DurableTier, own: Path, replicas: Path | None) -> None:
    """A finished job's slots left by its dead or superseded ranks (killed, or renumbered
    when ``ckpt.inprocess`` shrank the world) in this node's namespace ``own``: nothing
    restores them once a newer step is durable in ``home``. Slots of a newer step stay (a
    rank that died in the last save). The peer replicas this node held for the job go too,
    those of a step newer than ``home``'s newest excepted."""
    try:
        durable = [i for i in home.list() if i.complete]
        if durable:
            newest = max(i.id for i in durable)
            shards = {(r, i.id.generation, i.id.step) for i in durable for r in i.ranks}
            for gone in sweep_orphans([own], shards, older_than=newest):
                log.info("removed a finished job's dead rank's memory slots: %s", gone)
            if replicas is not None:
                sweep_orphans([replicas], set(), older_than=CheckpointId(newest.generation, newest.step + 1))
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


def _listed(orphan: Orphan) -> tuple[set[tuple[int, int, int]] | None, str]:
    """What the job's own root (and object store) hold durably; None: anything may go (no root)."""
    root = orphan.root
    if root is None or (not is_url(root) and not os.path.isdir(root)):
        return None, "its root is gone" if root else "no owner record"
    try:
        return (complete_shards(durable_tier_for(root)) | durable_elsewhere([orphan.namespace]),
                f"its steps are durable in {root} or the job's object store")
    except Exception as e:  # an unreachable store: nothing is known to be safe
        return set(), f"cannot list {root}: {e}"


def sweep_orphaned_jobs(shm_dir: str = DEFAULT_SHM_DIR, *, force: bool = False) -> tuple[list[Orphan], list[Orphan]]:
    """Remove this user's namespaces with no live owner process (see the module docstring);
    returns (removed, kept)."""
    removed, kept = [], []
    grace = grace_s()
    for h in survey(shm_dir, uid=os.getuid()):
        if h.live:
            continue
        root = h.owner().get("root")
        orphan = Orphan(h.path, root if isinstance(root, str) else None, h.bytes, "")
        if h.durable:
            orphan.reason = "its newest steps are durable (its owner record says where)"
            remove_holding(h)
        else:
            durable, orphan.reason = _listed(orphan)
            if force or durable is None:
                remove_holding(h, force=True)
            else:
                sweep_orphans([h.path], durable)
                if h.path.exists():
                    orphan.reason = (f"holds steps durable nowhere else ({h.state(grace)}: its owner last wrote "
                                     f"{h.idle_s / 3600:.1f} h ago); --force removes it")
        if h.path.exists():
            orphan.bytes = sum(p.lstat().st_blocks * 512 for p in h.path.rglob("*") if p.is_file())
            kept.append(orphan)
        else:
            removed.append(orphan)
    return removed, kept
