"""What a storage level is, split by role, so the drain, the committer, restore and the
CLI never branch on the backend.

* ``TierReader`` (every tier: memory, disk, object store, later peers): list the
  committed checkpoints, read a commit record, open one rank's shard, verify a copy.
* ``DurableTier`` (disk, object store): also write a shard, commit, delete, prune,
  clean up leftovers. The memory tier is not one: it is written by the trainer's
  snapshot (``tiers/memory``), never copied into.

A checkpoint in a durable tier is a directory-like prefix named by its
``CheckpointId`` holding, per rank, ``rank-NNNNN.bin`` (all tensor bytes) and
``rank-NNNNN.json`` (the shard manifest), plus ``manifest.json``, the commit. A
commit lists the shards held in that *volume* (one node's NVMe, a shared
filesystem, a bucket prefix): on nodes with local disks each node commits its own.

Call order for writing one checkpoint::

    ref = tier.write_shard(ckpt_id, source)   # every rank, its own shard; invisible until commit
    committer.commit(tier, ckpt_id, ref)      # ckpt/commit.py: once every rank's shard is durable,
                                              # each volume's leader calls tier.commit(ckpt_id, manifest)

Call order for reading::

    tier.list() -> [CheckpointInfo]           # committed checkpoints only
    tier.read_manifest(ckpt_id) -> Manifest
    tier.open_shard(ckpt_id, shard_ref) -> ShardReader
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import DamagedCheckpoint, ManifestError
from ..format.checksum import crc32c_of
from ..format.manifest import Manifest, ShardManifest, ShardRef
from ..format.shard_reader import ShardReader
from ..format.verify import run_parallel, verify_shard

if TYPE_CHECKING:
    pass

_DIR_RE = re.compile(r"^step-(\d{12})\.g(\d{1,9})$")


@dataclass(frozen=True, order=True)
class CheckpointId:
    """Orders by (generation, step): "newest" is the newest step of the newest lineage."""

    generation: int
    step: int

    @property
    def name(self) -> str:
        return f"step-{self.step:012d}.g{self.generation}"

    @classmethod
    def parse(cls, name: str) -> "CheckpointId | None":
        m = _DIR_RE.match(name)
        return cls(int(m.group(2)), int(m.group(1))) if m else None

    def __str__(self) -> str:
        return f"{self.step} (generation {self.generation})"


@dataclass
class CheckpointInfo:
    id: CheckpointId
    tier: str
    created: float
    bytes: int
    world_size: int
    error: str | None = None  # set when the commit record itself is unreadable
    checksummed: bool = True  # False for a memory slot whose checksums are not computed yet
    ranks: frozenset[int] = field(default_factory=frozenset)  # the saved ranks whose shards this copy holds
    health: dict | None = None  # the commit record's verdict on the replicas (``format/health.py``)
    first: ShardRef | None = None  # the commit record's lowest rank: what ``ckpt ls`` opens without reading it again

    @property
    def complete(self) -> bool:
        return self.error is None


class TierReader(ABC):
    """The read role: what restore, ``ckpt ls`` and ``ckpt verify`` need of any tier."""

    name: str = "tier"  # "memory", "disk", "object"

    @property
    @abstractmethod
    def location(self) -> str:
        """Where this tier lives, for humans."""

    @abstractmethod
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first; damaged commits carry ``error``."""

    @abstractmethod
    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        ...

    @abstractmethod
    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        """Open one shard, checking its manifest against the commit's CRC and its data's size."""

    def verify(self, ckpt_id: CheckpointId, *, threads: int = 4, progress: Callable[[int], None] | None = None) -> bool:
        """Check every byte of every shard held here. False when a copy is sealed but has
        no checksums yet (a memory slot still draining); raises if damaged."""
        manifest = self.read_manifest(ckpt_id)
        for ref in manifest.shards:
            reader = self.open_shard(ckpt_id, ref)
            try:
                if not reader.manifest.has_checksums:
                    return False
                verify_shard(reader, step=ckpt_id.step, tier=self.name, threads=threads, progress=progress)
            finally:
                reader.close()
        return True

    def verify_manifests(self, ckpt_id: CheckpointId, *, threads: int = 8,
                         shards: list[ShardRef] | None = None) -> None:
        """Open every shard held here (its manifest checked against the commit's CRC, its data
        file's size against the manifest) without reading data: what ``ckpt verify
        --manifests-only`` looks at; raises if damaged. ``shards``: these of the commit record's
        (read once by the caller), not all (``manifest_jobs.py``)."""
        shards = self.read_manifest(ckpt_id).shards if shards is None else shards
        run_parallel(lambda ref: self.open_shard(ckpt_id, ref).close(), shards, threads)

    def close(self) -> None:
        """Release threads and connections the tier holds."""


class DurableTier(TierReader):
    """The durable-write role: a tier the drain copies shards into and commits."""

    @property
    @abstractmethod
    def volume(self) -> str:
        """Identifies the storage behind this tier: ranks reporting the same volume write
        into one place, and one of them commits for all (``ckpt/commit.py``)."""

    @abstractmethod
    def write_shard(self, ckpt_id: CheckpointId, source: ShardReader) -> ShardRef:
        """Copy a shard (data, then its manifest) from ``source``; durable but not yet visible."""

    @abstractmethod
    def commit(self, ckpt_id: CheckpointId, manifest: Manifest) -> None:
        """Make the checkpoint visible: write the manifest last, atomically."""

    @abstractmethod
    def delete(self, ckpt_id: CheckpointId) -> None:
        """Manifest first, then the data, so a half-deleted checkpoint is never listed."""

    @abstractmethod
    def read_marker(self, name: str) -> bytes | None:
        """A small record kept at the tier's top (``name`` has no slash), or None."""

    @abstractmethod
    def create_marker(self, name: str, data: bytes) -> bool:
        """Write a small record at the tier's top unless one exists; True when this call wrote it."""

    @abstractmethod
    def cleanup(self, min_age_s: float = 0.0) -> list[str]:
        """Remove leftovers of interrupted writes (no manifest) idle for ``min_age_s``; return what went."""

    def prune(self, keep_last: int, pinned: Iterable[CheckpointId] = ()) -> list[CheckpointId]:
        """Retention: delete what is older than the newest ``keep_last`` complete checkpoints
        (and than anything ``pinned``), damaged commits included; never the kept ones. With
        nothing complete, nothing is deleted. Returns the ids deleted."""
        infos = self.list()
        keep = {i.id for i in [i for i in infos if i.complete][-keep_last:]} | set(pinned)
        if not keep:
            return []
        oldest_kept = min(keep)
        gone = [i.id for i in infos if i.id not in keep and i.id < oldest_kept]
        for ckpt_id in gone:
            self.delete(ckpt_id)
        return gone


def complete_shards(tier: TierReader) -> set[tuple[int, int, int]]:
    """(saved rank, generation, step) of every shard ``tier`` holds in a complete
    checkpoint: what may be swept from memory once it is here."""
    return {(r, i.id.generation, i.id.step) for i in tier.list() if i.complete for r in i.ranks}


def parse_commit(raw: bytes, ckpt_id: CheckpointId, where: str) -> Manifest:
    """A commit record, checked to belong to the checkpoint it was found under."""
    m = Manifest.from_bytes(raw, where)
    if (m.generation, m.step) != (ckpt_id.generation, ckpt_id.step):
        raise ManifestError(f"{where}: manifest says step {m.step} generation {m.generation}")
    return m


def committed_info(ckpt_id: CheckpointId, tier: str, manifest: Manifest) -> CheckpointInfo:
    """The listing row of a readable commit record."""
    return CheckpointInfo(ckpt_id, tier, manifest.created, manifest.total_bytes, manifest.world_size,
                          ranks=frozenset(s.rank for s in manifest.shards), health=manifest.health,
                          first=manifest.shards[0])


def check_shard(ckpt_id: CheckpointId, ref: ShardRef, raw: bytes | None, data_size: int | None,
                manifest_where: str, data_where: str, tier: str) -> ShardManifest:
    """A durable shard manifest, checked against the commit's CRC, carrying checksums, and
    its data object's size against the manifest; ``None`` stands for a missing file."""
    if raw is None:
        raise DamagedCheckpoint(ckpt_id.step, manifest_where, "missing", tier)
    if crc32c_of(raw) != ref.manifest_crc32c:
        raise DamagedCheckpoint(ckpt_id.step, manifest_where, "does not match the commit's checksum", tier)
    man = ShardManifest.from_bytes(raw, manifest_where)
    if not man.has_checksums:  # only a memory slot may briefly lack them
        raise DamagedCheckpoint(ckpt_id.step, manifest_where, "no checksums recorded", tier)
    if data_size is None:
        raise DamagedCheckpoint(ckpt_id.step, data_where, "missing", tier)
    if data_size != man.data_bytes:
        raise DamagedCheckpoint(ckpt_id.step, data_where,
                                f"truncated or extended: {data_size} bytes, manifest says {man.data_bytes}", tier)
    return man
