"""The memory tier: one rank's sealed shared-memory slots.

Two ways to open it:

* ``MemoryTier.own(ns, rank, ...)``: the training process. Takes the rank's lock,
  owns the slot pool, and writes snapshots (``reserve`` → ``snapshot`` → the drain
  reads the slot through ``open_slot`` and re-``seal``\\ s it with checksums).
* ``MemoryTier(ns, rank)``: anyone else (``ckpt`` after a crash, a sibling rank
  reading replicated state): read-only, re-checking each seal after reading.

It is a ``TierReader`` only: nothing is ever copied *into* memory by the drain.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

from ...errors import ManifestError
from ...format.checksum import crc32c_of
from ...format.manifest import Manifest, ShardManifest, ShardRef
from ..base import CheckpointId, CheckpointInfo, ShardReader, TierReader
from .namespace import MAX_SEAL_BYTES, is_trusted, rank_dir, read_private
from .reader import SlotReader, slot_epoch

if TYPE_CHECKING:  # the writing side needs torch; readers (the CLI) do not
    from concurrent.futures import Future

    import torch

    from .copier import PendingCopy
    from .slots import ShmSlot, SlotPool



class _Seal(NamedTuple):
    """A slot's seal as read: its manifest (None: not a valid one), the slot's epoch taken
    before it (so a reader can tell later whether the slot still holds what this manifest
    describes) and the bytes."""

    path: Path
    manifest: ShardManifest | None
    epoch: bytes
    raw: bytes


class MemoryTier(TierReader):
    name = "memory"

    def __init__(self, ns: Path, rank: int = 0, pool: "SlotPool | None" = None) -> None:
        self.dir = rank_dir(ns, rank)
        self.rank = rank
        self.pool = pool
        self._copier = None
        self._parsed: dict[Path, tuple[bytes, ShardManifest]] = {}

    @classmethod
    def own(cls, ns: Path, rank: int, *, slots: int, owner: dict) -> "MemoryTier":
        """The writable tier of the training process (exclusive per namespace and rank)."""
        from .copier import TensorCopier
        from .slots import SlotPool

        tier = cls(ns, rank, SlotPool(ns, rank, slots=slots, owner=owner))
        tier._copier = TensorCopier()
        return tier

    @property
    def location(self) -> str:
        return str(self.dir)

    # -- writing (owner only) -----------------------------------------------------

    def prepare_async(self, nbytes: int, *, pin: bool = False) -> None:
        self._owned().prepare_async(nbytes, pin=pin)

    def wait_prepared(self) -> None:
        self._owned().wait_prepared()

    def reserve(self, step: int) -> "tuple[ShmSlot, float]":
        """A slot for the snapshot of ``step`` (see ``SlotPool.reserve``)."""
        return self._owned().reserve(step)

    def snapshot(self, slot: "ShmSlot", tensors: "Sequence[torch.Tensor]", manifest: ShardManifest) -> None:
        """The trainer's copy into ``slot``, sealed (without checksums) when complete."""
        self._owned().snapshot(slot, tensors, manifest, self._copier)

    def start_snapshot(self, slot: "ShmSlot", tensors: "Sequence[torch.Tensor]", manifest: ShardManifest,
                       later: Sequence[bool]) -> "PendingCopy":
        """Copy the tensors not marked ``later`` into ``slot`` now, start the others' copy
        (overlapped with training); ``seal`` once it has been waited for."""
        return self._owned().start_snapshot(slot, tensors, manifest, self._copier, later)

    def open_slot(self, slot: ShmSlot, manifest: ShardManifest) -> ShardReader:
        """A reader over the owner's own mapping of ``slot`` (no re-check: the owner knows
        the slot stays put until the drain releases it)."""
        return SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, epoch=None)

    def seal(self, slot: ShmSlot, manifest: ShardManifest, data: bytes | None = None) -> None:
        """Re-seal with the checksums computed off the critical path (or seal a staged
        snapshot: ``data``, its manifest's bytes, as ``encode`` made them)."""
        slot.seal(manifest, data)

    def encode(self, manifest: ShardManifest) -> "Future[bytes]":
        """``manifest.to_bytes()``, made on the copy thread after the copy started before it."""
        return self._copier.then(manifest.to_bytes)

    def holds(self, step: int) -> bool:
        """Whether a sealed slot of this process holds ``step``."""
        return any(s.holds and s.holds[1] == step for s in self._owned().slots)

    def _owned(self) -> "SlotPool":
        if self.pool is None:
            raise RuntimeError("this memory tier was opened read-only")
        return self.pool

    def close(self, remove: bool = False) -> None:
        """Unmap the slots; ``remove``: also delete this rank's slot files (a finished job)."""
        if self._copier is not None:
            self._copier.close()
        if self.pool is not None:
            self.pool.close(remove=remove)

    # -- reading ------------------------------------------------------------------

    def _sealed(self) -> list[_Seal]:
        """Every seal in this rank's directory, parsed (None: not a valid seal). A seal's bytes are read
        each time; a parse is reused while they are the same (a restore looks a step up
        twice, and a 1,168-tensor manifest takes milliseconds to parse)."""
        out: list[_Seal] = []
        if not is_trusted(self.dir, directory=True) or not is_trusted(self.dir.parent, directory=True):
            return out  # missing, or planted by another user
        for meta in sorted(self.dir.glob("slot-*.json")):
            try:
                epoch = slot_epoch(meta)
                raw = read_private(meta, MAX_SEAL_BYTES)
            except OSError:
                continue
            parsed = self._parsed.get(meta)
            if parsed is None or parsed[0] != raw:
                try:
                    parsed = self._parsed[meta] = (raw, ShardManifest.from_bytes(raw, str(meta)))
                except ManifestError:
                    parsed = (raw, None)
            out.append(_Seal(meta, parsed[1], epoch, raw))
        return out

    def list(self) -> list[CheckpointInfo]:
        infos = []
        for seal in self._sealed():
            man = seal.manifest
            if man is None:
                continue  # an unreadable seal is an invalid slot, not a checkpoint
            try:
                sealed_at = seal.path.stat().st_mtime
            except FileNotFoundError:
                continue  # unsealed since it was read: a live job is overwriting the slot
            infos.append(CheckpointInfo(CheckpointId(man.generation, man.step), self.name, sealed_at,
                                        man.data_bytes, man.world_size, checksummed=man.has_checksums,
                                        ranks=frozenset({man.rank})))
        return sorted(infos, key=lambda i: i.id)

    def _find(self, ckpt_id: CheckpointId) -> _Seal:
        for seal in self._sealed():
            man = seal.manifest
            if man is not None and (man.generation, man.step) == (ckpt_id.generation, ckpt_id.step):
                return seal
        raise FileNotFoundError(f"step {ckpt_id} is not in memory ({self.dir})")

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        seal = self._find(ckpt_id)
        man = seal.manifest
        # A slot holds one rank's shard: the manifest lists just that one.
        return Manifest(man.step, man.generation, man.world_size,
                        [ShardRef(man.rank, crc32c_of(seal.raw), man.data_bytes)], created=seal.path.stat().st_mtime)

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        seal = self._find(ckpt_id)
        live = None
        if self.pool is not None:
            live = next((s.buffer for s in self.pool.slots if s.meta_path == seal.path and s.buffer is not None), None)
        return SlotReader(seal.path, seal.path.with_suffix(".bin"), seal.manifest, live, epoch=seal.epoch)
