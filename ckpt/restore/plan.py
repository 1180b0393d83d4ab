"""Restore planning, apart from the I/O (as in torch.distributed.checkpoint's planner).

A restore is a plan: for one checkpoint id, the saved shards this rank needs, each
with its sources in preference order (local memory, local disk, a peer, the object
store), and, once a shard's manifest is open, the byte ranges to read from it and
the tensors they land in (``format.read_items``). Same-world restore is the trivial plan:
this rank's own shard, whole, plus the replicated keys from their holder. Peers and
resharding only add sources and ranges. When the holder's shard is in no tier this rank
reads (a lost node's), a rank that read them sends the replicated keys (``share.py``), and a
rank whose own shard holds nothing else does without it.

The planner looks only at listings (``Inventory``): which tier holds which saved
ranks' shards of which id. ``execute.py`` executes plans and falls back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import StateMismatch
from ..format.health import UNSOUND, classify, merged_health
from ..format.layout import Layout, full_layout, overlap
from ..format.manifest import ShardManifest, TensorEntry
from ..format.read_items import ChunkRead
from ..tiers.base import CheckpointId, CheckpointInfo, TierReader


@dataclass(frozen=True)
class ShardNeed:
    """A saved rank's shard this rank reads; ``keys``: the top-level state keys taken
    from it (None: all of them). ``optional``: needed only where some tier lists it (it adds
    nothing the other needs do not); ``sent``: when none is listed, the keys come from another
    rank instead (only their holder's shard is sure to hold replicated keys)."""

    rank: int
    keys: frozenset[str] | None = None
    optional: bool = False
    sent: bool = False  # none listed: another rank that restored these keys sends them (``share.py``)


@dataclass
class ShardPlan:
    rank: int
    sources: list[TierReader]  # fastest first; the next is tried when one is damaged
    keys: frozenset[str] | None


@dataclass
class RestorePlan:
    ckpt_id: CheckpointId
    world_size: int  # of the job that saved it
    shards: list[ShardPlan]
    receive: frozenset[str] = frozenset()  # keys no listed shard gives this rank: another rank sends them
    sender: int | None = None  # the rank that sends them, the same on every rank (None: nobody receives)


Needs = Callable[[int], "list[ShardNeed]"]  # saved world size -> shards to read


def shard_needs(saved_world: int, *, rank: int, world: int, replicated: frozenset[str], holder: int,
                keys: frozenset[str] | None = None) -> list[ShardNeed]:
    """A rank's ``Needs``: its own shard, plus the ``replicated`` keys from the shard of their
    ``holder`` (the first rank of its volume, which alone stores them), else sent by a rank
    that read them; at another world size, every saved shard (resharding reads the overlaps).
    ``keys``: the state's; when all are replicated, the own shard is read only if listed."""
    if saved_world != world:
        return [ShardNeed(r) for r in range(saved_world)]
    if not replicated:
        return [ShardNeed(rank)]
    return [ShardNeed(rank, optional=keys is not None and keys <= replicated),
            ShardNeed(holder, replicated, sent=world > 1)]


class Inventory:
    """What each tier lists, taken once, fastest tier first; plans use the complete ones."""

    def __init__(self, tiers: Sequence[TierReader], avoid: Callable[[CheckpointId], bool] | None = None) -> None:
        """``avoid``: ids a plain restore skips (a failed canary's, ``save/canary.py``); then it
        takes a verified id if there is one."""
        self.tiers = list(tiers)
        self.listings: list[list[CheckpointInfo]] = [t.list() for t in self.tiers]  # unreadable ones too
        self._listed: list[dict[CheckpointId, CheckpointInfo]] = [
            {i.id: i for i in listing if i.complete} for listing in self.listings]
        self.status = classify(merged_health((i.id, i.health) for listed in self._listed for i in listed.values()))
        if avoid is not None and any(avoid(i) for i in self.status):
            kept = {i: s for i, s in self.status.items() if not avoid(i)}
            trusted = "verified" in kept.values()
            self.status = {i: "avoided" if i not in kept or (trusted and s != "verified") else s
                           for i, s in self.status.items()}

    def ids(self, step: int | None = None) -> set[CheckpointId]:
        """The complete ids (of ``step``); without ``step`` only sound ones: never a suspect,
        unhealthy or tainted one (``format/health.py``), so the job goes back to the newest
        step whose replicas agreed. Naming a ``step`` restores it whatever its status."""
        return {i for listed in self._listed for i in listed
                if (i.step == step if step is not None else self.status[i] not in UNSOUND)}

    def world_size(self, ckpt_id: CheckpointId) -> int:
        return next(listed[ckpt_id].world_size for listed in self._listed if ckpt_id in listed)

    def sources(self, ckpt_id: CheckpointId, rank: int) -> list[TierReader]:
        """Tiers listing ``rank``'s shard of ``ckpt_id``, in preference order."""
        return [t for t, listed in zip(self.tiers, self._listed)
                if ckpt_id in listed and rank in listed[ckpt_id].ranks]


def plan(inventory: Inventory, ckpt_id: CheckpointId, needs: Needs) -> RestorePlan | None:
    """The plan for ``ckpt_id``, or None when some needed shard has no source. A keyed need
    whose first choice is a shard read whole anyway (this rank's own, as their holder) is that read."""
    world = inventory.world_size(ckpt_id)
    shards: list[ShardPlan] = []
    receive: frozenset[str] = frozenset()
    for need in needs(world):
        sources = inventory.sources(ckpt_id, need.rank)
        if not sources and need.sent and need.keys is not None:
            receive |= need.keys
        elif not sources and not need.optional:
            return None
        elif sources and not (need.keys is not None and
                              any(s.rank == need.rank and s.keys is None for s in shards)):
            shards.append(ShardPlan(need.rank, sources, need.keys))
    return RestorePlan(ckpt_id, world, shards, receive) if shards or receive else None


def every_shard(inventory: Inventory | None, chosen: RestorePlan, why: str) -> RestorePlan:
    """``chosen``'s checkpoint with every saved shard (to reshard at the saving world size);
    raises StateMismatch, saying ``why`` it was needed, when this rank's tiers lack one."""
    ranks = range(chosen.world_size)
    if inventory is None:
        found = chosen if {s.rank for s in chosen.shards} == set(ranks) else None
    else:
        found = plan(inventory, chosen.ckpt_id, lambda world: [ShardNeed(r) for r in ranks])
    if found is None:
        raise StateMismatch(f"step {chosen.ckpt_id.step}: {why}; restoring that needs every saved shard, and "
                            "some are in no tier this rank reads")
    return found


def plans(inventory: Inventory, needs: Needs, step: int | None = None,
          skip: Iterable[CheckpointId] = ()) -> list[RestorePlan]:
    """Every feasible plan, newest checkpoint first."""
    skip = set(skip)
    out = [p for i in sorted(inventory.ids(step) - skip, reverse=True) if (p := plan(inventory, i, needs))]
    return out


PREFIXES = (".module.", "._orig_mod.")  # DDP's and torch.compile's wrappers, not part of a tensor's name


def canonical_path(path: str) -> str:
    """A state path without wrapper prefixes, so a tensor is found under the name its model gives it."""
    path = f".{path}"
    for prefix in PREFIXES:
        path = path.replace(prefix, ".")
    return path[1:]


def reshard_reads(manifests: Mapping[int, ShardManifest], targets: Mapping[str, Layout],
                  rank: int) -> list[ChunkRead]:
    """For each target local shard (by state path), the saved chunks that overlap it: one
    copy of each saved region (replicas alternate between target ranks to spread reads).
    Raises StateMismatch when a target is not covered exactly (another model)."""
    saved: dict[str, dict[tuple, list[tuple[int, TensorEntry, Layout]]]] = {}
    for r, man in sorted(manifests.items()):
        for e in man.tensors:
            if e.layout is not None or r == 0:  # rank 0's unsharded tensors: whole there
                layout = e.layout or full_layout(e.shape)
                saved.setdefault(canonical_path(e.path), {}).setdefault(layout.runs, []).append((r, e, layout))
    reads = []
    for path, target in targets.items():
        copies = saved.get(canonical_path(path), {})
        covered = 0
        for replicas in copies.values():
            r, e, layout = replicas[rank % len(replicas)]
            if layout.global_shape != target.global_shape:
                raise StateMismatch(f"{path}: checkpoint has global shape {layout.global_shape}, "
                                    f"target {target.global_shape}")
            boxes = tuple(b for b in overlap(layout, target) if b.numel)
            if boxes:
                reads.append(ChunkRead(r, e, path, boxes))
                covered += sum(b.numel for b in boxes)
        if covered != math.prod(target.local_shape):
            raise StateMismatch(f"{path}: the saved shards cover {covered} of the {math.prod(target.local_shape)} "
                                "elements of this rank's shard (the checkpoint holds another tensor there)")
    return reads
