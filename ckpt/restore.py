"""Choosing what to restore: candidates across tiers, newest complete first, fastest
tier first, verified on read, falling back past anything damaged."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


from .errors import CheckpointError, DamagedCheckpoint, ManifestError
from .locations import tiers_for
from .state import tensor_targets, unflatten
from .tensor_io import Progress, read_tensors, verify_shard
from .tiers.base import CheckpointId, CheckpointInfo, Tier

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    info: CheckpointInfo
    tier: Tier


def candidates(tiers: Sequence[Tier], step: int | None = None) -> list[Candidate]:
    """Complete checkpoints, newest (generation, step) first; for one id, tiers in the
    order given (fastest first). ``step`` keeps only that step, newest generation first."""
    found: list[tuple[CheckpointId, int, Candidate]] = []
    for rank, tier in enumerate(tiers):
        for info in tier.list():
            if info.complete and (step is None or info.id.step == step):
                found.append((info.id, rank, Candidate(info, tier)))
    found.sort(key=lambda x: (x[0].generation, x[0].step, -x[1]), reverse=True)
    return [c for _, _, c in found]


def read_checkpoint(tier: Tier, ckpt_id: CheckpointId, *, rank: int = 0, world_size: int | None = None,
                    state: Mapping[str, Any] | None = None, threads: int = 4,
                    progress: Progress | None = None) -> dict:
    """Read and verify one rank's shard; tensors land in ``state``'s own tensors where they fit."""
    manifest = tier.read_manifest(ckpt_id)
    if world_size is not None and manifest.world_size != world_size:
        raise CheckpointError(f"step {ckpt_id.step} was saved by {manifest.world_size} ranks; this job has "
                              f"{world_size}. Resume with the same world size (resharding is not supported)")
    ref = next((s for s in manifest.shards if s.rank == rank), None)
    if ref is None:
        raise FileNotFoundError(f"step {ckpt_id.step}: rank {rank}'s shard is not in {tier.location}")
    reader = tier.open_shard(ckpt_id, ref)
    try:
        targets = tensor_targets(state, reader.manifest.tree) if state is not None else {}
        tensors = read_tensors(reader, targets, step=ckpt_id.step, tier=tier.name, threads=threads, progress=progress)
        values = unflatten(reader.manifest.tree, lambda i: tensors[i])
    finally:
        reader.close()
    if not isinstance(values, dict):
        raise ManifestError(f"step {ckpt_id.step}: the checkpoint's top level is not a dict")
    return values


def restore_newest(tiers: Sequence[Tier], *, step: int | None = None, rank: int = 0, world_size: int | None = None,
                   state: Mapping[str, Any] | None = None, threads: int = 4,
                   progress: Progress | None = None) -> tuple[Candidate, dict] | None:
    """The newest candidate that reads and verifies; damaged ones are logged and skipped."""
    failures = []
    for cand in candidates(tiers, step):
        try:
            return cand, read_checkpoint(cand.tier, cand.info.id, rank=rank, world_size=world_size, state=state,
                                         threads=threads, progress=progress)
        except (DamagedCheckpoint, ManifestError, OSError, EOFError) as e:  # OSError covers a missing shard
            log.warning("skipping step %d in tier %s (%s): %s", cand.info.id.step, cand.tier.name,
                        cand.tier.location, e)
            failures.append(f"{cand.tier.name}: {e}")
    if failures:
        raise CheckpointError("no valid checkpoint" + (f" for step {step}" if step is not None else "")
                              + "; every candidate is damaged:\n  " + "\n  ".join(failures)
                              + ("\nthe objects in state may be partly overwritten" if state else ""))
    return None


def verify_checkpoint(tier: Tier, ckpt_id: CheckpointId, *, threads: int = 4,
                      progress: Progress | None = None) -> bool:
    """Check every byte of every shard against the manifest. Returns False when the copy
    is sealed but has no checksums yet (a memory slot still draining); raises if damaged."""
    manifest = tier.read_manifest(ckpt_id)
    for ref in manifest.shards:
        reader = tier.open_shard(ckpt_id, ref)
        try:
            if not reader.manifest.has_checksums:
                return False
            verify_shard(reader, step=ckpt_id.step, tier=tier.name, threads=threads, progress=progress)
        finally:
            reader.close()
    return True


def load(location: str, step: int | None = None, *, run: str | None = None) -> dict:
    """Read a checkpoint into plain tensors and values, without any training objects
    (inspection, export, inference). Newest valid one unless ``step`` is given."""
    found = restore_newest(tiers_for(location, run=run), step=step)
    if found is None:
        raise CheckpointError(f"no checkpoint{'' if step is None else f' for step {step}'} in {location}")
    return found[1]
