"""``CheckpointManager``: the public face. ``save()`` snapshots into shared memory and
returns; a drain job carries the snapshot to disk (and further tiers) in the
background; ``restore()`` loads the newest valid checkpoint in place.

Under torch.distributed every rank runs one manager: each writes its own shard
(replicated keys, e.g. a DDP model, only on rank 0), rank 0 commits a step once every
shard is durable in a tier, and restore agrees on one step across ranks.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable, Mapping

import torch

from .checksum import DEFAULT_CHUNK_BYTES
from .distributed import Coordinator, wait_until
from .drain import Drainer, Lease, SaveHandle
from .errors import BackgroundError, CheckpointError, DamagedCheckpoint, ManifestError
from .locations import memory_namespace
from .manifest import Manifest, ShardManifest, ShardRef
from .metrics import CheckpointMetrics
from .memory import (ALIGN, DEFAULT_SHM_DIR, ShmSlot, SlotPool, TensorCopier, namespace_dir, namespaces_of_root,
                     plan_layout, sweep_orphans)
from .offload import Offloader
from .restore import read_checkpoint, restore_newest
from .state import flatten, load_into
from .tensor_io import with_checksums
from .tiers.base import CheckpointId, Tier, prune
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier, SlotReader
from .tiers.object_store import ObjectStoreTier

log = logging.getLogger(__name__)


class CheckpointManager:
    """Tiered asynchronous checkpoints: memory (shared, survives the trainer) → local disk
    → object store (survives the node).

    ``root`` is the local-disk tier's directory (shared by the ranks of a node; None: no
    disk tier). ``keep_last`` is how many complete checkpoints each durable tier keeps,
    one number for all or per tier (``{"disk": 3, "object": 10}``); the newest is never
    deleted. ``replicated`` names state keys that are identical on every rank (a DDP
    model and its optimizer): only rank 0 stores them, every rank restores them.

    ``object_store`` (an fsspec URL such as ``s3://bucket/prefix/run-42`` or ``file:///…``,
    or a ready ``Tier``) adds the off-node tier, filled in the background from the disk
    tier (from memory without one), at most once per ``object_interval_s``;
    ``storage_options`` go to fsspec (s3fs: endpoint_url, key, secret, …; by default the
    AWS environment and config are used).

    ``metrics_port`` serves Prometheus metrics on 127.0.0.1 (port + rank).
    """

    def __init__(self, root: str | os.PathLike | None, *, keep_last: int | Mapping[str, int] = 3,
                 run: str | None = None, memory_dir: str = DEFAULT_SHM_DIR, state: Mapping[str, Any] | None = None,
                 replicated: Iterable[str] = (), threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 commit_timeout_s: float = 600.0, object_store: str | Tier | None = None,
                 storage_options: dict | None = None, object_interval_s: float = 0.0,
                 metrics_port: int | None = None) -> None:
        if root is None and object_store is None:
            raise ValueError("nothing durable to save to: give a disk root, an object_store, or both")
        self.keep_last_by_tier = dict(keep_last) if isinstance(keep_last, Mapping) else {}
        self.keep_last = keep_last if isinstance(keep_last, int) else 3  # for tiers not named
        if min([self.keep_last, *self.keep_last_by_tier.values()]) < 1:
            raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
        self.threads, self.chunk_bytes = threads, chunk_bytes
        self.commit_timeout_s = commit_timeout_s
        self.replicated = frozenset(replicated)
        self.coord = Coordinator()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.run = run or "default"
        self.disk = LocalDiskTier(root, threads=threads) if root is not None else None
        if self.disk is not None:
            self.disk.root.mkdir(parents=True, exist_ok=True)
        self.object: Tier | None = None
        if object_store is not None:
            self.object = (object_store if isinstance(object_store, Tier)
                           else ObjectStoreTier(object_store, storage_options))
        if self.disk is not None:
            self._ns = memory_namespace(root, self.run, memory_dir)
            owner_root = str(self.disk.root.resolve())
        else:
            owner_root = self.object.location
            self._ns = namespace_dir(owner_root, self.run, memory_dir)
        # Without a disk tier a slot stays busy while it uploads: a third keeps save() from waiting on it.
        self.pool = SlotPool(self._ns, self.rank, slots=2 if self.disk is not None else 3,
                             owner={"root": owner_root, "run": self.run})
        self.memory = MemoryTier(self._ns, self.rank, self.pool)
        self.tiers: list[Tier] = [t for t in (self.memory, self.disk, self.object) if t is not None]  # fastest first
        self.durable: list[Tier] = [self.disk] if self.disk is not None else []  # drained in this order
        if self.coord.is_coordinator:
            self._remove_leftovers(memory_dir)
        self.coord.barrier()  # nobody writes before the leftovers are gone
        self._offload = None if self.object is None else Offloader(
            self.object, commit=self._commit, interval_s=object_interval_s,
            retention=self._apply_retention if self.coord.is_coordinator else None)
        self._copier = TensorCopier()
        self._drainer = Drainer()
        self._handles: list[SaveHandle] = []
        self._generation: int | None = None
        self._prepared = False
        self._closed = False
        self.stall_s = 0.0  # total time save() waited for a slot still draining
        self.metrics = CheckpointMetrics(self.rank) if metrics_port is not None else None
        if self.metrics is not None:
            self.metrics.serve(metrics_port + self.rank)
        if self._offload is not None:
            self._current_generation()  # list the store now: save() must not wait on it during an outage
        if state is not None:
            self.prepare(state)

    def _remove_leftovers(self, memory_dir: str) -> None:
        leftovers = self.object.cleanup() if self.object is not None else []
        if self.disk is not None:
            on_disk = {(i.id.generation, i.id.step) for i in self.disk.list() if i.complete}
            others = [n for n in namespaces_of_root(str(self.disk.root.resolve()), memory_dir) if n != self._ns]
            leftovers += self.disk.cleanup() + sweep_orphans(others, on_disk)
        for leftover in leftovers:
            log.info("removed leftover of an interrupted save: %s", leftover)

    # -- saving -------------------------------------------------------------------

    def _own_part(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.rank == 0 or not self.replicated:
            return state
        return {k: v for k, v in state.items() if k not in self.replicated}

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Size, allocate and pre-fault the memory slots in the background, so the first
        save is as fast as later ones. Optimizers create their state at their first
        step; for parameters without state yet, room for two moments (Adam's) is kept."""
        own = self._own_part(state)
        tensors = flatten(own).tensors
        _, nbytes = plan_layout(tensors)
        self.pool.prepare_async(nbytes + _lazy_optimizer_bytes(own.values()), pin=any(t.is_cuda for _, t in tensors))
        self._prepared = True

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle:
        """Copy ``state`` into shared memory and return; durability follows in the background.
        Under torch.distributed every rank calls it for the same step.

        ``urgent`` (a failure is predicted) puts this checkpoint ahead of anything queued
        and sends it straight from memory to the object store; ``handle.wait("object")``
        returns once it is durable off-node, and ``handle.durable_s`` says how long that took.
        """
        t0 = time.monotonic()
        self._raise_background_errors()
        if self._prepared:
            self.pool.wait_prepared()
        flat = flatten(self._own_part(state))
        entries, nbytes = plan_layout(flat.tensors)
        ckpt_id = CheckpointId(self._current_generation(), int(step))
        manifest = ShardManifest(self.rank, ckpt_id.step, ckpt_id.generation, nbytes, entries, flat.tree,
                                 self.chunk_bytes, self.world_size)
        slot = self.pool.target()
        if not slot.idle.is_set():
            log.warning("save(%d) waits for the previous checkpoint to leave memory (the drain is slower than the "
                        "save interval)", step)
            w0 = time.monotonic()
            slot.idle.wait()
            self.stall_s += time.monotonic() - w0
            if self.metrics is not None:
                self.metrics.stall.inc(time.monotonic() - w0)
        slot.idle.clear()
        try:
            self.pool.snapshot(slot, [t for _, t in flat.tensors], manifest, self._copier)
        except BaseException:
            slot.idle.set()
            raise
        # every rank must agree: rank 0 commits only once all shards are up
        upload = self._offload is not None and self.coord.all(self._offload.wants(urgent))
        handle = SaveHandle(ckpt_id.step, [t.name for t in self.durable] + ([self.object.name] if upload else []),
                            nbytes=nbytes, observer=self.metrics)
        handle.blocking_s = time.monotonic() - t0
        if self.metrics is not None:
            self.metrics.saved(handle.blocking_s, urgent)
        if upload:
            self._offload.claim(handle, urgent)
        self._handles = [h for h in self._handles if not h.done] + [handle]
        lease = Lease(slot.idle.set)
        self._drainer.submit(lambda: self._drain(slot, manifest, ckpt_id, handle, upload, urgent, lease), handle,
                             urgent=urgent, on_exit=lease.release)
        return handle

    def _drain(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle,
               upload: bool = False, urgent: bool = False, lease: Lease | None = None) -> None:
        reader = SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, seal=None)
        try:
            reader.manifest = with_checksums(reader, self.threads)
            slot.seal(reader.manifest)  # memory restores can now verify too
            if upload and (urgent or self.disk is None):  # straight from memory; the slot waits for both
                lease.hold()
                sealed = reader.manifest
                self._offload.submit(ckpt_id, lambda: SlotReader(slot.meta_path, slot.data_path, sealed, slot.buffer,
                                                                 seal=None),
                                     handle, urgent=urgent, pin=False, on_exit=lease.release)
            for tier in self.durable:
                ref = tier.write_shard(ckpt_id, reader)
                self._commit(tier, ckpt_id, ref)
                if upload and tier is self.disk and not urgent:
                    self._offload.submit(ckpt_id, lambda ref=ref: self.disk.open_shard(ckpt_id, ref), handle,
                                         urgent=False, pin=True)
                if self.coord.is_coordinator:
                    self._apply_retention(tier)
                handle.mark(tier.name)
        finally:
            reader.close()

    def _commit(self, tier: Tier, ckpt_id: CheckpointId, ref: ShardRef) -> None:
        """This rank's shard is durable in ``tier``: rank 0 commits once every rank's is."""
        if self.world_size == 1:
            tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, 1, [ref]))
        elif self.coord.is_coordinator:
            refs = wait_until(lambda: (r := tier.written_shards(ckpt_id)) and len(r) == self.world_size and r,
                              self.commit_timeout_s, f"every rank's shard of step {ckpt_id.step} in {tier.name}",
                              tier.poll_s)
            tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size,
                                          [refs[r] for r in sorted(refs)]))
        else:
            wait_until(lambda: self._committed(tier, ckpt_id), self.commit_timeout_s,
                       f"rank 0 to commit step {ckpt_id.step} in {tier.name}", tier.poll_s)

    @staticmethod
    def _committed(tier: Tier, ckpt_id: CheckpointId) -> bool:
        try:
            tier.read_manifest(ckpt_id)
            return True
        except (OSError, ManifestError):
            return False

    def _apply_retention(self, tier: Tier) -> None:
        pinned = self._offload.pinned if self._offload is not None and tier is self.disk else ()
        prune(tier, self.keep_last_by_tier.get(tier.name, self.keep_last), pinned)

    def _newest_known(self) -> CheckpointId | None:
        return max((i.id for t in self.tiers for i in t.list()), default=None)

    def _current_generation(self) -> int:
        if self._generation is None:
            newest = self._newest_known()
            # No restore happened: whatever is here belongs to another lineage.
            self._generation = self.coord.max(newest.generation + 1 if newest else 0)
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
        self._raise_background_errors()

    def _raise_background_errors(self) -> None:
        self._drainer.raise_error()
        if self._offload is not None:
            self._offload.raise_error()

    def agree(self, *flags: bool) -> list[bool]:
        """At a step boundary: each flag is true on every rank if any rank raised it
        (an urgent save, a preemption), so all ranks act on the same step."""
        return self.coord.any(*flags)

    # -- restoring ----------------------------------------------------------------

    def restore(self, state: dict, step: int | None = None) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place: tensors
        into the existing objects, plain values into the dict. Returns the step, or None.
        Under torch.distributed all ranks load the same step."""
        if self.world_size == 1:
            found = restore_newest(self.tiers, step=step, state=state, world_size=1, threads=self.threads)
            if found is None:
                return self._nothing(step)
            ckpt_id, values = found[0].info.id, found[1]
            log.info("restored step %d from %s (%s)", ckpt_id.step, found[0].tier.name, found[0].tier.location)
        else:
            agreed = self._restore_agreed(state, step)
            if agreed is None:
                return self._nothing(step)
            ckpt_id, values = agreed
        load_into(state, values)
        newest = self._newest_known() or ckpt_id
        generation = self.coord.max(newest.generation)
        # Resuming anything but the newest abandons a branch: later saves start a new lineage.
        self._generation = generation if self.coord.all(ckpt_id == newest) else generation + 1
        return ckpt_id.step

    def _nothing(self, step: int | None) -> None:
        if step is not None:
            raise CheckpointError(f"step {step} is in no tier ({', '.join(t.location for t in self.tiers)})")
        return None

    def _tiers_of_shard(self, rank: int) -> list[Tier]:
        memory = self.memory if rank == self.rank else MemoryTier(self._ns, rank)
        return [memory, *self.durable, *([self.object] if self.object is not None else [])]

    def _readable(self, step: int | None) -> set[CheckpointId]:
        """Ids whose shards this rank needs are listed complete in some tier."""
        need = {self.rank} | ({0} if self.replicated else set())
        per_rank = [{i.id for t in self._tiers_of_shard(r) for i in t.list()
                     if i.complete and (step is None or i.id.step == step)} for r in need]
        return set.intersection(*per_rank)

    def _restore_agreed(self, state: dict, step: int | None) -> tuple[CheckpointId, dict] | None:
        rejected: set[CheckpointId] = set()
        while True:
            common = set.intersection(*(set(ids) for ids in self.coord.gather(sorted(self._readable(step) - rejected))))
            if not common:
                return None
            target = max(common)
            values, error = self._read_shards(target, state)
            if self.coord.all(error is None):
                log.info("rank %d restored step %d", self.rank, target.step)
                return target, values
            if error is not None:
                log.warning("rank %d cannot restore step %d: %s", self.rank, target.step, error)
            rejected.add(target)

    def _read_shards(self, ckpt_id: CheckpointId, state: dict) -> tuple[dict, Exception | None]:
        values: dict = {}
        try:
            for rank in sorted({self.rank} | ({0} if self.replicated and self.rank != 0 else set())):
                found = None
                for tier in self._tiers_of_shard(rank):
                    try:
                        found = read_checkpoint(tier, ckpt_id, rank=rank, world_size=self.world_size, state=state,
                                                threads=self.threads)
                        break
                    except (DamagedCheckpoint, ManifestError, OSError, EOFError) as e:
                        log.warning("rank %d: step %d, shard %d in %s: %s", self.rank, ckpt_id.step, rank, tier.name, e)
                if found is None:
                    raise CheckpointError(f"no valid copy of shard {rank} of step {ckpt_id.step}")
                values.update(found if rank == self.rank else {k: v for k, v in found.items() if k in self.replicated})
        except CheckpointError as e:
            return {}, e
        return values, None

    def list(self) -> list[dict]:
        """Every checkpoint: step, generation, time, size, the tiers holding it, and status."""
        return merge_listing(self.tiers)

    def close(self) -> None:
        """Finish pending drains, then release shared memory mappings (the slots stay).
        Idempotent: a preempted loop closes before exiting, inside ``with manager``."""
        if self._closed:
            return
        self._closed = True
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


def _lazy_optimizer_bytes(values: Iterable[Any]) -> int:
    """Bytes an optimizer will add at its first step: two moments per stateless parameter."""
    total = 0
    for v in values:
        if isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                total += sum(2 * (p.numel() * p.element_size() + ALIGN) for p in group["params"] if p not in v.state)
    return total


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
