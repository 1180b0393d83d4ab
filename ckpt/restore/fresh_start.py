"""Never start over silently.

A job that finds checkpoints it cannot restore (another model, another world size
without the layout to reshard, every copy damaged, a commit record unreadable, a shard
some rank has no copy of) must not train from scratch beside them: a later restart
would resume the new run's early steps, or retention would delete the old run's last
good state, and nobody would have been told. ``CheckpointManager.restore`` raises
instead, with the reason. Starting from scratch there is a decision the user states:
``restore(fresh_ok=True)``, or ``CKPT_GUARD_START_FRESH=1`` in the job's environment
(for the loop helper and the Lightning and Hugging Face integrations alike); it is
logged as a warning naming what was set aside. The old checkpoints stay; the new run's
saves form a newer generation, so later restarts resume the new run, and retention
deletes the old ones once ``keep_last`` newer ones exist.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

from ..errors import CheckpointError
from ..tiers.base import CheckpointId, DurableTier
from .execute import Agreement
from .plan import Inventory

log = logging.getLogger(__name__)

START_FRESH_ENV = "CKPT_GUARD_START_FRESH"
HOW = (f"to start from scratch on purpose, set {START_FRESH_ENV}=1 (or pass restore(fresh_ok=True)); the "
       "checkpoints stay, and the new run's saves form a newer generation")


def fresh_start_allowed(fresh_ok: bool | None) -> bool:
    """``fresh_ok`` if given, else the environment variable (1/true/yes)."""
    if fresh_ok is not None:
        return fresh_ok
    return os.environ.get(START_FRESH_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Listed:
    """What one rank's tiers list of one checkpoint."""

    complete: frozenset[int] | None  # saved ranks whose shards a tier lists complete; None: no tier does
    durable: tuple[str, str | None] | None  # (where, why unreadable) in a durable tier; None: in none


class JobListing:
    """Every rank's listings of the restore's tiers, gathered once after a restore found
    nothing: what the refusals to start over (here and ``Peering.nothing_readable``) read.
    Collective: every rank builds it, at the same point."""

    def __init__(self, coord: Agreement, inventory: Inventory) -> None:
        complete: dict[CheckpointId, set[int]] = {}
        durable: dict[CheckpointId, tuple[str, str | None]] = {}
        for tier, listing in zip(inventory.tiers, inventory.listings):
            for info in listing:
                if info.complete:
                    complete.setdefault(info.id, set()).update(info.ranks)
                if isinstance(tier, DurableTier) and (info.id not in durable or durable[info.id][1] is not None):
                    durable[info.id] = (f"{tier.name} ({tier.location})", info.error)  # a readable copy first
        mine = {i: Listed(frozenset(complete[i]) if i in complete else None, durable.get(i))
                for i in complete.keys() | durable.keys()}
        self.world_size = coord.world_size
        self.by_rank: list[dict[CheckpointId, Listed]] = coord.gather(mine)

    def held(self) -> dict[CheckpointId, set[int]]:
        """Per checkpoint, the saved ranks whose shards some rank's tier lists complete."""
        held: dict[CheckpointId, set[int]] = {}
        for theirs in self.by_rank:
            for ckpt_id, listed in theirs.items():
                if listed.complete is not None:
                    held.setdefault(ckpt_id, set()).update(listed.complete)
        return held

    def unread(self, ckpt_id: CheckpointId) -> str:
        """Which rank reads no copy of its own shard of ``ckpt_id`` (a node lost with it, and
        no copy elsewhere); a shard another rank needs when none is named."""
        own = [r for r, theirs in enumerate(self.by_rank)
               if r not in ((theirs[ckpt_id].complete or ()) if ckpt_id in theirs else ())]
        if not own:
            return "some rank has no copy of a shard it needs"
        return (f"rank(s) {', '.join(map(str, own))} read no copy of their own shard (lost with their node? keep "
                "one elsewhere: peers=1 or an object store)")

    def durable(self) -> dict[CheckpointId, dict[int, tuple[str, str | None]]]:
        """Per checkpoint in some durable tier, each listing rank's (where, why unreadable)."""
        seen: dict[CheckpointId, dict[int, tuple[str, str | None]]] = {}
        for rank, theirs in enumerate(self.by_rank):
            for ckpt_id, listed in theirs.items():
                if listed.durable is not None:
                    seen.setdefault(ckpt_id, {})[rank] = listed.durable
        return seen


def refuse_if_present(listing: JobListing) -> None:
    """After restore found nothing every rank can read: raise (on every rank alike) if any
    rank's durable tiers list a checkpoint at all, saying for each why it was not used.
    Memory slots alone do not count: a step sealed in memory but committed nowhere is an
    interrupted save (some rank may never have sealed it), not a checkpoint."""
    seen = listing.durable()
    if not seen:
        return
    lines = []
    for ckpt_id in sorted(seen, reverse=True)[:5]:
        by_rank = seen[ckpt_id]
        broken = next((f"unreadable in {where}: {error}" for where, error in by_rank.values() if error), None)
        lacking = ", ".join(str(r) for r in range(listing.world_size) if r not in by_rank)
        why = broken or (f"rank(s) {lacking} have no copy of it" if lacking else listing.unread(ckpt_id))
        lines.append(f"step {ckpt_id}: {why}")
    more = f"\n  ... and {len(seen) - 5} more" if len(seen) > 5 else ""
    raise CheckpointError("checkpoints exist, but none can be restored into this job; refusing to start over "
                          "beside them:\n  " + "\n  ".join(lines) + more + f"\n{HOW}")


def set_aside(error: CheckpointError, fresh_ok: bool | None, locations: Sequence[str]) -> None:
    """After a restore refused: re-raise ``error`` with how to start fresh on purpose
    (logged, and a note on its traceback), unless a fresh start was asked for: then say
    loudly that the checkpoints are set aside."""
    if not fresh_start_allowed(fresh_ok):
        log.error("restore refused: %s\n%s", error, HOW)
        if hasattr(error, "add_note") and HOW not in str(error):  # Python 3.11+
            error.add_note(HOW)
        raise error
    log.warning("STARTING FROM SCRATCH on purpose (fresh_ok / %s): the checkpoints in %s are set aside, not "
                "restored: %s", START_FRESH_ENV, ", ".join(locations), error)
