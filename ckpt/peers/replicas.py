"""Writing replicas into this node's replica slots: the memory tier's slot pool, one
per saved rank, so replicas keep its invariants (pre-allocated and pre-faulted
files, 0600 in private directories, two slots so an incoming replica never
overwrites the newest sealed one, the seal written last). A replica is sealed only
once every byte has arrived and matched its chunk checksums; it outlives both the
sender and the process that received it (the slots stay; the pool's lock goes).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError
from ..manifest import ShardManifest
from ..tiers.memory.reader import SlotReader
from ..tiers.memory.slots import SlotPool
from ..verify import verify_shard


class ReplicaSlots:
    """The replica slot pools this process writes, opened on the first replica of each
    saved rank (the pool takes that rank directory's lock while this process lives)."""

    def __init__(self, ns: Path, owner: dict, *, threads: int = 2) -> None:
        self.ns, self._owner, self._threads = ns, owner, threads
        self._pools: dict[int, SlotPool] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def _pool(self, rank: int) -> tuple[SlotPool, threading.Lock]:
        with self._guard:
            if rank not in self._pools:
                self._pools[rank] = SlotPool(self.ns, rank, slots=2, owner={**self._owner, "replica_of": rank})
                self._locks[rank] = threading.Lock()
            return self._pools[rank], self._locks[rank]

    def receive(self, manifest: ShardManifest, fill: Callable[[memoryview], None]) -> None:
        """Take a replica of ``manifest``'s shard: ``fill`` writes its data bytes into the
        slot; they are checked against the manifest's checksums, then sealed."""
        if not manifest.has_checksums:
            raise CheckpointError(f"replica of rank {manifest.rank}'s step {manifest.step} has no checksums")
        pool, lock = self._pool(manifest.rank)
        with lock:  # one replica of a rank at a time: reserve() then never waits
            slot, _ = pool.reserve(manifest.step)
            try:
                slot.unseal()
                slot.ensure(manifest.data_bytes)
                fill(memoryview(slot.buffer.numpy())[: manifest.data_bytes])
                verify_shard(SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, seal=None),
                             step=manifest.step, tier="peer", threads=self._threads)
                slot.seal(manifest)
            finally:
                slot.idle.set()

    def close(self) -> None:
        with self._guard:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
