"""``ckpt restore``'s copy: a checkpoint from whichever tiers hold it into a local directory,
each shard checked against the source's checksums before the copy is committed."""
from __future__ import annotations

from typing import Callable

from ..errors import DamagedCheckpoint
from ..format.manifest import Manifest, ShardRef
from ..tiers.base import CheckpointId, TierReader
from ..tiers.local import LocalDiskTier
from .execute import first_sound, open_shard
from .plan import RestorePlan


def copy_verified(plan: RestorePlan, target: LocalDiskTier, progress: Callable[[int], object]) -> None:
    """Copy every shard from its first sound source, check the copy against the source
    manifest's checksums, then commit: each byte crosses the network once, and nothing
    unverified is committed."""
    ckpt_id = plan.ckpt_id
    refs = [first_sound(s, ckpt_id, lambda tier, s=s: _copy_shard(tier, target, ckpt_id, s.rank, progress))
            for s in plan.shards]
    target.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, plan.world_size, refs))


def _copy_shard(source: TierReader, target: LocalDiskTier, ckpt_id: CheckpointId, rank: int,
                progress: Callable[[int], object]) -> ShardRef:
    from ..format.verify import verify_shard

    reader = open_shard(source, ckpt_id, rank)
    try:
        if not reader.manifest.has_checksums:
            raise DamagedCheckpoint(ckpt_id.step, source.location, "checksums not computed yet", source.name)
        ref = target.write_shard(ckpt_id, reader)
    finally:
        reader.close()
    progress(ref.data_bytes)
    copy = target.open_shard(ckpt_id, ref)
    try:
        verify_shard(copy, step=ckpt_id.step, tier=source.name, progress=progress)
    finally:
        copy.close()
    return ref
