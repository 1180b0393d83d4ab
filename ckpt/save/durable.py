"""The durable tiers one rank writes (its disk root, the job's object store) and the
``Committer`` that makes a step visible in them once every rank's shard is there. Opening
them is collective: every rank claims the tiers for its job and learns which volume each
rank's shards land on (ranks sharing a volume share its commits and retention)."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Mapping

from .. import secret
from ..coordination import Coordinator, store_connector
from ..errors import CheckpointError
from ..tiers.base import DurableTier
from ..tiers.local import LocalDiskTier
from ..tiers.locations import object_store_tier
from .commit import Committer, commit_key, retention
from .ownership import claim_for_job


@dataclass
class DurableTiers:
    disk: LocalDiskTier | None
    object: DurableTier | None
    committer: Committer

    @property
    def tiers(self) -> list[DurableTier]:
        """Fastest first: the disk, then the object store."""
        return [t for t in (self.disk, self.object) if t is not None]


def open_durable(coord: Coordinator, root: str | os.PathLike | None, object_store: str | DurableTier | None, *,
                 storage_options: dict | None, run: str, threads: int, keep_last: int | Mapping[str, int],
                 commit_timeout_s: float) -> DurableTiers:
    """Every rank at once: open the tiers (one at least), claim them for ``run``, register
    each with the committer by volume."""
    keep_by_tier, default_keep = retention(keep_last)
    disk = LocalDiskTier(root, threads=threads) if root is not None else None
    if disk is not None:
        disk.root.mkdir(parents=True, exist_ok=True)
    obj = (object_store if object_store is None or isinstance(object_store, DurableTier)
           else object_store_tier(object_store, storage_options))
    tiers = [t for t in (disk, obj) if t is not None]
    claim_for_job(coord, tiers, run)  # before anything is swept or pruned
    # Alone, each tier is one volume: nothing is written to the root to find out.
    mine = [t.volume for t in tiers] if coord.world_size > 1 else ["local"] * len(tiers)
    key = commit_key()
    job, keys, *volumes = zip(*coord.gather([uuid.uuid4().hex, key and secret.fingerprint(key), *mine]))
    if len(set(keys)) > 1:  # every commit would time out on values the others cannot check
        raise CheckpointError(f"the ranks hold different job secrets (or some none): give every rank the same "
                              f"{secret.SECRET_FILE_ENV} or {secret.SECRET_ENV}")
    committer = Committer(coord.rank, coord.world_size, store=store_connector(f"{run}/{job[0]}", commit_timeout_s),
                          keep_last=keep_by_tier, default_keep=default_keep, timeout_s=commit_timeout_s, key=key)
    for tier, by_rank in zip(tiers, volumes):
        committer.register(tier, list(by_rank))
    return DurableTiers(disk, obj, committer)
