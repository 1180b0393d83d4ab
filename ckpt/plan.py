"""Restore planning, apart from the I/O (as in torch.distributed.checkpoint's planner).

A restore is a plan: for one checkpoint id, the saved shards this rank needs, each
with its sources in preference order (local memory, local disk, a peer, the object
store), and, once a shard's manifest is open, the byte ranges to read from it and
the tensors they land in (``read_items``). Same-world restore is the trivial plan:
this rank's own shard, whole, plus the replicated keys from their holder. Peers and
resharding only add sources and ranges.

The planner looks only at listings (``Inventory``): which tier holds which saved
ranks' shards of which id. ``restore.py`` executes plans and falls back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .manifest import ShardManifest, TensorEntry
from .tiers.base import CheckpointId, CheckpointInfo, TierReader


@dataclass(frozen=True)
class ShardNeed:
    """A saved rank's shard this rank reads; ``keys``: the top-level state keys taken
    from it (None: all of them)."""

    rank: int
    keys: frozenset[str] | None = None


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


@dataclass(frozen=True)
class ReadItem:
    """Bytes ``lo..hi`` of one saved tensor: one verified piece (a checksum chunk)."""

    tensor: TensorEntry
    lo: int
    hi: int


Needs = Callable[[int], "list[ShardNeed] | None"]  # saved world size -> shards to read (None: cannot)


class Inventory:
    """What each tier lists as complete, taken once, fastest tier first."""

    def __init__(self, tiers: Sequence[TierReader]) -> None:
        self.tiers = list(tiers)
        self._listed: list[dict[CheckpointId, CheckpointInfo]] = [
            {i.id: i for i in t.list() if i.complete} for t in self.tiers]

    def ids(self, step: int | None = None) -> set[CheckpointId]:
        return {i for listed in self._listed for i in listed if step is None or i.step == step}

    def world_size(self, ckpt_id: CheckpointId) -> int:
        return next(listed[ckpt_id].world_size for listed in self._listed if ckpt_id in listed)

    def sources(self, ckpt_id: CheckpointId, rank: int) -> list[TierReader]:
        """Tiers listing ``rank``'s shard of ``ckpt_id``, in preference order."""
        return [t for t, listed in zip(self.tiers, self._listed)
                if ckpt_id in listed and rank in listed[ckpt_id].ranks]


def plan(inventory: Inventory, ckpt_id: CheckpointId, needs: Needs) -> RestorePlan | None:
    """The plan for ``ckpt_id``, or None when some needed shard has no source (or the
    saved world cannot be read by this job: ``needs`` returned None)."""
    world = inventory.world_size(ckpt_id)
    wanted = needs(world)
    if wanted is None:
        return None
    shards = [ShardPlan(n.rank, inventory.sources(ckpt_id, n.rank), n.keys) for n in wanted]
    return RestorePlan(ckpt_id, world, shards) if all(s.sources for s in shards) else None


def plans(inventory: Inventory, needs: Needs, step: int | None = None,
          skip: Iterable[CheckpointId] = ()) -> list[RestorePlan]:
    """Every feasible plan, newest checkpoint first."""
    skip = set(skip)
    out = [p for i in sorted(inventory.ids(step) - skip, reverse=True) if (p := plan(inventory, i, needs))]
    return out


def read_items(manifest: ShardManifest) -> list[ReadItem]:
    """Every tensor of a shard, whole, in checksum-sized pieces: each read is verified
    exactly where it lands."""
    chunk = manifest.chunk_bytes
    return [ReadItem(e, k * chunk, min(e.nbytes, (k + 1) * chunk))
            for e in manifest.tensors for k in range(max(1, -(-e.nbytes // chunk)))]
