"""The one restore path (invariant 14): a checkpoint saved by N ranks, read into M, N = M
included, from any source (our tiers, an import).

1. **Normalise** (``normalise.py``): the saved trees this rank reads anyway (its own shard's
   and, for ``replicated=`` keys, their holder's; saved rank 0's at another world size) are
   matched to the target: module prefixes, optimizer state by parameter name, key types.
   Then the state is checked whole (global shapes) before any byte is read.
2. **Plan** (``plan_reads``): each saved tensor whose saved shard covers exactly the elements
   of its target (a plain tensor into a plain tensor, a DTensor laid out alike) is read whole
   from that shard; every other one (another placement, mesh or local shape, a plain tensor
   for a DTensor or the reverse) from the saved chunks that overlap its target, across every
   saved shard (``plan.reshard_reads``). Reading this rank's whole shard is the plan in which
   every tensor is covered: same code, no second path; other shards' manifests are opened
   only when some tensor needs them.
3. **Read** (``_execute``): each saved shard opened once, whole tensors verified piece by
   piece into their targets (``read_tensors``), overlaps as whole checksum chunks
   (``read_chunks``). Any kind of target: views, conj/neg views and non-contiguous tensors
   get fresh memory and ``load_into`` copies into them.

Plain values (not tensors) come from the tree read: at the same world size this rank's own
(a per-rank RNG state stays per rank), at another saved rank 0's (the loop helper re-derives
per-rank values). Checkpoints whose manifests (format 1.1) do not record where sharded
tensors lie restore at their own world size only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, ManifestError, StateMismatch
from ..format.layout import Layout, full_layout, layout_of
from ..format.manifest import ShardManifest, TensorEntry
from ..format.read_items import ChunkRead
from ..format.state import decode_tree, is_dtensor, local_tensor, tensor_targets, tree_holds, unflatten
from ..format.tensor_io import read_chunks, read_tensors
from ..tiers.base import CheckpointId, TierReader
from .execute import LOCAL, OpenShards, first_sound, load_plan, restore_agreed, shard_manifest
from .narrow import agrees, overlapping
from .normalise import create_optimizer_state, normalise
from .optim_names import keyed_by_name
from .plan import Inventory, RestorePlan, ShardNeed, ShardPlan, every_shard, reshard_reads
from .state_load import check_restorable

log = logging.getLogger(__name__)


class NotReshardable(StateMismatch):
    """The checkpoint cannot be restored at this world size (it predates the layout record):
    raised on every rank, with no fallback to an older step, which would not help."""


@dataclass
class ReshardStats:
    saved_world: int
    bytes_needed: int  # this rank's new shards plus the unsharded values
    bytes_read: int  # whole checksum chunks covering them

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@dataclass
class _Source:
    """A saved shard whose (normalised) tree gives the values of some keys of the state."""

    shard: ShardPlan
    manifest: ShardManifest
    tree: dict
    state: dict  # the part of the target it covers
    targets: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Reads:
    """What a plan reads: per saved rank, tensor ids read whole (into their target where it
    fits); overlaps into ``dests`` (local shards by saved path); why overlaps were needed."""

    whole: dict[int, dict[int, torch.Tensor | None]] = field(default_factory=dict)
    chunks: list[ChunkRead] = field(default_factory=list)
    dests: dict[str, torch.Tensor] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)


def load_values(plan: RestorePlan, state: dict, rank: int, world_size: int, *, threads: int = 4,
                inventory: Inventory | None = None, overlaps: bool = False) -> tuple[dict, ReshardStats | None]:
    """Values for ``load_into`` on ``rank`` of a job of ``world_size`` (tensors in ``state``'s
    own where they fit), and what resharding read (None when every tensor was read whole
    from this rank's own shard). ``inventory``: where the other saved shards are, when a
    tensor is laid out otherwise at the same world size. ``overlaps``: every tensor with a
    target read from the overlaps of every saved shard, none whole (the differential
    conformance test: both plans must give the same bytes)."""
    with OpenShards(plan.ckpt_id) as opened:
        plan, sources, reads = plan_load(plan, state, rank, world_size, opened, inventory=inventory,
                                         overlaps=overlaps)
        return _execute(plan, sources, reads, opened, rank, threads,
                        resharded=plan.world_size != world_size or bool(reads.changes))


def plan_load(plan: RestorePlan, state: dict, rank: int, world_size: int, opened: OpenShards, *,
              inventory: Inventory | None = None, overlaps: bool = False) -> tuple[RestorePlan, list[_Source], _Reads]:
    """What ``load_values`` reads, decided from manifests alone (no tensor byte read): the plan
    (every saved shard when the state is laid out otherwise at the same world size), the
    normalised sources and the reads. ``scale_plan.py`` times it."""
    same = plan.world_size == world_size
    sources = _sources(plan, state, rank if same else 0, same, opened)
    create_optimizer_state(state)  # after the checks: a mismatch leaves the optimizer as it was
    for src in sources:
        src.targets = tensor_targets(src.state, src.tree, any_kind=True)
    reads = plan_reads(sources, overlaps=overlaps)
    if reads.changes and same and len(plan.shards) < plan.world_size:
        log.info("rank %d: step %d is laid out otherwise than the state (%s%s): resharding", rank,
                 plan.ckpt_id.step, "; ".join(reads.changes[:3]), " ..." if len(reads.changes) > 3 else "")
        plan = every_shard(inventory, plan, "; ".join(reads.changes[:3]))
    if reads.changes:  # some tensor needs the overlaps
        reads.chunks = _overlap_reads(plan, sources[0].manifest, reads.layouts, rank, opened)
    return plan, sources, reads


def _overlap_reads(plan: RestorePlan, anchor: ShardManifest, targets: dict[str, Layout], rank: int,
                   opened: OpenShards) -> list[ChunkRead]:
    """The saved chunks overlapping ``targets``, from the manifests of the saved shards that hold
    them as ``anchor``'s layouts say (``narrow.py``), each opened once; from every saved shard's
    when the anchor cannot say or the shards opened do not bear it out."""
    shards = {s.rank: s for s in plan.shards}
    wanted = overlapping(anchor, targets, plan.world_size, rank)
    if wanted is not None and wanted <= shards.keys():
        manifests = {r: shard_manifest(shards[r], plan.ckpt_id, opened) for r in sorted(wanted)}
        try:
            if agrees(manifests, anchor, targets):
                return reshard_reads(manifests, targets, rank)
            why = "the shards opened record other layouts than it predicts"
        except StateMismatch as e:
            why = str(e)
        log.info("rank %d: step %d's shard %d does not say where the others lie (%s): opening every saved shard",
                 rank, plan.ckpt_id.step, anchor.rank, why)
    manifests = {s.rank: shard_manifest(s, plan.ckpt_id, opened) for s in plan.shards}
    require_layouts(manifests, plan.ckpt_id)
    return reshard_reads(manifests, targets, rank)


def _sources(plan: RestorePlan, state: dict, anchor: int, same: bool, opened: OpenShards) -> list[_Source]:
    """The saved trees this rank takes values from, each normalised against the part of
    ``state`` it covers and checked (global shapes) before any byte is read."""
    wanted = plan.shards if same else [next(s for s in plan.shards if s.rank == anchor)]
    elsewhere = set(plan.receive).union(*(s.keys for s in wanted if s.keys is not None))
    out = []
    state = {k: v for k, v in state.items() if k not in plan.receive}  # another rank sends those
    for shard in wanted:
        man = shard_manifest(shard, plan.ckpt_id, opened)
        if not same:
            require_layouts({shard.rank: man}, plan.ckpt_id)
        if not isinstance(man.tree, dict):
            raise ManifestError(f"step {plan.ckpt_id.step}: the checkpoint's top level is not a dict")
        mine = (lambda k, keys=shard.keys: k in keys) if shard.keys is not None else (lambda k: k not in elsewhere)
        part = {k: v for k, v in state.items() if mine(k)}
        tree = normalise({k: v for k, v in man.tree.items() if mine(k)}, part, man.param_names)
        check_restorable(part, tree, man.tensors, whole=True)
        out.append(_Source(shard, man, tree, part))
    return out


def plan_reads(sources: list[_Source], *, overlaps: bool = False) -> _Reads:
    """Which saved tensor is read how: whole from its source shard where that covers its
    target exactly (the degenerate plan: nothing else to open), else (or, ``overlaps``,
    always) from the overlaps of every saved shard (listed by ``reshard_reads`` once their
    manifests are open)."""
    reads = _Reads()
    for src in sources:
        by_id = {e.id: e for e in src.manifest.tensors}
        whole = reads.whole.setdefault(src.shard.rank, {})
        unplaced = []
        for i in _ids(src.tree):
            e, t = by_id[i], src.targets.get(i)
            why = f"{e.path}: read from the overlaps, as asked" if overlaps and t is not None else _change(e, t)
            if why is None:
                whole[i] = t
            elif t is None:
                unplaced.append(e.path)
            else:
                reads.changes.append(why)
                reads.dests[e.path], reads.layouts[e.path] = _local(t), _layout(t, e.path)
        if unplaced:
            raise StateMismatch(f"no tensor in the state to hold the new shard of {', '.join(unplaced[:5])}"
                                f"{' ...' if len(unplaced) > 5 else ''}: a sharded tensor is read only into a "
                                "tensor of the state; add it there (a DTensor or a tensor of its global shape)")
    return reads
def _execute(plan: RestorePlan, sources: list[_Source], reads: _Reads, opened: OpenShards, rank: int,
             threads: int, *, resharded: bool) -> tuple[dict, ReshardStats | None]:
    """Read ``reads`` (each saved shard opened once, from its first sound source) and build
    the values of every source's tree."""
    ckpt_id, shards = plan.ckpt_id, {s.rank: s for s in plan.shards}
    chunks = {r: list(g) for r, g in groupby(sorted(reads.chunks, key=lambda rd: rd.rank), key=lambda rd: rd.rank)}
    got: dict[int, list[torch.Tensor | None]] = {}
    read_bytes = 0
    for r in sorted(chunks.keys() | {r for r, ids in reads.whole.items() if ids}):
        tensors, n = first_sound(shards[r], ckpt_id, partial(_read_saved, opened=opened, rank=r,
                                                             whole=reads.whole.get(r, {}), reads=chunks.get(r, []),
                                                             dests=reads.dests, threads=threads))
        got[r], read_bytes = tensors, read_bytes + n
    values: dict = {}
    for src in sources:
        mine = got.get(src.shard.rank, [])
        values.update(unflatten(src.tree, lambda i, mine=mine, src=src: mine[i] if i < len(mine) and mine[i]
                                is not None else src.targets[i]))
    if not resharded:
        return values, None
    whole = sum(e.nbytes for src in sources for e in src.manifest.tensors if e.id in reads.whole[src.shard.rank])
    needed = whole + sum(d.numel() * d.element_size() for d in reads.dests.values())
    stats = ReshardStats(plan.world_size, needed, read_bytes + whole)
    log.info("rank %d resharded step %d from %d ranks: read %d bytes for %d (amplification %.2f)", rank,
             ckpt_id.step, plan.world_size, stats.bytes_read, stats.bytes_needed, stats.amplification)
    return values, stats


def _ids(tree: Any) -> list[int]:
    """The tensor ids a saved tree refers to."""
    ids: list[int] = []
    decode_tree(tree, lambda tag, i: ids.append(i))
    return ids


def _change(e: TensorEntry, t: torch.Tensor | None) -> str | None:
    """Why saved tensor ``e`` does not cover exactly the elements of its target ``t``; None
    where it does (or where neither is sharded: a plain tensor, or one with no target)."""
    mine = layout_of(t, e.path) if is_dtensor(t) else None
    if e.layout is None and mine is None:
        return None
    if t is None:
        return f"{e.path}: saved as a shard of a DTensor {e.layout.global_shape}, no target holds it"
    if tuple(local_tensor(t).shape) != e.shape:
        return f"{e.path}: saved local shape {e.shape}, target's {tuple(local_tensor(t).shape)}"
    if e.layout is None or mine is None or (e.layout.global_shape, e.layout.runs) != (mine.global_shape, mine.runs):
        return f"{e.path}: saved as {_described(e.layout, e.shape)}, target {_described(mine, t.shape)}"
    return None


def load_shard(tier: TierReader, ckpt_id: CheckpointId, state: dict, *, threads: int = 4) -> dict:
    """Values of a one-rank checkpoint's shard in ``tier``, read into ``state``'s tensors
    through the one restore path (no agreement, no fallback: what the benchmarks time)."""
    return load_values(RestorePlan(ckpt_id, 1, [ShardPlan(0, [tier], None)]), state, 0, 1, threads=threads)[0]


def load(location: str, step: int | None = None, *, run: str | None = None) -> dict:
    """Read a checkpoint into plain tensors and values, without any training objects
    (inspection, export, inference): the newest valid one, or ``step``, every tensor whole."""
    return read_whole(location, step, run=run)[1]


def read_whole(location: str, step: int | None = None, *, run: str | None = None, threads: int = 4,
               by_name: bool = False) -> tuple[CheckpointId, dict]:
    """Every value of the newest valid checkpoint in ``location`` (or of ``step``), each tensor
    whole: a DTensor assembled from every saved shard (the overlap reads of resharding, into
    one process without a mesh), so what export writes is the saved tensor, not a shard of it.
    ``by_name``: named as ``get_state_dict`` names a state (modules without wrapper prefixes,
    optimizers keyed by parameter name: ``optim_names.keyed_by_name``, what an export to DCP
    writes)."""
    from ..tiers.locations import tiers_for

    inventory = Inventory(tiers_for(location, run=run))

    def execute(chosen: RestorePlan) -> dict:
        first = shard_manifest(chosen.shards[0], chosen.ckpt_id)
        if chosen.world_size == 1 or not tree_holds(first.tree, "__dtensor__"):
            values = load_plan(chosen, threads=threads)  # rank 0 holds it all, whole
        else:
            by_id = {e.id: e for e in first.tensors}
            blank = unflatten(first.tree, lambda i: torch.empty(
                by_id[i].layout.global_shape if by_id[i].layout else by_id[i].shape, dtype=by_id[i].torch_dtype))
            values = load_values(every_shard(inventory, chosen, "it holds sharded DTensors"), blank, 0, 1,
                                 threads=threads, inventory=inventory)[0]
        return keyed_by_name(values, first.param_names, lambda v: isinstance(v, torch.Tensor)) if by_name else values

    found = restore_agreed(LOCAL, inventory, lambda world: [ShardNeed(0)], execute, step=step)
    if found is None:
        raise CheckpointError(f"no checkpoint{'' if step is None else f' for step {step}'} in {location}")
    return found[0].ckpt_id, found[1]


def _described(layout: Layout | None, shape: tuple) -> str:
    if layout is None:
        return f"a tensor {tuple(shape)}"
    return (f"a DTensor {layout.global_shape} {'+'.join(layout.placements) or 'whole'} over mesh {layout.mesh_shape} "
            f"at {layout.coordinate} (local {layout.local_shape})")


def require_layouts(manifests: Mapping[int, ShardManifest], ckpt_id: CheckpointId) -> None:
    """Raise NotReshardable for a checkpoint of DTensors whose manifests do not say where each shard lies."""
    for man in manifests.values():
        if tree_holds(man.tree, "__dtensor__") and not any(e.layout is not None for e in man.tensors):
            raise NotReshardable(
                f"step {ckpt_id.step} was saved by {man.world_size} ranks in manifest format {man.format_version}, "
                "which does not record where each rank's shard of a DTensor lies; restore it with "
                f"{man.world_size} ranks (checkpoints saved by this version restore at any world size)")


def _layout(t: torch.Tensor, path: str) -> Layout:
    return layout_of(t, path) if is_dtensor(t) else full_layout(tuple(t.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    local = local_tensor(t)
    return local.reshape(1) if local.dim() == 0 else local


def _read_saved(tier: TierReader, *, opened: OpenShards, rank: int, whole: dict[int, torch.Tensor | None],
                reads: list[ChunkRead], dests: dict[str, torch.Tensor],
                threads: int) -> tuple[list[torch.Tensor | None], int]:
    """Saved rank ``rank``'s shard, from one opening: the tensors ``whole`` (ids -> their
    targets, where they fit), then the chunks overlapping this rank's shards. Returns the
    whole tensors by id (None for the others) and the overlaps' bytes read."""
    reader = opened.take(tier, rank)
    step = opened.ckpt_id.step
    try:
        got = read_tensors(reader, {i: t for i, t in whole.items() if t is not None}, step=step, tier=tier.name,
                           threads=threads, only=set(whole)) if whole else []
        return got, read_chunks(reader, reads, dests, step=step, tier=tier.name, threads=threads) if reads else 0
    finally:
        reader.close()
