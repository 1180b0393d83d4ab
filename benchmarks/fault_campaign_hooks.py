"""Faults the fault campaign (benchmarks/fault_campaign.py) plants inside a holder of peer
replicas (ckpt/peers/replicas.py), installed by its job's worker (tests/inprocess_child.py
``--peer-fault``) on one node only, never in the library itself.

``wrong_at_save``: the first replica of step ``at`` or later that this node receives has one
byte flipped after its chunks were checked and before it is sealed (memory that went bad
in the holder): sealed, it looks sound, and only the restore's own check can refuse it.
Every later replica of that rank is then refused (the holder's memory stays bad), so the
damaged one stays the newest this node holds of it until the campaign kills the other node:
a sound newer replica that arrived between the fault and the kill would be what the restore
takes, and the damaged one would never be read.
``stall_receive``: the first such replica is held before its first byte is taken, so the
holder is caught (and killed by the campaign) while it receives it.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ckpt.errors import CheckpointError
from ckpt.peers import replicas

KINDS = ("wrong_at_save", "stall_receive")


def install(kind: str, at: int, emit: Callable[..., None]) -> None:
    """Patch this process's replica slots: ``kind`` happens once, to the first replica of a step
    ``>= at``; ``emit(event="fault", ...)`` says when (the campaign waits for it)."""
    fill, receive = replicas.ReplicaSlots._fill_checked, replicas.ReplicaSlots.receive
    once = threading.Lock()
    fired: list[int] = []
    said: list[int] = []

    def fires(step: int) -> bool:
        with once:
            if fired or step < at:
                return False
            fired.append(step)
            return True

    def patched_fill(self: replicas.ReplicaSlots, reader, recv) -> None:
        man = reader.manifest
        if kind == "stall_receive" and fires(man.step):
            emit(event="fault", step=man.step, peer_fault=kind, replica_of=man.rank)
            time.sleep(3600)  # the campaign kills this node now
        fill(self, reader, recv)
        if kind == "wrong_at_save" and man.data_bytes and fires(man.step):
            view = reader.view(0, man.data_bytes)
            view[man.data_bytes // 2] ^= 0xFF

    def patched_receive(self: replicas.ReplicaSlots, manifest, recv, node=None) -> None:
        if kind == "wrong_at_save" and said and manifest.step > said[0] and manifest.rank == said[1]:
            raise CheckpointError(f"fault campaign: this holder took no replica after its damaged step {said[0]}")
        receive(self, manifest, recv, node)
        if kind == "wrong_at_save" and fired == [manifest.step] and not said:
            said.extend((manifest.step, manifest.rank))  # sealed now, wrong byte and all
            emit(event="fault", step=manifest.step, peer_fault=kind, replica_of=manifest.rank)

    replicas.ReplicaSlots._fill_checked = patched_fill
    replicas.ReplicaSlots.receive = patched_receive
