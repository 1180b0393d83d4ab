"""How much shared memory a node's checkpoints take, and refusing at start-up when
/dev/shm cannot hold it (rather than failing at some later save, or when a peer's
replica arrives, hours into the run).

Per node: every rank keeps its own slots (2; 3 without a disk tier; one more with
``overlap=True``) and three replica slots per shard it holds for another node
(``peers/replicas.py``: the third only when the node's ranks' newest replicas differ),
``peers`` of them when nodes have equal rank counts: (2 + 3 x peers) x the node's shards
with a disk tier and no overlap.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from ..errors import CheckpointError
from ..tiers.memory.copier import ALIGN
from ..tiers.memory.namespace import free_bytes, slot_file_bytes
from ..tiers.memory.slots import REPLICA_SLOTS

if TYPE_CHECKING:
    from pathlib import Path

    from ..peers.peering import Peering
    from ..tiers.memory.slots import SlotPool


@dataclass(frozen=True)
class ShmNeed:
    shard_bytes: int  # this rank's shard (the node's other ranks are taken to be alike)
    ranks_on_node: int
    own_slots: int
    replicas_held: int  # shards this rank holds for other nodes

    @property
    def bytes(self) -> int:
        return self.ranks_on_node * (self.own_slots + REPLICA_SLOTS * self.replicas_held) * self.shard_bytes

    def describe(self) -> str:
        return (f"{self.ranks_on_node} rank(s) x ({self.own_slots} own slots + {REPLICA_SLOTS} x {self.replicas_held} "
                f"replica(s) held) x {_gib(self.shard_bytes)} shard = {_gib(self.bytes)}")


def need_of(shard_bytes: int, pool: "SlotPool", peering: "Peering | None") -> ShmNeed:
    """This node's need, from peer placement when there is one (else LOCAL_WORLD_SIZE ranks)."""
    if peering is None:
        return ShmNeed(shard_bytes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), len(pool.slots), 0)
    return ShmNeed(shard_bytes, peering.nodes.count(peering.node), len(pool.slots), len(peering.held_for))


def check_room(ns: "Path", pool: "SlotPool", shard_bytes: int, peering: "Peering | None") -> None:
    """Raise a CheckpointError naming the sizes when the memory directory's free space,
    plus what this job already allocated there (an earlier incarnation's slots, reused),
    is short of this node's need."""
    need = need_of(shard_bytes, pool, peering)
    allocated = slot_file_bytes(ns) + (slot_file_bytes(peering.replica_ns) if peering is not None else 0)
    free = free_bytes(ns)
    if need.bytes - allocated > free:
        raise CheckpointError(
            f"{ns.parent} cannot hold this node's checkpoints: shared memory needed, (own slots + {REPLICA_SLOTS} x "
            f"peers) x the node's shards: {need.describe()}; {_gib(free)} free, {_gib(allocated)} already allocated "
            "by this job. "
            "Enlarge /dev/shm (docker run --shm-size, a bigger tmpfs), lower peers=, or pass memory_dir= on a "
            "larger tmpfs")


def refusal_of(prepare: Callable[[Mapping[str, Any]], None], state: Mapping[str, Any]) -> str | None:
    """``prepare(state)``'s refusal as a message every rank can be told, or None."""
    try:
        prepare(state)
    except CheckpointError as e:
        return str(e)
    return None


def lazy_optimizer_bytes(values: Iterable[Any]) -> int:
    """Bytes an optimizer will add at its first step: two moments per stateless parameter."""
    total = 0
    for v in values:
        if isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                total += sum(2 * (p.numel() * p.element_size() + ALIGN) for p in group["params"] if p not in v.state)
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
