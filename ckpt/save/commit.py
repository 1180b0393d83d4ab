"""The commit protocol: a step becomes visible in a durable tier only once every rank's
shard of it is durable there (invariant 1), agreed through the job's key-value store,
never by reading another node's disk.

A *volume* is where a tier's bytes land (``DurableTier.volume``): one node's local
NVMe, a shared filesystem, an object-store prefix. Ranks that share one are grouped
at start-up, and the lowest rank of each group, its *leader*, commits for the group:
with local disks each node commits the shards it holds; on one machine, a shared
filesystem or an object store there is one commit, as before. For one step in one
tier (``k`` = ``<tier>/<id>``)::

    every rank r      store[k/shard/<r>] = its ShardRef, its replica report (announce); add 1 to
                      k/announced; the rank whose add counts world_size sets k/all
    the first leader  wait for k/all, read every announcement (one multi_get): the job's verdict
                      on every rank's report; store[k/verdict/<l>] = it for every other leader l
                      (one multi_set)
    each leader       wait for k/verdict/<itself>; read its volume's announcements
                      tier.commit(id, Manifest(its volume's refs, health=verdict + its ranks' canary
                      references)); retention on its volume
                      store[k/commit/<r>] = the verdict for each other rank r of its volume (one multi_set)
    every rank        wait for k/commit/<r>, delete it and its own announcement (every reader has
                      read it), count itself done; the last one deletes k/announced, k/all and k/done

Every wait is one key that only the waiting rank waits on, in one blocking ``wait`` of the store
(server-side: one operation however long it takes, not a poll), so a rank costs O(1) store
operations a step whatever N is (7 for most ranks, 5 more for a leader; torch's store deletes
one key an operation, hence each rank deleting its own), and reads O(1) bytes: the verdict
without the canary's references, which only a commit record keeps, each volume's its own ranks'
(``canary.reference`` reads this rank's from the record it restores from). Only the first leader
reads every announcement (O(N) bytes, once). ``abandon()`` ends a wait at once by setting the
key it waits on (no one else waits on it).

A rank whose tier had no room for its shard announces ``{"full": why}`` instead: every leader
then commits nothing and puts the reasons (the verdict's) in its ranks' commit keys, and every
rank raises ``TierFull`` (a tier's failure: the job goes on with its other tiers; ``save_path.py``).

So "committed" in any volume means durable in that tier on every rank, and retention,
which counts committed steps only, can never delete the last step that all ranks hold.
Alone (one process) the rank is its own leader and nothing is announced.

With a job secret (``ckpt.secret``) the announcements, verdicts and wake-ups are signed values
(``ckpt.control``, under a key of their own): one that fails its check (an outsider on the
store forging a shard or a verdict) is ignored, counted in ``rejected`` and logged once, and the
wait goes on for the real one (looking at the keys again, 1 ms, 2 ms, ... up to 1 s apart: the
key is there, so a blocking wait would return at once). Without a secret they are plain, as
before. The ``announced`` and ``done`` counters (torch's ``add``, no MAC) only say when to look
and when to tidy: an outsider who moves one costs a wait (the first leader looks at every
announcement when its wait times out, and commits if all are there and genuine) or a read,
never a wrong commit.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from datetime import timedelta
from typing import Callable, Mapping

from .. import secret
from ..control import Control
from ..errors import NO_ROOM, Abandoned, CheckpointError, TierFull
from ..format.health import classify, newest_verified
from ..format.manifest import Manifest, ShardRef
from ..tiers.base import CheckpointId, DurableTier
from .soundness import verdict, with_canary

log = logging.getLogger(__name__)


def retention(keep_last: int | Mapping[str, int]) -> tuple[dict[str, int], int]:
    """``keep_last`` (one number, or per tier name) as (per tier name, default for tiers not
    named). Each is at least 1: the newest complete checkpoint is never deleted."""
    by_tier = dict(keep_last) if isinstance(keep_last, Mapping) else {}
    default = keep_last if isinstance(keep_last, int) else 3
    if min([default, *by_tier.values()]) < 1:
        raise ValueError("keep_last must be >= 1: the newest complete checkpoint is never deleted")
    return by_tier, default


def commit_key() -> bytes | None:
    """The key signing the commit protocol's values, from the job's secret; None without one."""
    job = secret.load()
    return None if job is None else secret.derive(job, "checkpoint commit")


class Committer:
    """Owns commit and retention for every durable tier of one rank.

    ``store``: returns the calling thread's client of the job's store (None when alone,
    see ``distributed.store_connector``). ``keep_last``: complete checkpoints kept per
    tier name, ``default_keep`` for tiers not named. ``key``: signs what is announced
    (``commit_key()``; None: unsigned)."""

    def __init__(self, rank: int, world_size: int, *, store: Callable[[], object] | None,
                 keep_last: Mapping[str, int], default_keep: int, timeout_s: float, key: bytes | None = None) -> None:
        if world_size > 1 and store is None:
            raise ValueError("a job of several ranks needs a store to commit through")
        self.rank, self.world_size, self._key = rank, world_size, key
        self.rejected = 0  # announcements and verdicts that failed their check (forged), ignored
        self._store, self._timeout = store, timedelta(seconds=timeout_s)
        self._keep, self._default_keep = dict(keep_last), default_keep
        self._volumes: dict[str, list[int]] = {}  # tier name -> the ranks sharing this rank's volume
        self._leaders: dict[str, list[int]] = {}  # tier name -> every volume's leader, the first one's verdict
        self._pins: dict[str, set[CheckpointId]] = defaultdict(set)
        self._lock = threading.Lock()
        self._waits: set[str] = set()  # the keys this rank's blocking waits wait on (``abandon`` sets them)
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

    def commit(self, tier: DurableTier, ckpt_id: CheckpointId, ref: ShardRef | TierFull,
               report: dict | None = None) -> dict:
        """This rank's shard of ``ckpt_id`` is durable in ``tier``: returns once the step is
        committed in this rank's volume (so: durable in ``tier`` on every rank). ``report``: this
        rank's replica digest (``soundness.py``), announced with the shard; returns the step's
        health, the verdict on every rank's report (the same on every rank). ``ref`` a TierFull:
        this rank could not write its shard; announced like a shard, so that no rank waits for
        it, and raised on every rank (nothing is committed)."""
        if self.world_size == 1:
            if isinstance(ref, TierFull):
                raise ref
            health = with_canary(verdict({0: report}), {0: report})
            try:
                tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, 1, [ref], health=health))
                self.apply_retention(tier)
            except OSError as e:
                if e.errno not in NO_ROOM:
                    raise
                raise TierFull(f"step {ckpt_id.step} not saved in {tier.name}: {e}") from e
        else:
            health = self._commit_together(tier, ckpt_id, ref, report)
        self.on_commit(tier.name, ckpt_id)
        return health

    def _commit_together(self, tier: DurableTier, ckpt_id: CheckpointId, ref: ShardRef | TierFull,
                         report: dict | None) -> dict:
        store = self._store()
        signed = Control(store, self._key, 0) if self._key is not None else None  # per step: nothing accumulates
        key = f"{tier.name}/{ckpt_id.generation}.{ckpt_id.step}"
        ranks, leaders = self._volumes[tier.name], self._leaders[tier.name]
        leader, step = ranks[0], f"step {ckpt_id.step} in {tier.name}"
        shard = {"full": str(ref)} if isinstance(ref, TierFull) else [ref.rank, ref.manifest_crc32c, ref.data_bytes,
                                                                        report]
        try:
            self._put(store, signed, [f"{key}/shard/{self.rank}"], json.dumps(shard))
            if store.add(f"{key}/announced", 1) == self.world_size:  # the last to announce wakes the first leader
                self._put(store, signed, [f"{key}/all"], "all")
            if self.rank == leaders[0]:
                announced = [json.loads(v) for v in self._wait(
                    store, signed, [f"{key}/shard/{r}" for r in range(self.world_size)],
                    f"every rank's shard of {step}", trigger=f"{key}/all")]
                full = [a["full"] for a in announced if isinstance(a, dict)]
                health = {"full": "; ".join(full)} if full else \
                    verdict({r: a[3] if len(a) > 3 else None for r, a in enumerate(announced)})
                self._put(store, signed, [f"{key}/verdict/{r}" for r in leaders[1:]], json.dumps(health))
                mine = [announced[r] for r in ranks]
            elif self.rank == leader:
                wake = f"{key}/verdict/{leader}"
                health = json.loads(self._wait(store, signed, [wake], f"rank {leaders[0]}'s verdict on {step}",
                                               trigger=wake)[0])
                store.delete_key(wake)
                mine = [json.loads(v) for v in self._wait(store, signed, [f"{key}/shard/{r}" for r in ranks],
                                                          f"the shards of {step}")]
            if self.rank == leader:
                health = self._commit_volume(tier, ckpt_id, health, ranks, mine)
                self._put(store, signed, [f"{key}/commit/{r}" for r in ranks[1:]], json.dumps(health))
            else:
                wake = f"{key}/commit/{self.rank}"
                health = json.loads(self._wait(store, signed, [wake], f"rank {leader} to commit {step}",
                                               trigger=wake)[0])
                store.delete_key(wake)
        finally:
            if signed is not None:
                with self._lock:
                    self.rejected += signed.rejected
        store.delete_key(f"{key}/shard/{self.rank}")  # read by the verdict and by its leader's commit, both done
        if store.add(f"{key}/done", 1) == self.world_size:  # everyone has seen its commit: tidy the store
            for k in (f"{key}/announced", f"{key}/all", f"{key}/done"):
                store.delete_key(k)
        if "full" in health:
            raise TierFull(f"step {ckpt_id.step} not saved in {tier.name}: {health['full']}")
        return health

    def _commit_volume(self, tier: DurableTier, ckpt_id: CheckpointId, health: dict, ranks: list[int],
                       announced: list) -> dict:
        """The leader's commit of its volume's shards (``announced``, those of ``ranks``) under the
        job's verdict, with these ranks' canary references; what its ranks' commit keys then say
        (the verdict; ``{"full": why}``: nothing committed)."""
        if "full" in health:
            return health
        recorded = with_canary(health, {r: a[3] if len(a) > 3 else None for r, a in zip(ranks, announced)})
        try:
            tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, self.world_size,
                                          [ShardRef(*a[:3]) for a in announced], health=recorded))
            self.apply_retention(tier)
        except OSError as e:  # no room for the commit itself: every rank of the volume hears it, none waits
            if e.errno not in NO_ROOM:
                raise
            return {"full": str(e)}
        return health

    @staticmethod
    def _put(store: object, signed: Control | None, keys: list[str], value: str) -> None:
        """``value`` under each of ``keys``: one operation (a ``multi_set`` for several)."""
        if len(keys) == 1:
            store.set(keys[0], value) if signed is None else signed.put(keys[0], value)
        elif keys:
            store.multi_set(keys, [value] * len(keys)) if signed is None else signed.put_many(keys, [value] * len(keys))

    def abandon(self) -> None:
        """Let go (the job goes on without some rank): every wait here ends at once, raising
        ``Abandoned``; a blocking one because its key is set (only this rank waits on it)."""
        self.abandoned.set()
        with self._lock:
            waits = sorted(self._waits)
        if waits and self._store is not None:
            try:
                self._store().multi_set(waits, [b"abandoned"] * len(waits))
            except Exception as e:  # noqa: BLE001 - the store is gone: so is the wait (it fails on its own)
                log.debug("waking the commit's waits: %s", e)

    def _wait(self, store: object, signed: Control | None, keys: list[str], what: str,
              trigger: str | None = None) -> list[bytes]:
        """The values of ``keys`` once all are there (and, signed, pass their check).
        ``trigger``: a key only this rank waits on, set once ``keys`` are all there (or by
        ``abandon()``): waited for first in one blocking ``wait`` of the store. Then, and when a
        value failed its check (the real one is yet to come), the keys are looked at 1 ms, 2 ms,
        ... up to 1 s apart until the timeout."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause, looked = 0.001, False
        try:
            while True:
                if self.abandoned.is_set():
                    raise Abandoned(f"abandoned waiting for {what}: the job's membership changed")
                left = deadline - time.monotonic()
                if left <= 0:
                    forged = f" ({signed.rejected} values failed their check: does every rank hold the same job " \
                             "secret?)" if signed is not None and signed.rejected else ""
                    raise CheckpointError(f"timed out after {self._timeout.total_seconds():.0f} s waiting for "
                                          f"{what}{forged}")
                if trigger is not None:  # once: a forged value there would end any later wait at once
                    woke = self._blocked(store, trigger, deadline)
                    if self.abandoned.is_set():
                        continue
                    there, trigger = (woke and keys == [trigger]) or store.check(keys), None  # timed out: a last look
                else:
                    if looked:
                        time.sleep(pause)
                        pause = min(2 * pause, 1.0)
                    there = store.check(keys)
                looked = True
                if there:
                    raw = store.multi_get(keys)
                    values = raw if signed is None else signed.opened(keys, raw)
                    if None not in values:
                        return values
        except CheckpointError:
            raise
        except Exception as e:  # the store itself failed (DistStoreError / RuntimeError)
            raise CheckpointError(f"the store failed waiting for {what}: {e}") from e

    def _blocked(self, store: object, key: str, deadline: float) -> bool:
        """Whether ``key`` was set by ``deadline`` (one blocking ``wait``)."""
        with self._lock:
            self._waits.add(key)
        try:
            if self.abandoned.is_set():  # abandon() looked at the waits before this one was among them
                return False
            store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception:
            if time.monotonic() < deadline - 0.1:  # not its timeout: the store failed
                raise
            return False
        finally:
            with self._lock:
                self._waits.discard(key)
        return True
