"""The path one save's bytes take: on the training thread, a copy into a reserved memory
slot; in the background, checksums and a re-seal, the peer replicas, the disk write and
its commit, and the upload. ``CheckpointManager`` decides what is saved and where it must
become durable (the handle's tiers, the upload); this module moves the bytes, in that order.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from ..format.manifest import ShardManifest
from ..format.state import flatten
from ..format.tensor_io import with_checksums
from ..restore.optim_names import param_names
from ..tiers.base import CheckpointId, ShardReader
from ..tiers.memory.copier import plan_layout
from .drain import Drainer, Lease, SaveHandle

if TYPE_CHECKING:  # annotations only: the manager builds each of these
    from ..peers.peering import Peering
    from ..tiers.local import LocalDiskTier
    from ..tiers.memory import MemoryTier
    from ..tiers.memory.slots import ShmSlot
    from .commit import Committer
    from .metrics import CheckpointMetrics
    from .offload import Offloader


@dataclasses.dataclass
class SavePath:
    """One rank's tiers as a save sees them, and the background drain that serves them."""

    rank: int
    world_size: int
    memory: MemoryTier
    disk: LocalDiskTier | None
    offload: Offloader | None
    committer: Committer
    peering: Peering | None
    metrics: CheckpointMetrics | None
    threads: int
    chunk_bytes: int
    replicated: frozenset[str]
    drainer: Drainer = dataclasses.field(default_factory=Drainer)
    stall_s: float = 0.0  # total time a snapshot waited for a slot still draining

    def snapshot(self, ckpt_id: CheckpointId, part: Mapping[str, Any],
                 state: Mapping[str, Any]) -> tuple[ShmSlot, ShardManifest]:
        """Copy ``part`` (this rank's share of ``state``) into a reserved memory slot, sealed
        (no checksums yet); the slot stays busy until its drain releases it."""
        flat = flatten(part)
        entries, nbytes = plan_layout(flat.tensors)
        entries = [dataclasses.replace(e, layout=flat.layouts.get(e.id)) for e in entries]
        manifest = ShardManifest(self.rank, ckpt_id.step, ckpt_id.generation, nbytes, entries, flat.tree,
                                 self.chunk_bytes, self.world_size, replicated=tuple(sorted(self.replicated)),
                                 param_names=param_names(state))
        slot, waited = self.memory.reserve(ckpt_id.step)
        self.stall_s += waited
        if self.metrics is not None and waited:
            self.metrics.stall.inc(waited)
        try:
            self.memory.snapshot(slot, [t for _, t in flat.tensors], manifest)
        except BaseException:
            slot.idle.set()
            raise
        return slot, manifest

    def submit(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle, *,
               upload: bool, urgent: bool) -> None:
        """Queue the background part of a save; the slot is free again once every drain
        that reads it has finished."""
        lease = Lease(slot.idle.set)
        self.drainer.submit(lambda: self._drain(slot, manifest, ckpt_id, handle, upload, urgent, lease), handle,
                            urgent=urgent, on_exit=lease.release)

    def protect(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId) -> None:
        """Checksum and replicate a snapshot at once, ahead of anything queued, with no disk
        write or upload (a restored shard that came from another node: its copy elsewhere)."""
        handle = SaveHandle(ckpt_id.step, [], nbytes=manifest.data_bytes)
        self.drainer.submit(lambda: self._checksum(slot, manifest, handle, urgent=True).close(), handle, urgent=True,
                            on_exit=slot.idle.set)

    def _checksum(self, slot: ShmSlot, manifest: ShardManifest, handle: SaveHandle, urgent: bool) -> ShardReader:
        """Checksum the slot and re-seal it (memory restores can now verify too), then hand
        it to the peer replicator. Returns the open reader (the caller closes it)."""
        reader = self.memory.open_slot(slot, manifest)
        try:
            reader.manifest = with_checksums(reader, self.threads)
            self.memory.seal(slot, reader.manifest)
            if self.peering is not None:
                self.peering.replicate(slot, reader.manifest, handle, urgent=urgent)
        except BaseException:
            reader.close()
            raise
        return reader

    def _drain(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle,
               upload: bool, urgent: bool, lease: Lease) -> None:
        """Checksum and re-seal the slot, then disk (committed), then the object store
        (from disk; straight from memory when urgent or without a disk)."""
        reader = self._checksum(slot, manifest, handle, urgent)
        try:
            sealed = reader.manifest
            if upload and (urgent or self.disk is None):  # the slot waits for both drains
                lease.hold()
                self.offload.submit(ckpt_id, lambda: self.memory.open_slot(slot, sealed), handle, urgent=urgent,
                                    on_exit=lease.release)
            if self.disk is not None:
                ref = self.disk.write_shard(ckpt_id, reader)
                self.committer.commit(self.disk, ckpt_id, ref)
                if upload and not urgent:
                    self.offload.submit(ckpt_id, lambda: self.disk.open_shard(ckpt_id, ref), handle, urgent=False,
                                        pin_in=self.disk.name)
                handle.mark(self.disk.name)
        finally:
            reader.close()
