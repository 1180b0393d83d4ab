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
from .drain import Drainer, SaveHandle
from .errors import BackgroundError, CheckpointError, DamagedCheckpoint, ManifestError
from .locations import memory_namespace
from .manifest import Manifest, ShardManifest
from .memory import ALIGN, DEFAULT_SHM_DIR, ShmSlot, SlotPool, TensorCopier, namespaces_of_root, plan_layout, sweep_orphans
from .restore import read_checkpoint, restore_newest
from .state import flatten, load_into
from .tensor_io import with_checksums
from .tiers.base import CheckpointId, Tier
from .tiers.local import LocalDiskTier
from .tiers.memory import MemoryTier, SlotReader

log = logging.getLogger(__name__)


class CheckpointManager:
    """Tiered asynchronous checkpoints: memory (shared, survives the trainer) → local disk.

    ``root`` is the local-disk tier's directory (shared by the ranks of a node).
    ``keep_last`` is how many complete checkpoints each durable tier keeps; the newest
    is never deleted. ``replicated`` names state keys that are identical on every rank
    (a DDP model and its optimizer): only rank 0 stores them, every rank restores them.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, run: str | None = None,
                 memory_dir: str = DEFAULT_SHM_DIR, state: Mapping[str, Any] | None = None,
                 replicated: Iterable[str] = (), threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 commit_timeout_s: float = 600.0) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
        self.keep_last, self.threads, self.chunk_bytes = keep_last, threads, chunk_bytes
        self.commit_timeout_s = commit_timeout_s
        self.replicated = frozenset(replicated)
        self.coord = Coordinator()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.run = run or "default"
        self.disk = LocalDiskTier(root, threads=threads)
        self.disk.root.mkdir(parents=True, exist_ok=True)
        self._ns = memory_namespace(root, self.run, memory_dir)
        self.pool = SlotPool(self._ns, self.rank, owner={"root": str(self.disk.root.resolve()), "run": self.run})
        self.memory = MemoryTier(self._ns, self.rank, self.pool)
        self.tiers: list[Tier] = [self.memory, self.disk]  # fastest first
        self.durable: list[Tier] = [self.disk]  # drained in this order
        if self.coord.is_coordinator:
            self._remove_leftovers(memory_dir)
        self.coord.barrier()  # nobody writes before the leftovers are gone
        self._copier = TensorCopier()
        self._drainer = Drainer()
        self._handles: list[SaveHandle] = []
        self._generation: int | None = None
        self._prepared = False
        self._closed = False
        self.stall_s = 0.0  # total time save() waited for a slot still draining
        if state is not None:
            self.prepare(state)

    def _remove_leftovers(self, memory_dir: str) -> None:
        on_disk = {(i.id.generation, i.id.step) for i in self.disk.list() if i.complete}
        others = [n for n in namespaces_of_root(str(self.disk.root.resolve()), memory_dir) if n != self._ns]
        for leftover in self.disk.cleanup() + sweep_orphans(others, on_disk):
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
        _, nbytes = plan_layout(flatten(own).tensors)
        self.pool.prepare_async(nbytes + _lazy_optimizer_bytes(own.values()))
        self._prepared = True

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle:
        """Copy ``state`` into shared memory and return; durability follows in the background.
        Under torch.distributed every rank calls it for the same step."""
        t0 = time.monotonic()
        self._drainer.raise_error()
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

    def _drain(self, slot: ShmSlot, manifest: ShardManifest, ckpt_id: CheckpointId, handle: SaveHandle) -> None:
        reader = SlotReader(slot.meta_path, slot.data_path, manifest, slot.buffer, check_seal=False)
        try:
            reader.manifest = with_checksums(reader, self.threads)
            slot.seal(reader.manifest)  # memory restores can now verify too
            for tier in self.durable:
                ref = tier.write_shard(ckpt_id, reader)
                if self.world_size == 1:
                    tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, 1, [ref]))
                elif self.coord.is_coordinator:
                    refs = wait_until(lambda: (r := tier.written_shards(ckpt_id)) and len(r) == self.world_size and r,
                                      self.commit_timeout_s, f"every rank's shard of step {ckpt_id.step} in {tier.name}")
                    tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size,
                                                  [refs[r] for r in sorted(refs)]))
                else:
                    wait_until(lambda: self._committed(tier, ckpt_id), self.commit_timeout_s,
                               f"rank 0 to commit step {ckpt_id.step} in {tier.name}")
                if self.coord.is_coordinator:
                    self._apply_retention(tier)
                handle.mark(tier.name)
        finally:
            reader.close()

    @staticmethod
    def _committed(tier: Tier, ckpt_id: CheckpointId) -> bool:
        try:
            tier.read_manifest(ckpt_id)
            return True
        except (OSError, ManifestError):
            return False

    def _apply_retention(self, tier: Tier) -> None:
        infos = tier.list()
        keep = {i.id for i in [i for i in infos if i.complete][-self.keep_last:]}
        oldest_kept = min(keep, default=None)
        for info in infos:
            if info.id not in keep and (oldest_kept is None or info.id < oldest_kept):
                tier.delete(info.id)

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
        self._drainer.raise_error()

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
        return [memory, *self.durable]

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
