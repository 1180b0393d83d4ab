"""The generation every save is stamped with (``CheckpointId.generation``), agreed by all
ranks. A job that restored the newest step continues its lineage; one that resumed an
older step, or restored nothing while checkpoints exist, starts a new one, so its saves
never mix with a branch it abandoned."""
from __future__ import annotations

from ..coordination import Coordinator
from ..tiers.base import CheckpointId, TierReader


class Lineage:
    def __init__(self, coord: Coordinator, tiers: list[TierReader]) -> None:
        self._coord, self._tiers = coord, tiers
        self._generation: int | None = None

    def newest(self) -> CheckpointId | None:
        return max((i.id for t in self._tiers for i in t.list()), default=None)

    def current(self) -> int:
        """The generation of this job's saves; the first call lists the tiers."""
        if self._generation is None:
            newest = self.newest()  # no restore happened: whatever is here belongs to another lineage
            self._generation = self._coord.max(newest.generation + 1 if newest else 0)
        return self._generation

    def resumed(self, ckpt_id: CheckpointId) -> None:
        """Every rank, after restoring ``ckpt_id``."""
        newest = self.newest() or ckpt_id
        generation = self._coord.max(newest.generation)
        self._generation = generation if self._coord.all(ckpt_id == newest) else generation + 1
