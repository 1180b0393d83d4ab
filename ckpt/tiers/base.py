"""The ``Tier`` interface: every storage level (shared memory, local disk, object
store) is a small class behind it, so the drain, restore and CLI never branch on
the backend.

A checkpoint in a tier is a directory-like prefix named by its ``CheckpointId``
holding, per rank, ``rank-NNNNN.bin`` (all tensor bytes) and ``rank-NNNNN.json``
(the shard manifest), plus ``manifest.json``, the commit.

Call order for writing one checkpoint::

    ref = tier.write_shard(ckpt_id, source)   # each rank; invisible until commit
    tier.written_shards(ckpt_id)              # coordinator: which ranks are durable
    tier.commit(ckpt_id, manifest)            # coordinator, after every shard is durable

Call order for reading::

    tier.list() -> [CheckpointInfo]           # committed checkpoints only
    tier.read_manifest(ckpt_id) -> Manifest
    tier.open_shard(ckpt_id, shard_ref) -> ShardReader
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable

import torch

from ..checksum import crc32c_of
from ..errors import DamagedCheckpoint, ManifestError
from ..manifest import Manifest, ShardManifest, ShardRef

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

    @property
    def complete(self) -> bool:
        return self.error is None


class ShardReader(ABC):
    """Random access to one rank's data file, plus its parsed shard manifest."""

    manifest: ShardManifest
    location: str  # for messages: the data file's path or URL

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the data file's bytes at ``offset``; raise if short."""

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        """Zero-copy access where the bytes already sit in memory (the memory tier)."""
        return None

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor | None:
        """The same bytes as ``view``, as a CPU uint8 tensor: the source of a device copy."""
        return None

    def close(self) -> None:
        """Release handles; memory readers re-check their seal here."""


class Tier(ABC):
    name: str = "tier"  # "memory", "disk", "object"
    poll_s: float = 0.05  # how often ranks look for each other's shards here (a remote look costs a request)

    @property
    @abstractmethod
    def location(self) -> str:
        """Where this tier lives, for humans."""

    @abstractmethod
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (manifest present), oldest first; damaged commits carry ``error``."""

    @abstractmethod
    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        ...

    @abstractmethod
    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        """Open one shard, checking its manifest against the commit's CRC and its data's size."""

    @abstractmethod
    def write_shard(self, ckpt_id: CheckpointId, source: ShardReader) -> ShardRef:
        """Copy a shard (data, then its manifest) from ``source``; durable but not yet visible."""

    @abstractmethod
    def written_shards(self, ckpt_id: CheckpointId) -> dict[int, ShardRef]:
        """Shards whose data and shard manifest are durable (the coordinator's view before committing)."""

    @abstractmethod
    def commit(self, ckpt_id: CheckpointId, manifest: Manifest) -> None:
        """Make the checkpoint visible: write the manifest last, atomically."""

    @abstractmethod
    def delete(self, ckpt_id: CheckpointId) -> None:
        """Manifest first, then the data, so a half-deleted checkpoint is never listed."""

    @abstractmethod
    def cleanup(self) -> list[str]:
        """Remove leftovers of interrupted writes (anything without a manifest); return what went."""

    def close(self) -> None:
        """Release threads and connections the tier holds."""


def parse_commit(raw: bytes, ckpt_id: CheckpointId, where: str) -> Manifest:
    """A commit record, checked to belong to the checkpoint it was found under."""
    m = Manifest.from_bytes(raw, where)
    if (m.generation, m.step) != (ckpt_id.generation, ckpt_id.step):
        raise ManifestError(f"{where}: manifest says step {m.step} generation {m.generation}")
    return m


def check_shard(ckpt_id: CheckpointId, ref: ShardRef, raw: bytes | None, data_size: int | None,
                manifest_where: str, data_where: str, tier: str) -> ShardManifest:
    """A shard manifest checked against the commit's CRC, and its data object's size against
    the manifest; ``None`` stands for a missing file."""
    if raw is None:
        raise DamagedCheckpoint(ckpt_id.step, manifest_where, "missing", tier)
    if crc32c_of(raw) != ref.manifest_crc32c:
        raise DamagedCheckpoint(ckpt_id.step, manifest_where, "does not match the commit's checksum", tier)
    man = ShardManifest.from_bytes(raw, manifest_where)
    if data_size is None:
        raise DamagedCheckpoint(ckpt_id.step, data_where, "missing", tier)
    if data_size != man.data_bytes:
        raise DamagedCheckpoint(ckpt_id.step, data_where,
                                f"truncated or extended: {data_size} bytes, manifest says {man.data_bytes}", tier)
    return man


def prune(tier: Tier, keep_last: int, pinned: Iterable[CheckpointId] = ()) -> list[CheckpointId]:
    """Retention: delete what is older than the newest ``keep_last`` complete checkpoints
    (and than anything ``pinned``), damaged commits included; never the kept ones. With
    nothing complete, nothing is deleted. Returns the ids deleted."""
    infos = tier.list()
    keep = {i.id for i in [i for i in infos if i.complete][-keep_last:]} | set(pinned)
    if not keep:
        return []
    oldest_kept = min(keep)
    gone = [i.id for i in infos if i.id not in keep and i.id < oldest_kept]
    for ckpt_id in gone:
        tier.delete(ckpt_id)
    return gone

