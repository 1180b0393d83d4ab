"""Carrying checkpoints off the node: the object-store drain.

Uploads run on their own queue and thread, so a slow or unreachable store never
holds up the disk drain or the memory slots. A checkpoint goes up from the disk
tier once it is committed there (pinned against disk retention until uploaded), or
straight from its memory slot when the save is urgent or there is no disk tier.
At most one routine upload is in flight, and routine uploads are spaced by
``interval_s``: a save made meanwhile stays local, and the next one after the
pending upload ends goes up. The newest step, if it stayed local, goes up at
``flush`` (``close()``, the end of ``ckpt.resumable``, preemption): the newest
committed step always ends off-node. Every decision is taken from flags agreed
across ranks, so all ranks upload, and commit, the same steps.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ..restore.execute import Agreement
from ..tiers.base import CheckpointId, DurableTier, ShardReader
from .commit import Committer
from .drain import Drainer, SaveHandle

log = logging.getLogger(__name__)


class Offloader:
    """Uploads shards to ``tier`` and commits them through ``committer``; a checkpoint read
    from another tier (``pin_in``) stays pinned there against retention until uploaded."""

    def __init__(self, tier: DurableTier, committer: Committer, *, interval_s: float) -> None:
        self.tier, self.interval_s = tier, interval_s
        self._committer = committer
        self._drainer = Drainer("ckpt-offload")
        self._routine: SaveHandle | None = None  # the routine upload not yet finished, if any
        self._last_start = float("-inf")
        self.owed: CheckpointId | None = None  # the newest step, when it stayed local

    def decide(self, coord: Agreement, ckpt_id: CheckpointId, urgent: bool) -> bool:
        """Whether the save of ``ckpt_id`` goes to the object store (decided at ``save()`` on
        every rank, one all-reduce, so its handle knows what to wait for): urgent ones
        always; others once per ``interval_s`` while no routine upload is pending."""
        h = self._routine
        busy = h is not None and h.error is None and self.tier.name not in h.durable_s
        early = time.monotonic() - self._last_start < self.interval_s
        busy, early = coord.any(busy, early)
        upload = urgent or not (busy or early)
        self.owed = None if upload else ckpt_id
        return upload

    def claim(self, handle: SaveHandle, urgent: bool) -> None:
        """Record that ``handle``'s checkpoint will be uploaded."""
        if not urgent:
            self._routine, self._last_start = handle, time.monotonic()

    def flush(self, open_source: Callable[[CheckpointId], ShardReader], pin_in: str | None) -> None:
        """Upload the owed step, if any (``open_source`` opens its local copy), and wait for
        every queued upload. Every rank calls it at the same point."""
        owed, self.owed = self.owed, None
        if owed is not None:
            log.info("uploading step %d, the newest, which stayed local when it was saved", owed.step)
            handle = SaveHandle(owed.step, [self.tier.name])
            self.submit(owed, lambda: open_source(owed), handle, urgent=False, pin_in=pin_in)
        self._drainer.join()

    def submit(self, ckpt_id: CheckpointId, open_source: Callable[[], ShardReader], handle: SaveHandle, *,
               urgent: bool, pin_in: str | None = None, on_exit: Callable[[], None] = lambda: None) -> None:
        """Queue the upload; ``open_source`` opens the copy to read when the job starts."""
        if pin_in is not None:
            self._committer.pin(pin_in, ckpt_id)

        def done() -> None:
            if pin_in is not None:
                self._committer.unpin(pin_in, ckpt_id)
            on_exit()

        self._drainer.submit(lambda: self._upload(ckpt_id, open_source, handle), handle, urgent=urgent, on_exit=done)

    def _upload(self, ckpt_id: CheckpointId, open_source: Callable[[], ShardReader], handle: SaveHandle) -> None:
        reader = open_source()
        try:
            ref = self.tier.write_shard(ckpt_id, reader)
        finally:
            reader.close()
        self._committer.commit(self.tier, ckpt_id, ref)
        handle.mark(self.tier.name)
        log.info("step %d is durable off-node in %s, %.1f s after save()", ckpt_id.step, self.tier.location,
                 handle.durable_s[self.tier.name])

    def raise_error(self) -> None:
        self._drainer.raise_error()

    def close(self) -> None:
        """Finish queued uploads, then stop the thread and release the tier."""
        try:
            self._drainer.join()
        finally:
            self._drainer.close()
            self.tier.close()
