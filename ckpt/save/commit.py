"""The commit protocol: a step becomes visible in a durable tier only once every rank's
shard of it is durable there (invariant 1), agreed through the job's key-value store,
never by reading another node's disk.

A *volume* is where a tier's bytes land (``DurableTier.volume``): one node's local
NVMe, a shared filesystem, an object-store prefix. Ranks that share one are grouped
at start-up, and the lowest rank of each group, its *leader*, commits for the group:
with local disks each node commits the shards it holds; on one machine, a shared
filesystem or an object store there is one commit, as before. For one step in one
tier::

    every rank r      store[<tier>/<id>/shard/<r>] = its ShardRef, its replica report (announce);
                      add 1 to <id>/announced
    each leader       wait until <id>/announced counts world_size (one key polled, not N)
                      read every rank's announcement (one multi_get: the verdict needs all)
                      tier.commit(id, Manifest(the refs of its volume's ranks, health=verdict))
                      retention on its volume
                      store[<tier>/<id>/commit/<leader>] = the verdict
    every rank        wait for its leader's commit key, then count itself done;
                      the last one deletes the step's keys (N shard keys, the leaders' keys)

So "committed" in any volume means durable in that tier on every rank, and retention,
which counts committed steps only, can never delete the last step that all ranks hold.
Alone (one process) the rank is its own leader and nothing is announced.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from datetime import timedelta
from typing import Callable, Mapping

from ..errors import CheckpointError
from ..format.health import classify, newest_verified
from ..format.manifest import Manifest, ShardRef
from ..tiers.base import CheckpointId, DurableTier
from .soundness import verdict

log = logging.getLogger(__name__)


def retention(keep_last: int | Mapping[str, int]) -> tuple[dict[str, int], int]:
    """``keep_last`` (one number, or per tier name) as (per tier name, default for tiers not
    named). Each is at least 1: the newest complete checkpoint is never deleted."""
    by_tier = dict(keep_last) if isinstance(keep_last, Mapping) else {}
    default = keep_last if isinstance(keep_last, int) else 3
    if min([default, *by_tier.values()]) < 1:
        raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
    return by_tier, default


class Committer:
    """Owns commit and retention for every durable tier of one rank.

    ``store``: returns the calling thread's client of the job's store (None when alone,
    see ``distributed.store_connector``). ``keep_last``: complete checkpoints kept per
    tier name, ``default_keep`` for tiers not named."""

    def __init__(self, rank: int, world_size: int, *, store: Callable[[], object] | None,
                 keep_last: Mapping[str, int], default_keep: int, timeout_s: float) -> None:
        if world_size > 1 and store is None:
            raise ValueError("a job of several ranks needs a store to commit through")
        self.rank, self.world_size = rank, world_size
        self._store, self._timeout = store, timedelta(seconds=timeout_s)
        self._keep, self._default_keep = dict(keep_last), default_keep
        self._volumes: dict[str, list[int]] = {}  # tier name -> the ranks sharing this rank's volume
        self._leaders: dict[str, list[int]] = {}  # tier name -> every volume's leader
        self._pins: dict[str, set[CheckpointId]] = defaultdict(set)
        self._lock = threading.Lock()
        self.abandoned = threading.Event()  # set: waits for other ranks end (the job goes on without them)
        # told (tier name, step) once a step is committed: the memory slots' owner record notes it
        self.on_commit: Callable[[str, CheckpointId], None] = lambda tier, ckpt_id: None

    def register(self, tier: DurableTier, volumes: list[str]) -> None:
        """``volumes``: every rank's ``tier.volume``, by rank (one all-gather at start-up)."""
        mine = volumes[self.rank]
        self._volumes[tier.name] = [r for r, v in enumerate(volumes) if v == mine]
        self._leaders[tier.name] = sorted({v: r for r, v in reversed(list(enumerate(volumes)))}.values())

    def leads(self, tier: DurableTier) -> bool:
        """Whether this rank commits (and prunes) ``tier`` for its volume."""
        return self._volumes[tier.name][0] == self.rank

    def volume_ranks(self, tier: DurableTier) -> list[int]:
        return list(self._volumes[tier.name])

    # -- retention pins -------------------------------------------------------------

    def pin(self, tier: str, ckpt_id: CheckpointId) -> None:
        """Keep ``ckpt_id`` in ``tier`` through retention (e.g. until its upload is done)."""
        with self._lock:
            self._pins[tier].add(ckpt_id)

    def unpin(self, tier: str, ckpt_id: CheckpointId) -> None:
        with self._lock:
            self._pins[tier].discard(ckpt_id)

    def apply_retention(self, tier: DurableTier) -> list[CheckpointId]:
        """Prune ``tier`` to its count, never deleting a pinned step nor the newest verified
        one (invariant 16: when the newer ones are suspect, it is the one to go back to)."""
        with self._lock:
            pinned = set(self._pins[tier.name])
        trusted = newest_verified(classify({i.id: i.health for i in tier.list() if i.complete}))
        return tier.prune(self._keep.get(tier.name, self._default_keep), pinned | ({trusted} if trusted else set()))

    # -- the protocol ---------------------------------------------------------------

    def commit(self, tier: DurableTier, ckpt_id: CheckpointId, ref: ShardRef, report: dict | None = None) -> dict:
        """This rank's shard of ``ckpt_id`` is durable in ``tier``: returns once the step is
        committed in this rank's volume (so: durable in ``tier`` on every rank). ``report``: this
        rank's replica digest (``soundness.py``), announced with the shard; returns the step's
        health, the verdict on every rank's report (the same on every rank)."""
        if self.world_size == 1:
            health = verdict({0: report})
            tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, 1, [ref], health=health))
            self.apply_retention(tier)
        else:
            health = self._commit_together(tier, ckpt_id, ref, report)
        self.on_commit(tier.name, ckpt_id)
        return health

    def _commit_together(self, tier: DurableTier, ckpt_id: CheckpointId, ref: ShardRef, report: dict | None) -> dict:
        store = self._store()
        key = f"{tier.name}/{ckpt_id.generation}.{ckpt_id.step}"
        ranks = self._volumes[tier.name]
        leader = ranks[0]
        store.set(f"{key}/shard/{self.rank}", json.dumps([ref.rank, ref.manifest_crc32c, ref.data_bytes, report]))
        store.add(f"{key}/announced", 1)  # one counter, not world_size keys, for every leader to poll
        if self.rank == leader:
            self._wait(store, lambda: store.add(f"{key}/announced", 0) >= self.world_size,
                       f"every rank's shard of step {ckpt_id.step} in {tier.name}")
            shards = store.multi_get([f"{key}/shard/{r}" for r in range(self.world_size)])
            announced = {r: json.loads(v) for r, v in enumerate(shards)}
            health = verdict({r: a[3] if len(a) > 3 else None for r, a in announced.items()})
            refs = [ShardRef(*announced[r][:3]) for r in ranks]
            tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size, refs, health=health))
            self.apply_retention(tier)
            store.set(f"{key}/commit/{leader}", json.dumps(health))
        else:
            self._wait(store, lambda: store.check([f"{key}/commit/{leader}"]),
                       f"rank {leader} to commit step {ckpt_id.step} in {tier.name}")
            health = json.loads(store.get(f"{key}/commit/{leader}"))
        if store.add(f"{key}/done", 1) == self.world_size:  # everyone has seen its commit: tidy the store
            for k in [*(f"{key}/shard/{r}" for r in range(self.world_size)), f"{key}/announced", f"{key}/done",
                      *(f"{key}/commit/{r}" for r in self._leaders[tier.name])]:
                store.delete_key(k)
        return health

    def _wait(self, store: object, ready: Callable[[], bool], what: str) -> None:
        """Poll (a few µs a check) rather than block in the store, so ``abandon()`` ends the
        wait at once when a peer is gone and the job continues without it (``ckpt.inprocess``)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.001
        try:
            while not ready():
                if self.abandoned.is_set():
                    raise CheckpointError(f"abandoned waiting for {what}: the job's membership changed")
                if time.monotonic() >= deadline:
                    raise CheckpointError(f"timed out after {self._timeout.total_seconds():.0f} s waiting for {what}")
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        except CheckpointError:
            raise
        except Exception as e:  # the store itself failed (DistStoreError / RuntimeError)
            raise CheckpointError(f"the store failed waiting for {what}: {e}") from e
