"""``CheckpointManager``: the public face. ``save()`` snapshots into shared memory and
returns; a drain job carries the snapshot to disk (and further tiers) in the
background; ``restore()`` loads the newest valid checkpoint in place."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

from .drain import Drainer, Lease, SaveHandle
from .errors import CheckpointError
from .manifest import Manifest, ShardManifest
from .memory import DEFAULT_SHM_DIR, SlotPool, TensorCopier, namespace_dir, plan_layout
from .checksum import DEFAULT_CHUNK_BYTES
from .offload import Offloader
from .restore import restore_newest
from .state import flatten, load_into
from .tensor_io import with_checksums
from .tiers.base import CheckpointId, CheckpointInfo, Tier
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier, SlotReader
from .tiers.object_store import ObjectStoreTier

log = logging.getLogger(__name__)


def memory_namespace(root: str | os.PathLike | None, run: str | None, memory_dir: str = DEFAULT_SHM_DIR) -> Path:
    """The shared-memory directory a manager with this root and run uses (the CLI finds it too)."""
    return namespace_dir(os.path.realpath(root) if root is not None else "", run or "default", memory_dir)


class CheckpointManager:
    """Tiered asynchronous checkpoints: memory (shared, survives the trainer) → local disk
    → object store (survives the node).

    ``root`` is the local-disk tier's directory (None: no disk tier). ``keep_last`` is how
    many complete checkpoints each durable tier keeps, one number for all or per tier
    (``{"disk": 3, "object": 10}``); the newest is never deleted.

    ``object_store`` (an fsspec URL such as ``s3://bucket/prefix/run-42`` or ``file:///…``,
    or a ready ``Tier``) adds the off-node tier, filled in the background from the disk
    tier (from memory without one), at most once per ``object_interval_s``;
    ``storage_options`` go to fsspec (s3fs: endpoint_url, key, secret, …; by default the
    AWS environment and config are used).
    """

    def __init__(self, root: str | os.PathLike | None, *, keep_last: int | Mapping[str, int] = 3,
                 run: str | None = None, memory_dir: str = DEFAULT_SHM_DIR, state: Mapping[str, Any] | None = None,
                 threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES, object_store: str | Tier | None = None,
                 storage_options: dict | None = None, object_interval_s: float = 0.0) -> None:
        if root is None and object_store is None:
            raise ValueError("nothing durable to save to: give a disk root, an object_store, or both")
        self.keep_last_by_tier = dict(keep_last) if isinstance(keep_last, Mapping) else {}
        self.keep_last = keep_last if isinstance(keep_last, int) else 3  # for tiers not named
        if min([self.keep_last, *self.keep_last_by_tier.values()]) < 1:
            raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
        self.threads, self.chunk_bytes = threads, chunk_bytes
        self.rank, self.world_size = 0, 1
        self.run = run or "default"
        self.disk = LocalDiskTier(root, threads=threads) if root is not None else None
        if self.disk is not None:
            self.disk.root.mkdir(parents=True, exist_ok=True)
        self.object: Tier | None = None
        if object_store is not None:
            self.object = (object_store if isinstance(object_store, Tier)
                           else ObjectStoreTier(object_store, storage_options))
        ns = memory_namespace(root, self.run, memory_dir)
        owner_root = str(self.disk.root.resolve()) if self.disk is not None else self.object.location
        # Without a disk tier a slot stays busy while it uploads: a third keeps save() from waiting on it.
        self.pool = SlotPool(ns, self.rank, slots=2 if self.disk is not None else 3,
                             owner={"root": owner_root, "run": self.run})
        self.memory = MemoryTier(ns, self.rank, self.pool)
        self.tiers: list[Tier] = [t for t in (self.memory, self.disk, self.object) if t is not None]
        self.durable: list[Tier] = [self.disk] if self.disk is not None else []
        for tier in self.tiers[1:]:
            for leftover in tier.cleanup():
                log.info("removed leftover of an interrupted save: %s", leftover)
        self._offload = None if self.object is None else Offloader(
            self.object, interval_s=object_interval_s, world_size=self.world_size, retention=self._apply_retention)
        self._copier = TensorCopier()
        self._drainer = Drainer()
        self._handles: list[SaveHandle] = []
        self._generation: int | None = None
        self._prepared = False
        self.stall_s = 0.0  # total time save() waited for a slot still draining
        if self._offload is not None:
            self._current_generation()  # list the store now: save() must not wait on it during an outage
        if state is not None:
            self.prepare(state)

    # -- saving -------------------------------------------------------------------

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Size, allocate and pre-fault the memory slots in the background, so the first
        save is as fast as later ones."""
        _, nbytes = plan_layout(flatten(state).tensors)
        self.pool.prepare_async(nbytes)
        self._prepared = True

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle:
        """Copy ``state`` into shared memory and return; durability follows in the background.

        ``urgent`` (a failure is predicted) puts this checkpoint ahead of anything queued
        and sends it straight from memory to the object store; ``handle.wait("object")``
        returns once it is durable off-node, and ``handle.durable_s`` says how long that took.
        """
        t0 = time.monotonic()
        self._raise_background_errors()
        if self._prepared:
            self.pool.wait_prepared()
        flat = flatten(state)
        entries, nbytes = plan_layout(flat.tensors)
        ckpt_id = CheckpointId(self._current_generation(), int(step))
        manifest = ShardManifest(self.rank, ckpt_id.step, ckpt_id.generation, nbytes, entries, flat.tree, self.chunk_bytes)
        slot = self.pool.target()
        if not slot.idle.is_set():
            log.warning("save(%d) waits for the previous checkpoint to leave memory (the drain is slower than the "
                        "save interval)", step)
            w0 = time.monotonic()
            slot.idle.wait()
            self.stall_s += time.monotonic() - w0
        slot.idle.clear()
        try:
            self.pool.snapshot(slot, [t for _, t in flat.tensors], manifest, self._copier)
        except BaseException:
            slot.idle.set()
            raise
        upload = self._offload is not None and self._offload.wants(urgent)
        handle = SaveHandle(ckpt_id.step, [t.name for t in self.durable] + ([self.object.name] if upload else []))
        handle.blocking_s = time.monotonic() - t0
        if upload:
            self._offload.claim(handle, urgent)
        self._handles = [h for h in self._handles if not h.done] + [handle]
        lease = Lease(slot.idle.set)
        self._drainer.submit(lambda: self._drain(slot, manifest, ckpt_id, handle, upload, urgent, lease), handle,
                             urgent=urgent, on_exit=lease.release)
        return handle

    def _drain(self, slot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle,
               upload: bool = False, urgent: bool = False, lease: Lease | None = None) -> None:
        reader = SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, check_seal=False)
        try:
            reader.manifest = with_checksums(reader, self.threads)
            slot.seal(reader.manifest)  # memory restores can now verify too
            if upload and (urgent or self.disk is None):  # straight from memory; the slot waits for both
                lease.hold()
                sealed = reader.manifest
                self._offload.submit(ckpt_id, lambda: SlotReader(slot.meta_path, slot.data_path, sealed, slot.buffer,
                                                                 check_seal=False),
                                     handle, urgent=urgent, pin=False, on_exit=lease.release)
            for tier in self.durable:
                ref = tier.write_shard(ckpt_id, reader)
                tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size, [ref]))
                handle.mark(tier.name)
                if upload and tier is self.disk and not urgent:
                    self._offload.submit(ckpt_id, lambda ref=ref: self.disk.open_shard(ckpt_id, ref), handle,
                                         urgent=False, pin=True)
                self._apply_retention(tier)
        finally:
            reader.close()

    def _apply_retention(self, tier: Tier) -> None:
        infos = tier.list()
        keep_last = self.keep_last_by_tier.get(tier.name, self.keep_last)
        keep = {i.id for i in [i for i in infos if i.complete][-keep_last:]}
        keep |= self._offload.pinned if self._offload is not None and tier is self.disk else set()
        oldest_kept = min(keep, default=None)
        for info in infos:
            if info.id not in keep and (oldest_kept is None or info.id < oldest_kept):
                tier.delete(info.id)

    def _current_generation(self) -> int:
        if self._generation is None:
            ids = [i.id for t in self.tiers for i in t.list()]
            self._generation = max(ids).generation + 1 if ids else 0  # no restore: a new lineage
        return self._generation

    def wait(self, step: int | None = None, timeout: float | None = None) -> None:
        """Block until every pending save (or ``step``) is durable in every tier."""
        for h in list(self._handles):
            if step is None or h.step == step:
                h.wait(timeout=timeout)
        self._raise_background_errors()

    def _raise_background_errors(self) -> None:
        self._drainer.raise_error()
        if self._offload is not None:
            self._offload.raise_error()

    # -- restoring ----------------------------------------------------------------

    def restore(self, state: dict, step: int | None = None) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place: tensors
        into the existing objects, plain values into the dict. Returns the step, or None."""
        found = restore_newest(self.tiers, step=step, rank=self.rank, world_size=self.world_size,
                               state=state, threads=self.threads)
        if found is None:
            if step is not None:
                raise CheckpointError(f"step {step} is in no tier ({', '.join(t.location for t in self.tiers)})")
            return None
        cand, values = found
        load_into(state, values)
        newest = max(i.id for t in self.tiers for i in t.list())
        # Resuming anything but the newest abandons a branch: later saves start a new lineage.
        self._generation = newest.generation if cand.info.id == newest else newest.generation + 1
        log.info("restored step %d from %s (%s)", cand.info.id.step, cand.tier.name, cand.tier.location)
        return cand.info.id.step

    def list(self) -> list[dict]:
        """Every checkpoint: step, generation, time, size, the tiers holding it, and status."""
        return merge_listing(self.tiers)

    def close(self) -> None:
        """Finish pending drains, then release shared memory mappings (the slots stay)."""
        try:
            self._drainer.join()
        finally:
            self._drainer.close()
            try:
                if self._offload is not None:
                    self._offload.close()
            finally:
                self.pool.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_listing(tiers: list[Tier]) -> list[dict]:
    """One row per checkpoint id across tiers, newest last."""
    rows: dict[CheckpointId, dict] = {}
    for tier in tiers:
        for info in tier.list():
            row = rows.setdefault(info.id, {"step": info.id.step, "generation": info.id.generation,
                                            "created": info.created, "bytes": info.bytes, "tiers": [], "damaged": {}})
            if info.complete:
                row["tiers"].append(tier.name)
                row["bytes"] = max(row["bytes"], info.bytes)
            else:
                row["damaged"][tier.name] = info.error
    for row in rows.values():
        row["status"] = "complete" if row["tiers"] else "damaged"
    return [rows[k] for k in sorted(rows)]
