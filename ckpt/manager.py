"""``CheckpointManager``: the public face. ``save()`` snapshots into shared memory and
returns; a drain job carries the snapshot to disk (and further tiers) in the
background; ``restore()`` loads the newest valid checkpoint in place.

Under torch.distributed every rank runs one manager: each writes its own shard
(replicated keys, e.g. a DDP model, only on the first rank of each disk volume), the
``Committer`` makes a step visible once every shard is durable, and restore agrees
on one step across ranks. The wiring is here; the mechanisms live in their modules:
``tiers/`` (storage by role), ``save/`` (``durable.py``, ``commit.py``: the durable tiers
and their commits; ``save_path.py``: a save's bytes, tier by tier; ``drain.py``/``offload.py``:
background queues), ``restore/`` (``job.py``: a rank's restore; ``plan.py``, ``execute.py``,
``reshard.py``: what to read, and reading it).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .coordination import Coordinator
from .errors import BackgroundError, CheckpointError, SnapshotChanged
from .format.checksum import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from .format.state import flatten
from .recovery.restarts import mark
from .restore.execute import log_restored, open_shard
from .restore.fresh_start import set_aside
from .restore.job import readable_tiers, restore_job
from .restore.plan import shard_needs
from .restore.reshard import ReshardStats
from .save.canary import avoided, reference
from .save.drain import SaveHandle
from .save.durable import open_durable
from .save.lineage import Lineage
from .save.metrics import CheckpointMetrics
from .save.offload import Offloader
from .save.shm_budget import check_room, lazy_optimizer_bytes, refusal_of
from .save.sweep import remove_leftovers, sweep_finished
from .tiers.base import CheckpointId, DurableTier, TierReader
from .tiers.memory import DEFAULT_SHM_DIR, MemoryTier, namespace_dir
from .tiers.memory.copier import plan_layout
from .wiring import wire_saves

if TYPE_CHECKING:
    from .format.manifest import ShardManifest
    from .tiers.memory.slots import ShmSlot

log = logging.getLogger(__name__)


class CheckpointManager:
    """Tiered asynchronous checkpoints: memory (shared, survives the trainer) → local disk
    → object store (survives the node).

    ``root`` is the local-disk tier's directory (shared by the ranks of a node, or by all
    on a shared filesystem; None: no disk tier). ``keep_last`` is how many complete
    checkpoints each durable tier keeps, one number for all or per tier
    (``{"disk": 3, "object": 10}``); the newest is never deleted. ``replicated`` names
    state keys that are identical on every rank (a DDP model and its optimizer): only
    the first rank of each disk volume stores them, every rank restores them.

    ``object_store`` (an fsspec URL such as ``s3://bucket/prefix/run-42`` or ``file:///…``,
    or a ready ``DurableTier``) adds the off-node tier, filled in the background from the
    disk tier (from memory without one), at most once per ``object_interval_s``;
    ``storage_options`` go to fsspec (s3fs: endpoint_url, key, secret, …; by default the
    AWS environment and config are used).

    ``metrics_port`` serves Prometheus metrics on ``metrics_addr`` (127.0.0.1 by default) at
    port + local rank: one port range per node (simulated nodes on one host give each
    node its own base port).

    ``peers`` (0: off) keeps each rank's newest sealed snapshot also in the shared memory
    of that many ranks on other nodes (``ckpt/peers``), so a lost node restores at memory
    speed; ``node`` names this rank's node (default: CKPT_GUARD_NODE, then the host name),
    ``peer_bytes_per_s`` caps each rank's sending rate, ``peer_timeout_s`` abandons a send;
    ``peer_avoid_at_risk`` places no replica on a node the predictor reports at risk
    while others are left (``ckpt.resumable(predictor=...)`` and the callbacks tell it).

    ``overlap`` (docs/overlap.md): parameters and optimizer state are copied during the next forward
    and backward, the next ``optimizer.step()`` waits for it, superseded drains are skipped; one more
    memory slot per rank. ``overlap_verify``: also refuse a snapshot torn by a write through numpy or ``.data``.
    ``drain_interval_s`` (with ``overlap``): a drain to the lower tiers starts at most
    this often; the snapshots saved meanwhile stay in memory only (superseded), so saving
    every step keeps the checksum, peer and disk work off the training's cores.
    ``node_memory`` restores from every rank's memory slots on this node, not only this rank's
    (``ckpt.inprocess``: a lost rank's sealed slots). ``keep_memory``: keep them at a normal end too.
    ``sweep``: remove what interrupted saves and this root's dead jobs left behind, the
    job's start-up (``ckpt.inprocess`` skips it when it rebuilds a manager after a fault).
    ``compare_replicas`` (on): compare replicas' digests at each save, not ``rank_local`` keys (docs/sound-state.md).
    ``control_timeout_s``: a dead peer fails the manager's own agreements (its gloo group) in that time.
    """

    def __init__(self, root: str | os.PathLike | None, *, keep_last: int | Mapping[str, int] = 3,
                 run: str | None = None, memory_dir: str = DEFAULT_SHM_DIR, state: Mapping[str, Any] | None = None,
                 replicated: Iterable[str] = (), threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 commit_timeout_s: float = 600.0, object_store: str | DurableTier | None = None,
                 storage_options: dict | None = None, object_interval_s: float = 0.0,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1", peers: int = 0,
                 node: str | None = None, peer_bytes_per_s: float | None = None,
                 peer_timeout_s: float = 300.0, peer_avoid_at_risk: bool = False, overlap: bool = False,
                 keep_memory: bool = False, node_memory: bool = False, drain_interval_s: float = 0.0,
                 sweep: bool = True, overlap_verify: bool = False, rank_local: Iterable[str] = (),
                 compare_replicas: bool = True, control_timeout_s: float = 120.0) -> None:
        if root is None and object_store is None:
            raise ValueError("nothing durable to save to: give a disk root, an object_store, or both")
        if drain_interval_s and not overlap:
            raise ValueError("drain_interval_s paces the drains that a newer snapshot may skip: it needs overlap=True")
        self.threads, self.chunk_bytes = threads, check_chunk_bytes(chunk_bytes)
        # a restore runs while training waits, so its checksums take up to 8 cores
        self.restore_threads = max(threads, min(8, os.cpu_count() or 1))
        self.node_memory = node_memory
        self.replicated = frozenset(replicated)
        self.keep_memory = keep_memory
        self.restart_expected = False  # set on preemption (the integrations): close() keeps the slots for it
        self.coord = Coordinator(control_timeout_s)
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.run = run or "default"
        opened = open_durable(self.coord, root, object_store, storage_options=storage_options, run=self.run,
                              threads=threads, keep_last=keep_last, commit_timeout_s=commit_timeout_s)
        self.disk, self.object, self.committer = opened.disk, opened.object, opened.committer
        durable = opened.tiers
        self._home = durable[0]  # the disk, else the object store: its volume groups the ranks of a node
        self._owner_root = str(self.disk.root.resolve()) if self.disk is not None else self.object.location
        self._ns = namespace_dir(self._owner_root, self.run, memory_dir)
        # Without a disk tier a slot stays busy while it uploads: a third keeps save() from waiting on it;
        # overlapped, one more, for the snapshot being copied while the newest sealed one waits for the drain.
        self.overlap = overlap
        self.memory = MemoryTier.own(self._ns, self.rank, slots=(2 if self.disk is not None else 3) + overlap,
                                     owner={"root": self._owner_root, "run": self.run})
        self.tiers: list[TierReader] = [self.memory, *durable]  # fastest first
        if sweep:
            remove_leftovers(self.disk, self.object, self.committer.leads, root=self._owner_root, run=self.run,
                             own=self._ns, memory_dir=memory_dir)
            self.coord.barrier()  # nobody writes before the leftovers are gone
        self._offload = None if self.object is None else Offloader(self.object, self.committer,
                                                                   interval_s=object_interval_s)
        self._handles: list[SaveHandle] = []
        self._lineage = Lineage(self.coord, self.tiers)
        self._prepared = self._closed = False
        self.last_reshard: ReshardStats | None = None  # the last restore's, when it was at another world size
        self.metrics = None if metrics_port is None else CheckpointMetrics(self.rank)
        if self.metrics is not None:  # stopped by close(), as every server we start
            self.metrics.serve(metrics_port + int(os.environ.get("LOCAL_RANK", "0")), metrics_addr)
        self.peering, self._saves = wire_saves(
            self, memory_dir=memory_dir, node=node, peers=peers, peer_bytes_per_s=peer_bytes_per_s,
            peer_timeout_s=peer_timeout_s, peer_avoid_at_risk=peer_avoid_at_risk, overlap_verify=overlap_verify,
            drain_interval_s=drain_interval_s, rank_local=rank_local, compare=compare_replicas)
        if self._offload is not None:
            self._lineage.current()  # list the store now: save() must not wait on it during an outage
        if state is not None:  # every rank refuses together when one node's /dev/shm is too small
            refused = [e for e in self.coord.gather(refusal_of(self.prepare, state)) if e]
            if refused:
                self._release()
                raise CheckpointError(refused[0])

    # -- saving -------------------------------------------------------------------

    @property
    def _replica_holder(self) -> int:
        """The rank that stores (and serves at restore) the replicated keys for this rank."""
        return self.committer.volume_ranks(self._home)[0]

    def _own_part(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.rank == self._replica_holder or not self.replicated:
            return state
        return {k: v for k, v in state.items() if k not in self.replicated}

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Size, allocate and pre-fault the memory slots in the background, so the first
        save is as fast as later ones. Optimizers create their state at their first
        step; for parameters without state yet, room for two moments (Adam's) is kept.
        Raises CheckpointError when the memory directory cannot hold this node's slots."""
        own = self._own_part(state)
        tensors = flatten(own).tensors
        _, nbytes = plan_layout(tensors)
        nbytes += lazy_optimizer_bytes(own.values())
        check_room(self._ns, self.memory.pool, nbytes, self.peering)
        self.memory.prepare_async(nbytes, pin=any(t.is_cuda for _, t in tensors))
        self._prepared = True

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle:
        """Copy ``state`` into shared memory and return; durability follows in the background.
        Under torch.distributed every rank calls it for the same step.

        ``urgent`` (a failure is predicted) puts this checkpoint ahead of anything queued
        and sends it straight from memory to the object store and, with ``peers``, to the
        peer replicas ahead of any other (evacuation); ``handle.wait("object")`` or
        ``handle.wait("peer")`` returns once it is durable off-node, and
        ``handle.durable_s`` says how long each tier took.

        With ``overlap``, the parameters and optimizer state are still being copied when it
        returns (``wait_staged()``); an urgent save returns sealed.
        """
        t0 = time.monotonic()
        self.wait_staged()
        self._saves.pace.resume()
        self._raise_background_errors()
        self._saves.raise_unsound()
        ckpt_id = CheckpointId(self._lineage.current(), int(step))
        if self.overlap:
            self._saves.skip_superseded(self.coord.max)
        slot, manifest = self._snapshot(ckpt_id, state, staged=self.overlap)
        nbytes = manifest.data_bytes
        # every rank must agree: a step is committed only once all shards are up
        upload = self._offload is not None and self._offload.decide(self.coord, ckpt_id, urgent)
        tiers = ([self.disk.name] if self.disk else []) + ([self.object.name] if upload else [])
        if urgent and self.peering is not None and self.peering.holders:
            tiers.append("peer")  # evacuation: the urgent handle waits for the replica too
        handle = SaveHandle(ckpt_id.step, tiers, nbytes=nbytes, observer=self.metrics)
        handle.blocking_s = time.monotonic() - t0
        if self.metrics is not None:
            self.metrics.saved(handle.blocking_s, urgent)
        if upload:
            self._offload.claim(handle, urgent)
        self._handles = [h for h in self._handles if not h.done] + [handle]
        self._saves.submit(slot, manifest, ckpt_id, handle, upload=upload, urgent=urgent)
        return handle

    def wait_staged(self) -> None:
        """``overlap``: wait for the last ``save()``'s copy, seal it and queue its drain. The
        next ``optimizer.step()`` of each optimizer in the state calls it (a pre-hook), as do
        ``save()``, ``wait()``, ``flush()`` and ``restore()``; call it before writing a saved
        tensor in place any other way. Raises ``SnapshotChanged`` (the snapshot is dropped)
        when a saved tensor was written in place during the copy."""
        self._saves.wait_staged()

    @property
    def stall_s(self) -> float:
        """Total time ``save()`` waited for a slot still draining."""
        return self._saves.stall_s

    @property
    def staged_wait_s(self) -> float:
        """``overlap``: total time steps (``wait_staged()``) waited for a snapshot's copy to end."""
        return self._saves.staged_wait_s

    def _snapshot(self, ckpt_id: CheckpointId, state: Mapping[str, Any], *,
                  staged: bool = False) -> tuple[ShmSlot, ShardManifest]:
        if self._prepared:
            self.memory.wait_prepared()
        return (self._saves.stage if staged else self._saves.snapshot)(ckpt_id, self._own_part(state), state)

    def wait(self, step: int | None = None, timeout: float | None = None) -> None:
        """Block until every pending save (or ``step``) is durable in every tier its handle
        names: the disk, and the object store for saves chosen for upload (urgent ones, one
        per ``object_interval_s``, the first after a pending upload ended). A save skipped
        because an upload was pending goes up later or at ``flush()``, not here. With
        ``overlap``, a step whose drain was skipped for a newer one (``superseded_by``)
        counts as done when that newer step is durable. Raise BackgroundError, once per
        failure, if a background write failed."""
        self.wait_staged()
        self._saves.pace.hurry()
        for h in list(self._handles):
            if step is None or h.step == step:
                try:
                    h.wait(timeout=timeout)
                except BackgroundError:
                    pass  # the drainer holds the same failure: raised once, below, not again at the next save()
        self._raise_background_errors()

    def _raise_background_errors(self) -> None:
        self._saves.drainer.raise_error()
        if self._offload is not None:
            self._offload.raise_error()

    def agree(self, *flags: bool) -> list[bool]:
        """At a step boundary: each flag is true on every rank if any rank raised it
        (an urgent save, a preemption), so all ranks act on the same step."""
        return self.coord.any(*flags)

    # -- restoring ----------------------------------------------------------------

    def restore(self, state: dict, step: int | None = None, *, fresh_ok: bool | None = None) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place: tensors
        into the existing objects, plain values into the dict. Returns the step, or None
        when there is none. Under torch.distributed all ranks load the same step; one saved by
        another number of ranks is resharded (``reshard.py``, ``last_reshard``). Checkpoints
        that cannot be restored into this job raise, unless ``fresh_ok`` (``fresh_start.py``)."""
        try:
            self.wait_staged()  # in-process recovery: the snapshot being copied is the newest
        except SnapshotChanged as e:
            log.warning("%s", e)
        try:
            return self._restore(state, step)
        except CheckpointError as e:
            if step is not None:
                raise
            set_aside(e, fresh_ok, [t.location for t in self.tiers])  # raises unless a fresh start is asked for
            return None

    def _restore(self, state: dict, step: int | None) -> int | None:
        t0 = time.monotonic()
        mark("restore_start")  # restart timing (ckpt.restarts)
        tiers = readable_tiers(self.memory, self._ns, self._replica_holder, replicated=bool(self.replicated),
                               node_memory=self.node_memory, durable=self.tiers[1:])
        needs = partial(shard_needs, rank=self.rank, world=self.world_size, replicated=self.replicated,
                        holder=self._replica_holder, keys=frozenset(state))
        self.last_reshard = None
        found = restore_job(self.coord, tiers, needs, state, step, rank=self.rank, world_size=self.world_size,
                            threads=self.restore_threads, peering=self.peering,
                            avoid=avoided(self._saves.canary.path) if step is None else None)
        if found is None:
            return None
        (plan, self.last_reshard), seconds = found, time.monotonic() - t0
        log_restored(plan, seconds, self.rank, self.world_size)
        if self.metrics is not None:
            self.metrics.restored(plan.shards[0].sources[0].name if plan.shards else "rank", seconds)
        # A shard from another node has one copy left: snapshot the restored state into memory now (before
        # training changes it) and replicate it at once. A resharded step is not this rank's saved shard.
        if self.peering is not None and self.peering.restored(plan) and self.last_reshard is None:
            self._saves.protect(*self._snapshot(plan.ckpt_id, state), plan.ckpt_id)
        self._lineage.resumed(plan.ckpt_id)
        self._saves.unsound = None
        self._saves.canary.restored(plan.ckpt_id, reference(self.tiers[1:], plan.ckpt_id, self.rank))
        mark("restore_done")
        return plan.ckpt_id.step

    def record(self, loss: float, grad_norm: float | None = None) -> str | None:
        """Once per step on every rank: its loss (and grad norm); the canary's reference for the
        last save, and after a restore its check: "passed", "no reference" or ``CanaryFailed``."""
        return self._saves.canary.record(loss, grad_norm)

    def list(self) -> list[dict]:
        """Every checkpoint: step, generation, time, size, the tiers holding it, and status."""
        from .restore.listing import merge_listing

        return merge_listing(self.tiers)

    def flush(self) -> None:
        """Every rank, at the same point (the end of training, preemption): finish every drain, upload
        the newest step if it was skipped for a pending upload, and wait until it is off-node. Then the
        newest committed step is in every tier (failures surface at the next ``save()``/``wait()``)."""
        self.wait_staged()
        self._saves.join()
        if self._offload is not None:
            source = self.disk or self.memory
            self._offload.flush(lambda ckpt_id: open_shard(source, ckpt_id, self.rank),
                                self.disk.name if self.disk is not None else None)

    def close(self) -> None:
        """``flush()``; with peers, send the last replica and wait until every rank has (no rank
        stops serving a replica still on its way); then release shared memory mappings. Once every
        save is durable (a suspect or unhealthy one raises ``UnsoundState``, the slots kept), this
        rank's slots (and its peer replicas) are removed, unless a restart is expected (a preemption;
        ``with manager`` left on an error) or ``keep_memory=True``. Idempotent."""
        self._close(together=True)

    def _close(self, together: bool) -> None:
        """``together``: every rank closes at this point (not one leaving on an error: no wait for the others)."""
        if self._closed:
            return
        self._closed = True
        remove = False
        try:
            self.flush()
            if self.peering is not None and together:
                self.peering.send_last()
                self.coord.barrier()  # no rank stops serving while another's last replica is on its way to it
            if together and not (self.keep_memory or self.restart_expected or sys.exc_info()[0]):
                self.wait()  # a failed drain raises here, and the slots stay
                self._saves.raise_unsound()  # a verdict after the last save: never end on wrong state
                remove = self.memory.pool.all_durable()  # not a step restored from memory and never saved
        finally:
            self._release(remove_memory=remove)
        if remove:
            sweep_finished(self._home, self._ns, self.peering.replicas.ns if self.peering is not None else None)

    def abandon(self) -> None:
        """Let go after a peer failed (``ckpt.inprocess``): background waits on other ranks
        end at once, nothing more is committed, queued drains are dropped (the one running
        ends first), this rank's memory is released (its sealed slots stay, for the next
        incarnation's restore). Unlike ``close()`` it never waits for a rank that is gone (a
        replica in flight is cut off), nor destroys its control group (off the critical path)."""
        if self._closed:
            return
        self._closed = True
        self.committer.abandon()
        self._release(abandoned=True)

    def _release(self, remove_memory: bool = False, abandoned: bool = False) -> None:
        self._saves.close(discard=abandoned)
        try:
            if self._offload is not None:
                self._offload.close()
        finally:
            if self.peering is not None:
                self.peering.close(abort=abandoned)
            self.memory.close(remove=remove_memory)
            if self.metrics is not None:
                self.metrics.close()
            if not abandoned:
                self.coord.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self._close(together=exc_type is None)  # leaving on an error: no wait for the other ranks
