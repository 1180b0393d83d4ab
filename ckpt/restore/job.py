"""One rank's restore within a job: the tiers a needed shard may come from, one step agreed
across ranks, read and loaded in place; when there is none, why (what every rank saw) or a
refusal. What a restore changes in the manager (its lineage, re-protecting a shard that
came from another node) stays there."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

from ..coordination import Coordinator
from ..errors import CheckpointError
from ..tiers.base import TierReader
from ..tiers.memory import MemoryTier
from ..tiers.memory.namespace import rank_dirs
from .execute import restore_agreed
from .fresh_start import JobListing, refuse_if_present
from .plan import Inventory, RestorePlan, ShardNeed
from .reshard import ReshardStats, load_values
from .share import send_missing
from .state_load import load_into


def readable_tiers(memory: MemoryTier, namespace: Path, holder: int, *, replicated: bool, node_memory: bool,
                   durable: list[TierReader]) -> list[TierReader]:
    """Every tier a needed shard may come from, fastest first: this rank's memory, the
    replica holder's (read-only), with ``node_memory`` every other rank's slots on this node
    (a rank lost in process left its own), then the durable tiers."""
    others = [MemoryTier(namespace, holder)] if replicated and holder != memory.rank else []
    if node_memory:
        own = {memory.dir, *(t.dir for t in others)}
        others += [MemoryTier(namespace, int(d.name.split("-")[1])) for d in rank_dirs(namespace) if d not in own]
    return [memory, *others, *durable]


def restore_job(coord: Coordinator, tiers: list[TierReader], needs: Callable[..., list[ShardNeed]],
                state: dict[str, Any], step: int | None, *, rank: int, world_size: int, threads: int,
                peering: Any = None, avoid: Callable[[Any], bool] | None = None
                ) -> tuple[RestorePlan, ReshardStats | None] | None:
    """Agree with every rank on the newest step all can read (or ``step``), load it into
    ``state`` in place; returns its plan and, when it was saved at another world size, the
    resharding's figures. None when there is nothing to restore; raises CheckpointError for
    a ``step`` that is nowhere, or checkpoints that exist but cannot be used (``fresh_start``)."""
    if peering is not None:
        tiers = peering.restore_tiers(coord, tiers)
    inventory = Inventory(tiers, avoid)  # avoid: ids a failed canary rules out (``save/canary.py``)
    load = partial(load_values, state=state, rank=rank, world_size=world_size, threads=threads, inventory=inventory)
    found = restore_agreed(coord, inventory, needs, load, step=step)
    if found is None:
        if step is not None:
            raise CheckpointError(f"step {step} is in no tier ({', '.join(t.location for t in tiers)})")
        listing = JobListing(coord, inventory)  # what was there, from every rank: why none was used
        if peering is not None:
            peering.nothing_readable(listing)
        refuse_if_present(listing)
        return None
    plan, (values, reshard) = found
    read = {k: v for k, v in state.items() if k not in plan.receive}  # the rest is sent by another rank
    load_into(read, values)
    state.update(read)
    send_missing(coord, state, plan)  # replicated keys this rank (or another) could read no copy of
    return plan, reshard
