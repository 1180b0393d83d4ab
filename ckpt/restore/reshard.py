"""Restore at another world size: a checkpoint saved by N ranks, read into M.

What a torchtitan user expects of DCP's resharding, through our sources and checksums:

* **Sharded tensors** (DTensors: FSDP2, tensor parallel) land in this rank's new local
  shards. The plan (``plan.reshard_reads``) lists the saved chunks overlapping each of them;
  only those are read (whole checksum chunks, each verified before a byte is copied) and
  the overlap is copied straight into the local shard: nothing is gathered whole.
* **Everything else** (plain tensors: a DDP or ``replicated=`` model, the optimizer's step;
  plain values) comes from saved rank 0's shard, which holds every key (the replicated
  ones included), as DCP keeps one copy of what is not sharded. A value that differed per
  rank (a per-rank RNG state, a data position) is rank 0's: the loop helper re-derives
  those for the new world size.
* **The same world size is no exception**: this rank's saved shard is copied whole only
  when every tensor in it covers exactly the elements its target does (``layout_changes``);
  another placement, mesh or local shape, or a plain tensor for a DTensor, reshards.
* A tensor saved sharded may be restored unsharded (M = 1 without a mesh) and the reverse,
  and a model saved under DDP (``module.``) or torch.compile (``_orig_mod.``) into one
  without, or the reverse.
* **Optimizer state** follows its parameter: FSDP2's moments are DTensors laid out like
  their parameters, matched by parameter name (``optim_names.py``), not by position. An
  optimizer that has not stepped has no moments to read into, so its state is created
  first (zero gradients at lr 0, as ``get_state_dict`` does).

Checkpoints whose manifests (format 1.1) do not record where sharded tensors lie are
refused with the reason; the state is checked whole (global shapes) before any byte is read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, StateMismatch
from ..format.layout import Layout, full_layout, layout_of
from ..format.manifest import ShardManifest
from ..format.read_items import ChunkRead
from ..format.state import DTensor, local_tensor, tensor_targets, tree_holds, unflatten
from ..format.tensor_io import read_chunks, read_tensors
from ..tiers.base import CheckpointId, TierReader
from .execute import LOCAL, OpenShards, first_sound, load_plan, restore_agreed, shard_manifest
from .optim_names import renumber
from .plan import Inventory, RestorePlan, ShardNeed, canonical_path, every_shard, reshard_reads
from .state_load import align_key_types, check_restorable

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


def load_values(plan: RestorePlan, state: dict, rank: int, world_size: int, *, threads: int = 4,
                inventory: Inventory | None = None) -> tuple[dict, ReshardStats | None]:
    """Values for ``load_into`` on ``rank`` of a job of ``world_size``: this rank's whole shard
    when it holds exactly what the target does (same world size, every tensor laid out alike),
    else the overlaps of every saved shard (with what resharding read; None when it did not).
    ``inventory``: where the other saved shards are, when a layout differs at the same size."""
    with OpenShards(plan.ckpt_id) as opened:
        if plan.world_size == world_size:
            create_optimizer_state(state, sharded_only=True)  # FSDP2's moments must be DTensors to read into
            own = shard_manifest(plan.shards[0], plan.ckpt_id, opened)
            own.tree = align_key_types(own.tree, state)
            changes = layout_changes(own, state)
            if not changes:
                return load_plan(plan, state, threads=threads, opened=opened), None
            log.info("rank %d: step %d is laid out otherwise than the state (%s%s): resharding", rank,
                     plan.ckpt_id.step, "; ".join(changes[:3]), " ..." if len(changes) > 3 else "")
            plan = every_shard(inventory, plan, "; ".join(changes[:3]))
        return _load_resharded(plan, state, rank, threads, opened)


def _load_resharded(plan: RestorePlan, state: Mapping[str, Any], rank: int, threads: int,
                    opened: OpenShards) -> tuple[dict, ReshardStats]:
    """Execute ``plan`` (every saved shard) into ``state``'s own tensors on this ``rank``: the
    values for ``load_into`` and what was read. Each saved shard is opened once (``opened``):
    its manifest for the checks and plan, then its bytes."""
    ckpt_id = plan.ckpt_id
    shards = {s.rank: s for s in plan.shards}
    manifests = {r: shard_manifest(s, ckpt_id, opened) for r, s in shards.items()}
    first = manifests[0]
    require_layouts(manifests, ckpt_id)
    renumber(manifests, state)
    _align_module_keys(first.tree, state)
    first.tree = align_key_types(first.tree, state)
    check_restorable(state, first.tree, first.tensors, whole=True)
    create_optimizer_state(state)  # after the check: a mismatch leaves the optimizer as it was
    targets = tensor_targets(state, first.tree, any_kind=True)
    by_id = {e.id: e for e in first.tensors}
    unplaced = [by_id[i].path for i in by_id if by_id[i].layout is not None and i not in targets]
    if unplaced:
        raise StateMismatch(f"step {ckpt_id.step}: no tensor in the state to hold the new shard of "
                            f"{', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''}")
    sharded = {i: t for i, t in targets.items() if by_id[i].layout is not None or isinstance(t, DTensor)}
    layouts: dict[str, Layout] = {by_id[i].path: _layout(t, by_id[i].path) for i, t in sharded.items()}
    dests = {by_id[i].path: _local(t) for i, t in sharded.items()}
    reads = reshard_reads(manifests, layouts, rank)
    plain_ids = {i for i in by_id if i not in sharded}
    by_rank = {r: list(group) for r, group in groupby(sorted(reads, key=lambda rd: rd.rank), key=lambda rd: rd.rank)}
    plain: list[torch.Tensor | None] = []
    read_bytes = sum(by_id[i].nbytes for i in plain_ids)
    for r in sorted(by_rank.keys() | {0}):
        got, n = first_sound(shards[r], ckpt_id, partial(_read_saved, opened=opened, rank=r, reads=by_rank.get(r, []),
                                                         dests=dests, targets=targets if r == 0 else None,
                                                         only=plain_ids, threads=threads))
        plain, read_bytes = got if got is not None else plain, read_bytes + n
    values = unflatten(first.tree, lambda i: sharded[i] if i in sharded else plain[i])
    if not isinstance(values, dict):
        raise StateMismatch(f"step {ckpt_id.step}: the checkpoint's top level is not a dict")
    needed = sum(by_id[i].nbytes for i in plain_ids) + sum(d.numel() * d.element_size() for d in dests.values())
    stats = ReshardStats(plan.world_size, needed, read_bytes)
    log.info("rank %d resharded step %d from %d ranks: read %d bytes for %d (amplification %.2f)", rank,
             ckpt_id.step, plan.world_size, stats.bytes_read, stats.bytes_needed, stats.amplification)
    return values, stats


def load(location: str, step: int | None = None, *, run: str | None = None) -> dict:
    """Read a checkpoint into plain tensors and values, without any training objects
    (inspection, export, inference): the newest valid one, or ``step``, every tensor whole."""
    return read_whole(location, step, run=run)[1]


def read_whole(location: str, step: int | None = None, *, run: str | None = None,
               threads: int = 4) -> tuple[CheckpointId, dict]:
    """Every value of the newest valid checkpoint in ``location`` (or of ``step``), each tensor
    whole: a DTensor assembled from every saved shard (the overlap reads of resharding, into
    one process without a mesh), so what export writes is the saved tensor, not a shard of it."""
    from ..tiers.locations import tiers_for

    inventory = Inventory(tiers_for(location, run=run))

    def execute(chosen: RestorePlan) -> dict:
        with OpenShards(chosen.ckpt_id) as opened:
            first = shard_manifest(chosen.shards[0], chosen.ckpt_id, opened)
            if chosen.world_size == 1 or not tree_holds(first.tree, "__dtensor__"):
                return load_plan(chosen, None, threads=threads, opened=opened)  # rank 0 holds it all, whole
            chosen = every_shard(inventory, chosen, "it holds sharded DTensors")
            by_id = {e.id: e for e in first.tensors}
            blank = unflatten(first.tree, lambda i: torch.empty(
                by_id[i].layout.global_shape if by_id[i].layout else by_id[i].shape, dtype=by_id[i].torch_dtype))
            return _load_resharded(chosen, blank, 0, threads, opened)[0]

    found = restore_agreed(LOCAL, inventory, lambda world: [ShardNeed(0)], execute, step=step)
    if found is None:
        raise CheckpointError(f"no checkpoint{'' if step is None else f' for step {step}'} in {location}")
    return found[0].ckpt_id, found[1]


def layout_changes(saved: ShardManifest, state: Mapping) -> list[str]:
    """Where this rank's saved shard does not hold exactly the elements its target holds (the
    same global indices, in the same order): a DTensor's runs, a plain tensor for a DTensor or
    the reverse, a saved DTensor with no target. Empty: the shard can be copied whole."""
    targets = tensor_targets(state, saved.tree, any_kind=True)
    changes = []
    for e in saved.tensors:
        t = targets.get(e.id)
        if t is None:
            if e.layout is not None:
                changes.append(f"{e.path}: saved as a shard of a DTensor {e.layout.global_shape}, no target holds it")
            continue
        mine = layout_of(t, e.path) if isinstance(t, DTensor) else None
        if tuple(local_tensor(t).shape) != e.shape and (e.layout is not None or mine is not None):
            changes.append(f"{e.path}: saved local shape {e.shape}, target's {tuple(local_tensor(t).shape)}")
            continue
        if e.layout is None and mine is None:
            continue
        if e.layout is None or mine is None or (e.layout.global_shape, e.layout.runs) != (mine.global_shape, mine.runs):
            changes.append(f"{e.path}: saved as {_described(e.layout, e.shape)}, target {_described(mine, t.shape)}")
    return changes


def _described(layout: Layout | None, shape: tuple) -> str:
    if layout is None:
        return f"a tensor {tuple(shape)}"
    return (f"a DTensor {layout.global_shape} {'+'.join(layout.placements) or 'whole'} over mesh {layout.mesh_shape} "
            f"at {layout.coordinate} (local {layout.local_shape})")


def _align_module_keys(tree: Any, state: Mapping[str, Any]) -> None:
    """Rename a saved model's keys to the target module's where they differ only by wrapper
    prefixes (saved under DDP, restored into FSDP2 or a bare module, or the reverse)."""
    for key, module in state.items():
        saved = tree.get(key) if isinstance(tree, dict) and isinstance(module, torch.nn.Module) else None
        if not isinstance(saved, dict) or "__dict__" in saved:
            continue
        names = {canonical_path(k): k for k in module.state_dict()}
        if set(saved) != set(names.values()) and {canonical_path(k) for k in saved} == set(names):
            tree[key] = {names[canonical_path(k)]: v for k, v in saved.items()}


def require_layouts(manifests: Mapping[int, ShardManifest], ckpt_id: CheckpointId) -> None:
    """Raise NotReshardable for a checkpoint of DTensors whose manifests do not say where each shard lies."""
    for man in manifests.values():
        if tree_holds(man.tree, "__dtensor__") and not any(e.layout is not None for e in man.tensors):
            raise NotReshardable(
                f"step {ckpt_id.step} was saved by {len(manifests)} ranks in manifest format {man.format_version}, "
                "which does not record where each rank's shard of a DTensor lies; restore it with "
                f"{len(manifests)} ranks (checkpoints saved by this version restore at any world size)")


def create_optimizer_state(state: Mapping[str, Any], *, sharded_only: bool = False) -> None:
    """Moments to read into, laid out like their parameters (DCP's own initialisation: one
    step of zero gradients at lr 0), for each optimizer of ``state`` that has not stepped
    (``sharded_only``: of DTensor parameters, whose moments must be DTensors too, not the
    plain tensors ``load_state_dict`` would otherwise keep)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for value in state.values():
        if isinstance(value, torch.optim.Optimizer) and not value.state and (not sharded_only or any(
                isinstance(p, DTensor) for group in value.param_groups for p in group["params"])):
            _init_optim_state(value)


def _layout(t: torch.Tensor, path: str) -> Layout:
    return layout_of(t, path) if isinstance(t, DTensor) else full_layout(tuple(t.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    local = local_tensor(t)
    return local.reshape(1) if local.dim() == 0 else local


def _read_saved(tier: TierReader, *, opened: OpenShards, rank: int, reads: list[ChunkRead],
                dests: dict[str, torch.Tensor], targets: dict[int, torch.Tensor] | None, only: set[int],
                threads: int) -> tuple[list[torch.Tensor | None] | None, int]:
    """Saved rank ``rank``'s shard, from one opening: with ``targets`` (saved rank 0), its
    unsharded tensors ``only``; then the chunks overlapping this rank's shards. Returns
    the unsharded tensors (None without ``targets``) and the overlaps' bytes read."""
    reader = opened.take(tier, rank)
    step = opened.ckpt_id.step
    try:
        plain = None if targets is None else read_tensors(
            reader, {i: t for i, t in targets.items() if i in only}, step=step, tier=tier.name, threads=threads,
            only=only)
        return plain, read_chunks(reader, reads, dests, step=step, tier=tier.name, threads=threads) if reads else 0
    finally:
        reader.close()
