"""``CheckpointManager``: the public face. ``save()`` snapshots into shared memory and
returns; a drain job carries the snapshot to disk (and further tiers) in the
background; ``restore()`` loads the newest valid checkpoint in place."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

from .drain import Drainer, SaveHandle
from .errors import BackgroundError, CheckpointError
from .manifest import Manifest, ShardManifest
from .locations import memory_namespace
from .memory import DEFAULT_SHM_DIR, SlotPool, TensorCopier, namespaces_of_root, plan_layout, sweep_orphans
from .checksum import DEFAULT_CHUNK_BYTES
from .restore import restore_newest
from .state import flatten, load_into
from .tensor_io import with_checksums
from .tiers.base import CheckpointId, CheckpointInfo, Tier
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier, SlotReader

log = logging.getLogger(__name__)


class CheckpointManager:
    """Tiered asynchronous checkpoints: memory (shared, survives the trainer) → local disk.

    ``root`` is the local-disk tier's directory. ``keep_last`` is how many complete
    checkpoints each durable tier keeps; the newest is never deleted.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, run: str | None = None,
                 memory_dir: str = DEFAULT_SHM_DIR, state: Mapping[str, Any] | None = None,
                 threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
        self.keep_last, self.threads, self.chunk_bytes = keep_last, threads, chunk_bytes
        self.rank, self.world_size = 0, 1
        self.run = run or "default"
        self.disk = LocalDiskTier(root, threads=threads)
        self.disk.root.mkdir(parents=True, exist_ok=True)
        ns = memory_namespace(root, self.run, memory_dir)
        self.pool = SlotPool(ns, self.rank, owner={"root": str(self.disk.root.resolve()), "run": self.run})
        self.memory = MemoryTier(ns, self.rank, self.pool)
        self.tiers: list[Tier] = [self.memory, self.disk]
        self.durable: list[Tier] = [self.disk]
        on_disk = {(i.id.generation, i.id.step) for i in self.disk.list() if i.complete}
        others = [n for n in namespaces_of_root(str(self.disk.root.resolve()), memory_dir) if n != ns]
        for leftover in self.disk.cleanup() + sweep_orphans(others, on_disk):
            log.info("removed leftover of an interrupted save: %s", leftover)
        self._copier = TensorCopier()
        self._drainer = Drainer()
        self._handles: list[SaveHandle] = []
        self._generation: int | None = None
        self._prepared = False
        self.stall_s = 0.0  # total time save() waited for a slot still draining
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
        """Copy ``state`` into shared memory and return; durability follows in the background."""
        t0 = time.monotonic()
        self._drainer.raise_error()
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
        handle = SaveHandle(ckpt_id.step, [t.name for t in self.durable])
        handle.blocking_s = time.monotonic() - t0
        self._handles = [h for h in self._handles if not h.done] + [handle]
        self._drainer.submit(lambda: self._drain(slot, manifest, ckpt_id, handle), handle, urgent=urgent,
                             on_exit=slot.idle.set)
        return handle

    def _drain(self, slot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle) -> None:
        reader = SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, check_seal=False)
        try:
            reader.manifest = with_checksums(reader, self.threads)
            slot.seal(reader.manifest)  # memory restores can now verify too
            for tier in self.durable:
                ref = tier.write_shard(ckpt_id, reader)
                tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size, [ref]))
                handle.mark(tier.name)
                self._apply_retention(tier)
        finally:
            reader.close()

    def _apply_retention(self, tier: Tier) -> None:
        infos = tier.list()
        keep = {i.id for i in [i for i in infos if i.complete][-self.keep_last:]}
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
        """Block until every pending save (or ``step``) is durable in every tier; raise
        BackgroundError, once per failure, if a background write failed."""
        for h in list(self._handles):
            if step is None or h.step == step:
                try:
                    h.wait(timeout=timeout)
                except BackgroundError:
                    pass  # the drainer holds the same failure: raised once, below, not again at the next save()
        self._drainer.raise_error()

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
