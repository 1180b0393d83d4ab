"""Writing replicas into this node's replica slots: the memory tier's slot pool, one
per saved rank, so replicas keep its invariants (pre-allocated and pre-faulted
files, 0600 in private directories, two slots so an incoming replica never
overwrites the newest sealed one, the seal written last). A replica is sealed only
once every byte has arrived and matched its chunk checksums; it outlives both the
sender and the process that received it (the slots stay; the pool's lock goes).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError
from ..format.checksum import crc32c_of
from ..format.manifest import ShardManifest
from ..format.read_items import ReadItem, read_items
from ..format.verify import mismatch
from ..tiers.memory.reader import SlotReader
from ..tiers.memory.slots import SlotPool
from .wire import PIECE

_RECV_STEP = PIECE  # bytes received between hand-offs to the checkers: one sealed piece, one recv call


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

    def receive(self, manifest: ShardManifest, recv: Callable[[memoryview], None]) -> None:
        """Take a replica of ``manifest``'s shard: ``recv`` fills each piece of the slot with
        the next data bytes; every chunk is checked against its checksum, then the slot is
        sealed."""
        if not manifest.has_checksums:
            raise CheckpointError(f"replica of rank {manifest.rank}'s step {manifest.step} has no checksums")
        pool, lock = self._pool(manifest.rank)
        with lock:  # one replica of a rank at a time: reserve() then never waits
            slot, _ = pool.reserve(manifest.step)
            try:
                slot.unseal()
                slot.ensure(manifest.data_bytes)
                reader = SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, epoch=None)
                self._fill_checked(reader, recv)
                slot.seal(manifest)
            finally:
                slot.idle.set()

    def _fill_checked(self, reader: SlotReader, recv: Callable[[memoryview], None]) -> None:
        """Receive the data bytes in order, checking each checksum chunk on a worker thread
        as soon as it has arrived: the check overlaps the transfer instead of following it."""
        man = reader.manifest
        view = reader.view(0, man.data_bytes)
        chunk = man.chunk_bytes
        items = sorted(read_items(man), key=lambda it: it.tensor.offset + it.hi)  # by where they end

        def check(item: ReadItem) -> None:
            e = item.tensor
            if crc32c_of(view[e.offset + item.lo : e.offset + item.hi]) != e.checksums[item.lo // chunk]:
                raise mismatch(reader, e, item.lo, item.hi, man.step, "peer")

        with ThreadPoolExecutor(self._threads) as pool:
            pending, k = [], 0
            for lo in range(0, man.data_bytes, _RECV_STEP):
                hi = min(man.data_bytes, lo + _RECV_STEP)
                recv(view[lo:hi])
                while k < len(items) and items[k].tensor.offset + items[k].hi <= hi:
                    pending.append(pool.submit(check, items[k]))
                    k += 1
            pending += [pool.submit(check, it) for it in items[k:]]  # empty tensors of an empty shard
            for f in pending:
                f.result()

    def close(self) -> None:
        with self._guard:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
