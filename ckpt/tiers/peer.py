"""The peer tier: replicas of *other* ranks' shards held in this node's shared memory
(and, read the same way, a node's own slots of every rank: ``NodeMemoryTier``).

Replicas live in a namespace of their own beside the job's memory namespace (same
root and run, so ``ckpt gc`` and the start-up sweep find them), one ``rank-NNNNN/``
directory per saved rank whose shards this node holds, laid out exactly as the
memory tier's slots: the same trust rules (this user's, private, no symlinks), the
same seal-last slots. This module is the read side (restore, ``ckpt ls``); the
peer server writes them (``ckpt/peers/replicas.py``).
"""
from __future__ import annotations

from pathlib import Path

from ..format.manifest import Manifest, ShardRef
from .base import CheckpointId, CheckpointInfo, ShardReader, TierReader
from .memory import DEFAULT_SHM_DIR, MemoryTier, namespace_dir
from .memory.namespace import is_trusted, rank_dirs, read_owner


def replica_namespace(owner_root: str, run: str, memory_dir: str = DEFAULT_SHM_DIR) -> Path:
    """Where this node keeps the replicas it holds for the job with this root and run."""
    return namespace_dir(owner_root, f"{run}\0peer-replicas", memory_dir)


def is_replica_namespace(ns: Path) -> bool:
    """Whether ``ns`` holds peer replicas (its owner records say whose), not a job's own slots."""
    return any((o := read_owner(d)) is not None and "replica_of" in o for d in rank_dirs(ns))


class _ReplicaDir(MemoryTier):
    name = "peer"


class PeerTier(TierReader):
    """Read-only view of every replica slot in ``ns`` (re-checked against its seal, as
    the memory tier's reader does)."""

    name = "peer"
    _dir = _ReplicaDir

    def __init__(self, ns: Path) -> None:
        self.ns = ns

    @property
    def location(self) -> str:
        return str(self.ns)

    def _dirs(self) -> dict[int, MemoryTier]:
        if not is_trusted(self.ns, directory=True):
            return {}
        out = {}
        for d in rank_dirs(self.ns):
            try:
                rank = int(d.name.split("-", 1)[1])
            except ValueError:
                continue
            out[rank] = self._dir(self.ns, rank)
        return out

    def list(self) -> list[CheckpointInfo]:
        merged: dict[CheckpointId, CheckpointInfo] = {}
        for rank, tier in self._dirs().items():
            for i in tier.list():
                if not i.checksummed or i.ranks != {rank}:
                    continue  # only verified replicas, in their own saved rank's directory
                if i.id in merged:
                    m = merged[i.id]
                    m.ranks, m.bytes, m.created = m.ranks | i.ranks, m.bytes + i.bytes, max(m.created, i.created)
                else:
                    merged[i.id] = i
        return sorted(merged.values(), key=lambda i: i.id)

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        refs, world, created = [], 0, 0.0
        for tier in self._dirs().values():
            try:
                m = tier.read_manifest(ckpt_id)
            except FileNotFoundError:
                continue
            refs += m.shards
            world, created = m.world_size, max(created, m.created)
        if not refs:
            raise FileNotFoundError(f"step {ckpt_id}: no replica in {self.ns}")
        return Manifest(ckpt_id.step, ckpt_id.generation, world, refs, created=created)

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        tier = self._dirs().get(ref.rank)
        if tier is None:
            raise FileNotFoundError(f"step {ckpt_id}: no copy of rank {ref.rank}'s shard in {self.ns}")
        return tier.open_shard(ckpt_id, ref)


class NodeMemoryTier(PeerTier):
    """Read-only view of every rank's own slots in a job's memory namespace on this node.
    torchrun may number the nodes differently after a restart: the snapshots a node's
    ranks took under their old numbers are still here, sealed, and another rank (here or,
    through the peer server, on another node) restores from them."""

    name = "memory"
    _dir = MemoryTier

    def __init__(self, ns: Path, *, besides: int | None = None) -> None:
        super().__init__(ns)
        self.besides = besides  # a rank whose own memory tier is a source already: not listed or read twice

    def _dirs(self) -> dict[int, MemoryTier]:
        return {rank: tier for rank, tier in super()._dirs().items() if rank != self.besides}
