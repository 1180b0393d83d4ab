"""The path one save's bytes take: on the training thread, a copy into a reserved memory
slot; in the background, checksums and a re-seal, the peer replicas, the disk write and
its commit, and the upload. ``CheckpointManager`` decides what is saved and where it must
become durable (the handle's tiers, the upload); this module moves the bytes, in that order.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import NO_ROOM, Abandoned, TierFull, UnsoundState
from ..format.manifest import ShardManifest, TensorEntry
from ..format.tensor_io import with_checksums
from ..restore.optim_names import param_names
from ..tiers.base import CheckpointId, ShardReader, ShardRef
from .canary import Canary
from .drain import Claim, Drainer, Lease, Pace, SaveHandle
from .flat_cache import FlatCache
from .layout_cache import LayoutCache, ParamsCache
from .overlap import FoundCache, StagedSnapshot, StepHooks, deferrable, step_written, versions
from .soundness import NOTHING, Inspection, Scope, scope_of, where

if TYPE_CHECKING:  # annotations only: the manager builds each of these
    from ..format.state import FlatState
    from ..peers.peering import Peering
    from ..tiers.local import LocalDiskTier
    from ..tiers.memory import MemoryTier
    from ..tiers.memory.slots import ShmSlot
    from .commit import Committer
    from .metrics import CheckpointMetrics
    from .offload import Offloader

log = logging.getLogger(__name__)


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
    overlap: bool = False  # snapshots staged (``stage``), a queued drain skipped for a newer snapshot's
    verify: bool = False  # overlap: staged bytes compared with the live tensors at the seal (``StagedSnapshot``)
    # how a skippable drain runs: at low priority, so that saving every step yields the CPU to training
    yielding: Callable[[Callable[[], None]], None] = lambda run: run()
    drainer: Drainer = dataclasses.field(default_factory=Drainer)
    pace: Pace = dataclasses.field(default_factory=Pace)  # how often a skippable drain may start
    stall_s: float = 0.0  # total time a snapshot waited for a slot still draining
    staged_wait_s: float = 0.0  # total time the trainer waited for overlapped copies to end
    disk_full: str | None = None  # why the last disk write found no room (None: the disk takes saves)
    _moot: list[tuple[Claim, SaveHandle, Lease]] = dataclasses.field(default_factory=list)  # skippable drains
    _newest: SaveHandle | None = None  # the last drain queued
    _staged: StagedSnapshot | None = None  # overlap: the snapshot being copied
    _hooks: StepHooks | None = None
    rank_local: tuple[str, ...] = ()  # keys (or dotted path prefixes) not compared across replicas
    compare: bool = False  # compare the replicas' digests at all (CheckpointManager(compare_replicas=))
    strike: Callable[[str, int], None] | None = None  # (cause, step): this rank's node is a culprit
    unsound: tuple[CheckpointId, dict] | None = None  # the first unsound verdict since the last restore
    _scopes: dict[int, Scope] = dataclasses.field(default_factory=dict)  # by slot
    node: str = "?"  # this rank's node, as culprits are named
    canary: Canary | None = None  # the reference each save carries for the one before (``canary.py``)
    _refs: dict[int, dict | None] = dataclasses.field(default_factory=dict)  # by slot
    layouts: LayoutCache = dataclasses.field(default_factory=LayoutCache)  # the last save's, while it holds
    params: ParamsCache = dataclasses.field(default_factory=ParamsCache)  # (param_names, Scope), while they hold
    flat: FlatCache = dataclasses.field(default_factory=FlatCache)  # modules' and optimizers' flat shares, proven
    found: FoundCache = dataclasses.field(default_factory=FoundCache)  # the state's optimizers and modules
    # the last staged save's (flat.tensors, deferred, their tensors, the deferred (path, tensor)s): kept while a save
    # hands the very same two lists (``FlatCache``), so the copy's pairs are kept too (``SlotPool.start_snapshot``)
    _sources: tuple = (None, None, [], [])

    def __post_init__(self) -> None:
        # each committed step is recorded beside the slots, for whoever sweeps them (tiers/memory/owners.py)
        self.committer.on_commit = self.memory.pool.record_durable
        if self.overlap:
            self._hooks = StepHooks(self.wait_staged, self.seal_if_copied)

    def snapshot(self, ckpt_id: CheckpointId, part: Mapping[str, Any],
                 state: Mapping[str, Any]) -> tuple[ShmSlot, ShardManifest]:
        """Copy ``part`` (this rank's share of ``state``) into a reserved memory slot, sealed
        (no checksums yet); the slot stays busy until its drain releases it."""
        flat, slot, manifest = self._reserve(ckpt_id, part, state)
        try:
            self.memory.snapshot(slot, [t for _, t in flat.tensors], manifest)
        except BaseException:
            slot.idle.set()
            raise
        return slot, manifest

    def stage(self, ckpt_id: CheckpointId, part: Mapping[str, Any],
              state: Mapping[str, Any]) -> tuple[ShmSlot, ShardManifest]:
        """Like ``snapshot`` (``overlap``), but what only ``optimizer.step()`` writes (the
        parameters and state of the optimizers in ``state``, each given a step pre-hook
        calling ``wait_staged``) is still being copied, and the slot is not sealed."""
        optimizers, modules = self.found.of(state)
        self._hooks.watch(optimizers, modules)
        flat, slot, manifest = self._reserve(ckpt_id, part, state)
        later = self.flat.deferrable(flat, optimizers, lambda: deferrable(flat, step_written(optimizers, flat.by_id)))
        kept = self._sources
        if kept[0] is not flat.tensors or kept[1] is not later:  # else: the same lists (neither is changed in place)
            kept = self._sources = (flat.tensors, later, [t for _, t in flat.tensors],
                                    [pt for pt, defer in zip(flat.tensors, later) if defer])
        _, _, sources, watched = kept
        try:
            copying = self.memory.start_snapshot(slot, sources, manifest, later)
        except BaseException:
            slot.idle.set()
            raise
        self._staged = StagedSnapshot(ckpt_id, slot, manifest, copying, watched, versions(watched),
                                      verify=self.verify, encoded=self.memory.encode(manifest))
        return slot, manifest

    def wait_staged(self) -> None:
        """Seal the staged snapshot once its copy is complete and nothing it read changed,
        and queue its drain; otherwise free its slot and raise ``SnapshotChanged``."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        t0 = time.monotonic()
        try:
            staged.finish()
            data = staged.sealed_bytes()
        except BaseException as e:
            staged.slot.idle.set()
            if staged.drain is not None:
                staged.drain[0].fail(e)
            raise
        finally:
            self.staged_wait_s += time.monotonic() - t0
        self.memory.seal(staged.slot, staged.manifest, data)
        if staged.drain is None:  # save() failed before it asked for a drain: sealed in memory only
            staged.slot.idle.set()
            return
        handle, upload, urgent = staged.drain
        self.submit(staged.slot, staged.manifest, staged.ckpt_id, handle, upload=upload, urgent=urgent)

    def seal_if_copied(self) -> None:
        """``wait_staged`` if the staged snapshot's copy has already ended (the end of a
        forward: sealed there, its drain starts during the backward); else nothing."""
        if self._staged is not None and self._staged.copied():
            self.wait_staged()

    def close(self, discard: bool = False) -> None:
        """Stop: the staging (below), then the drains, hurried past any pacing; ``discard``:
        only the one running is waited for (``Drainer.close``)."""
        self.close_staging()
        self.pace.hurry()
        if dropped := self.drainer.close(discard):
            log.info("rank %d: %d queued drain(s) dropped (sealed in memory all the same)", self.rank, dropped)

    def close_staging(self) -> None:
        """Remove the step pre-hooks; let a copy still running end (before the slots are unmapped)."""
        if self._hooks is not None:
            self._hooks.close()
        if self._staged is not None:
            try:
                self._staged.copy.wait()
            except BaseException:  # noqa: BLE001 - the slot is not sealed: nothing to keep
                pass
            self._staged = None

    def _reserve(self, ckpt_id: CheckpointId, part: Mapping[str, Any],
                 state: Mapping[str, Any]) -> tuple[FlatState, ShmSlot, ShardManifest]:
        flat = self.flat.flatten(part)
        entries, nbytes = self.layouts.plan(flat)
        names, scope = self.params.of(state, lambda: (param_names(state), scope_of(
            state, self.rank_local, self.replicated, compare=self.compare)), self.flat.proven)
        manifest = ShardManifest(self.rank, ckpt_id.step, ckpt_id.generation, nbytes, entries, flat.tree,
                                 self.chunk_bytes, self.world_size, replicated=tuple(sorted(self.replicated)),
                                 param_names=names)
        slot, waited = self.memory.reserve(ckpt_id.step)
        self._scopes[id(slot)] = scope
        self._refs[id(slot)] = self.canary.saved(ckpt_id.step) if self.canary is not None else None
        self.stall_s += waited
        if self.metrics is not None and waited:
            self.metrics.stall.inc(waited)
        return flat, slot, manifest

    def submit(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle, *,
               upload: bool, urgent: bool) -> None:
        """Queue the background part of a save (a staged one's once it is sealed; at once
        when urgent); the slot is free again once every drain that reads it has finished."""
        if self._staged is not None and self._staged.slot is slot:
            self._staged.drain = (handle, upload, urgent)
            # urgent (a failure is predicted): sealed before save() returns, drained first;
            # nothing deferred (no optimizer in the state): no step would seal it
            if urgent or not self._staged.watched:
                self.wait_staged()
            return
        lease = Lease(slot.idle.set)
        claim = Claim() if self.overlap and not (upload or urgent) else None  # uploads are never skipped

        def run() -> None:
            if claim is None:
                self._drain(slot, manifest, ckpt_id, handle, upload, urgent, lease)
                return
            self.pace.wait_turn()  # meanwhile a newer snapshot may supersede this one
            if claim.start():
                self.pace.started()
                self.yielding(lambda: self._drain(slot, manifest, ckpt_id, handle, upload, urgent, lease))

        def release() -> None:
            if claim is None or not claim.skipped:  # a skipped job's slot was freed when it was skipped
                lease.release()

        self.drainer.submit(run, handle, urgent=urgent, on_exit=release)
        if claim is not None:
            self._moot.append((claim, handle, lease))
        self._newest = handle

    def join(self) -> None:
        """Wait for every queued drain, none of them paced."""
        self.pace.hurry()
        self.drainer.join()

    def skip_superseded(self, agree_max: Callable[[int], int]) -> list[int]:
        """Skip the queued drains older than the newest one, freeing their slots: the lower
        tiers take the newest sealed snapshot. Every rank skips the same steps (those all
        of them still hold; ``agree_max`` is the all-reduce). Returns the steps skipped."""
        newest = self._newest
        self._moot = [m for m in self._moot if m[0].open]
        older = [m for m in self._moot if m[1] is not newest]
        held = [m for m in older if m[0].hold()]  # the drain runs in order: what it has not started is a suffix
        try:
            first = agree_max(min((h.step for _, h, _ in held), default=newest.step if newest else 0))
        except BaseException:
            for claim, _, _ in held:
                claim.decide(False)  # the drain thread must not wait on a rank that is gone
            raise
        skipped = []
        for claim, handle, lease in held:
            skip = handle.step >= first and newest is not None
            claim.decide(skip)
            if skip:
                lease.release()
                handle.supersede(newest)
                skipped.append(handle.step)
        return skipped

    def protect(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId) -> None:
        """Checksum and replicate a snapshot at once, ahead of anything queued, with no disk
        write or upload (a restored shard that came from another node: its copy elsewhere)."""
        handle = SaveHandle(ckpt_id.step, [], nbytes=manifest.data_bytes)
        self.drainer.submit(lambda: self._checksum(slot, manifest, handle, urgent=True).close(), handle, urgent=True,
                            on_exit=slot.idle.set)

    def _checksum(self, slot: ShmSlot, manifest: ShardManifest, handle: SaveHandle, urgent: bool,
                  inspection: Inspection | None = None) -> ShardReader:
        """Checksum the slot and re-seal it (memory restores can now verify too), then hand
        it to the peer replicator. Returns the open reader (the caller closes it).
        ``inspection`` sees the compared state's bytes in the same read (``soundness.py``)."""
        reader = self.memory.open_slot(slot, manifest)

        def visit(entry: TensorEntry) -> Callable[[memoryview], None] | None:
            self._go_on(manifest.step)  # tensor by tensor: an abandoned drain ends within one
            return inspection.visit(entry) if inspection else None

        try:
            reader.manifest = with_checksums(reader, self.threads, visit)
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
        inspection = Inspection(manifest, self._scopes.get(id(slot), NOTHING))
        reader = self._checksum(slot, manifest, handle, urgent, inspection)
        try:
            sealed = reader.manifest
            if upload and (urgent or self.disk is None):  # the slot waits for both drains
                lease.hold()
                self.offload.submit(ckpt_id, lambda: self.memory.open_slot(slot, sealed), handle, urgent=urgent,
                                    on_exit=lease.release)
            if self.disk is not None:
                self._go_on(ckpt_id.step)
                try:
                    ref = self._write_disk(ckpt_id, reader)
                    self._judged(ckpt_id, self.committer.commit(self.disk, ckpt_id, ref,
                                                                {**inspection.report(sealed, where(self.node)),
                                                                 "canary": self._refs.get(id(slot))}))
                except TierFull as e:
                    self._disk_full(e, handle)
                    if upload and not urgent:  # the object store takes it straight from memory
                        lease.hold()
                        self.offload.submit(ckpt_id, lambda: self.memory.open_slot(slot, sealed), handle,
                                            urgent=False, on_exit=lease.release)
                    return
                if upload and not urgent:
                    self.offload.submit(ckpt_id, lambda: self.disk.open_shard(ckpt_id, ref), handle, urgent=False,
                                        pin_in=self.disk.name)
                self._disk_writable(ckpt_id)
                handle.mark(self.disk.name)
        finally:
            reader.close()

    def _go_on(self, step: int) -> None:
        """Raise Abandoned once the manager let go (an in-process recovery): the snapshot stays
        sealed in memory, where the next round restores it; its checksums and disk copy can wait."""
        if self.committer.abandoned.is_set():
            raise Abandoned(f"step {step}: drain cut short, the job let go of it")

    def _write_disk(self, ckpt_id: CheckpointId, reader: ShardReader) -> ShardRef | TierFull:
        """This rank's shard on disk, or why the disk has no room for it (committed, or not, with every rank)."""
        try:
            return self.disk.write_shard(ckpt_id, reader)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            return TierFull(f"rank {self.rank}: {e}")

    def _disk_full(self, error: TierFull, handle: SaveHandle) -> None:
        """A full disk is the disk tier's failure, not the rank's: the step stays in memory (and goes
        to peers and the object store), the trainer is not stopped; said once, until it has room again."""
        handle.give_up(self.disk.name)
        if self.metrics is not None:
            self.metrics.tier_full(self.disk.name, True)
        if self.disk_full is None:
            log.error("saves to the disk tier fail (%s): training goes on with the memory tier%s; every save tries "
                      "the disk again", error, " and the object store" if self.offload is not None else "")
        self.disk_full = str(error)

    def _disk_writable(self, ckpt_id: CheckpointId) -> None:
        if self.disk_full is not None:
            log.warning("the disk tier has room again: step %d is durable there", ckpt_id.step)
            self.disk_full = None
            if self.metrics is not None:
                self.metrics.tier_full(self.disk.name, False)

    def _judged(self, ckpt_id: CheckpointId, health: dict) -> None:
        """Act on a committed step's verdict (``format/health.py``): an unsound one is logged (by
        rank 0, the first since the last restore), counted, struck against the culprits' nodes,
        and kept for ``raise_unsound``."""
        state = health.get("state")
        if state not in ("suspect", "unhealthy"):
            return
        if self.metrics is not None:
            self.metrics.unsound(state, health.get("culprits", []))
        mine = any(c.get("rank") == self.rank for c in health.get("culprits", []))
        if mine and self.strike is not None:
            self.strike(f"{state} snapshot at step {ckpt_id.step}: {health.get('reason', '')}", ckpt_id.step)
        if self.unsound is None:
            self.unsound = (ckpt_id, health)
            if self.rank == 0 or mine:
                log.error("step %d (generation %d) is %s: %s; a plain restore goes back to the newest step "
                          "before it whose replicas agreed (docs/sound-state.md)", ckpt_id.step,
                          ckpt_id.generation, state.upper(), health.get("reason", ""))

    def raise_unsound(self) -> None:
        """Raise ``UnsoundState`` once a drained step was found suspect or unhealthy: training on
        would only build on the wrong state; the job restarts from the newest agreed step."""
        if self.unsound is not None:
            ckpt_id, health = self.unsound
            raise UnsoundState(f"step {ckpt_id.step} (generation {ckpt_id.generation}) is {health['state']}: "
                               f"{health.get('reason', '')}", health)
