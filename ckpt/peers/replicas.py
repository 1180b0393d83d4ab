"""Writing replicas into this node's replica slots: the memory tier's slot pool, one
per saved rank, so replicas keep its invariants (pre-allocated and pre-faulted
files, 0600 in private directories, the seal written last). A replica is sealed only
once every byte has arrived and matched its chunk checksums; it outlives both the
sender and the process that received it (the slots stay; the pool's lock goes).

Which slot an incoming replica may take: never the one holding the pool's newest
replica, nor the one holding the newest step common to every replica pool of the
sender's node in this namespace. A lost node loses all its ranks at once, so its
replicas restore only a step that every one of them holds; each rank replicates on its
own (a send in flight makes the next ones wait, and only the newest waits), so the
node's ranks skip different steps, and pools that each kept their two newest could
share none. Keeping the common step in one of two slots instead would give up the
newest, a step of freshness whenever one rank's replicas run a step ahead. So a pool
has three slots; the third is allocated only when its newest is not common (never with
one rank per node). The holders on a node read each other's seals under a lock on the
namespace, so two pools never both give up their last common step.
"""
from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError
from ..format.checksum import crc32c_of
from ..format.manifest import ShardManifest
from ..format.read_items import ReadItem, read_items
from ..format.verify import mismatch
from ..tiers.memory.namespace import rank_dirs, read_owner, seals
from ..tiers.memory.reader import SlotReader
from ..tiers.memory.slots import REPLICA_SLOTS, SlotPool
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

    def _pool(self, rank: int, node: str | None) -> tuple[SlotPool, threading.Lock]:
        """The pool of ``rank``'s replicas, its owner record naming the sender's node."""
        with self._guard:
            owner = {**self._owner, "replica_of": rank, "from_node": node}
            if rank not in self._pools:
                self._pools[rank] = SlotPool(self.ns, rank, slots=REPLICA_SLOTS, owner=owner)
                self._locks[rank] = threading.Lock()
            elif self._pools[rank].owner.get("from_node") != node:  # the rank moved (a relaunch renumbered it)
                self._pools[rank].set_owner({**self._pools[rank].owner, "from_node": node})
            return self._pools[rank], self._locks[rank]

    def receive(self, manifest: ShardManifest, recv: Callable[[memoryview], None], node: str | None = None) -> None:
        """Take a replica of ``manifest``'s shard, sent from ``node``: ``recv`` fills each
        piece of the slot with the next data bytes; every chunk is checked against its
        checksum, then the slot is sealed."""
        if not manifest.has_checksums:
            raise CheckpointError(f"replica of rank {manifest.rank}'s step {manifest.step} has no checksums")
        pool, lock = self._pool(manifest.rank, node)
        with lock:  # one replica of a rank at a time: reserve() then never waits
            with _locked(self.ns):
                slot, _ = pool.reserve(manifest.step, keep=newest_common(self.ns, node, manifest.generation))
                try:
                    slot.unseal()
                except BaseException:
                    slot.idle.set()
                    raise
            try:
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


def newest_common(ns: Path, node: str | None, generation: int) -> tuple[int, int] | None:
    """The newest (generation, step) sealed in every replica pool under ``ns`` of ranks on
    ``node`` that holds any step of ``generation`` (None: no such step, or the node unknown)."""
    if node is None:
        return None
    held = []
    for rdir in rank_dirs(ns):
        owner = read_owner(rdir)
        if owner is None or "replica_of" not in owner or owner.get("from_node") != node:
            continue
        steps = {(m.generation, m.step) for m in seals(rdir) if m.generation == generation}
        if steps:
            held.append(steps)
    return max(set.intersection(*held), default=None) if held else None


@contextmanager
def _locked(ns: Path) -> Iterator[None]:
    """The namespace's lock (on the directory itself: nothing to leave behind), held while a
    pool picks a slot from the others' seals and unseals it."""
    fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
