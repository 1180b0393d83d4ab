"""Who holds the shared memory on this node, and whether it may go: decided from /dev/shm alone.

Each rank directory's ``owner.json`` says whose slots these are (pid, host, run, root, the
job's object store) and, as the job's saves become durable, the newest step committed in
each durable tier: ``"durable": {"disk": [generation, step], "object": [...]}`` (written by
the owner as each commit completes: ``SlotPool.record_durable``). The slots' seals say what
the directory holds. So anyone on the node (the next job, ``ckpt gc --orphans``, the node
agent, whatever root it was given) decides without the job's roots or its object store:

* live: some rank's lock is held (read from /proc/locks: looking never takes a lock);
* durable: each rank's newest sealed step is at or below a durable step of its record
  (a peer replica's only counts the object store: its disk copy is on the node it covers;
  a disk step counts while its commit is still there, where the root is visible);
* reclaimable: no rank lives and every rank is durable (or holds nothing sealed).

A dead namespace holding a step durable nowhere else may be the only copy: it is kept
``grace_s()`` (24 h, or CKPT_GUARD_SHM_GRACE_S seconds) after its owner last wrote there, for a
restart to restore; after that it is *stale*: reported (``ckpt ls --memory``, the agent's
/metrics and the alert CheckpointSharedMemoryStale, a warning from each sweep), and deleted
only by ``ckpt gc --orphans --force``. A live lock is never touched.

Torch-free: the node agent imports it.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...errors import CheckpointError
from ...format.manifest import MANIFEST_FILE
from ..base import CheckpointId
from .namespace import is_trusted, owner_gone, rank_dirs, read_owner, remove_if_unheld, seals

GRACE_ENV = "CKPT_GUARD_SHM_GRACE_S"
DEFAULT_GRACE_S = 24 * 3600.0
NAMESPACE_GLOB = "ckpt-guard-*"
_NAME = re.compile(r"ckpt-guard-(\d+)-[0-9a-f]{16}(-\d+)?")


def grace_s() -> float:
    """How long a dead owner's steps held nowhere else are kept quietly (CKPT_GUARD_SHM_GRACE_S)."""
    raw = os.environ.get(GRACE_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_GRACE_S
    except ValueError:
        raise CheckpointError(f"{GRACE_ENV}={raw!r} is not a number of seconds") from None


def held_locks(proc_locks: str = "/proc/locks") -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file lock held on this machine; None when unreadable."""
    try:
        lines = Path(proc_locks).read_text().splitlines()
    except OSError:
        return None
    held = set()
    for line in lines:
        dev = next((f for f in line.split() if f.count(":") == 2), None)
        if dev is None:
            continue
        major, minor, inode = dev.split(":")
        with contextlib.suppress(ValueError):
            held.add((int(major, 16), int(minor, 16), int(inode)))
    return held


@dataclass
class RankHolding:
    """One rank directory as found."""

    path: Path
    owner: dict[str, Any]
    live: bool | None  # its lock is held (None: no lock to tell: counted as live)
    newest: CheckpointId | None  # the newest sealed step
    durable_ids: list[CheckpointId]  # steps committed in a tier that counts for it
    last_write: float
    bytes: int

    @property
    def durable(self) -> bool:
        """``newest`` is durable elsewhere (or nothing is sealed)."""
        return self.newest is None or any(self.newest <= d for d in self.durable_ids)

    @property
    def job(self) -> tuple[str | None, str | None]:
        """(root, run) as recorded (a value of another type, from a damaged record: None)."""
        root, run = self.owner.get("root"), self.owner.get("run")
        return root if isinstance(root, str) else None, run if isinstance(run, str) else None


@dataclass
class Holding:
    """One namespace: a job's (or its peer replicas') shared memory on this node."""

    path: Path
    uid: int
    ranks: list[RankHolding] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def live(self) -> bool:
        return any(r.live is not False for r in self.ranks)

    @property
    def durable(self) -> bool:
        return all(r.durable for r in self.ranks)

    @property
    def idle_s(self) -> float:
        """Seconds since its owner last wrote anything here."""
        return max(0.0, time.time() - max((r.last_write for r in self.ranks), default=0.0))

    def state(self, grace: float) -> str:
        """live | reclaimable (dead, durable elsewhere) | grace (dead, the only copy, kept) | stale (past grace)."""
        if self.live:
            return "live"
        if self.durable:
            return "reclaimable"
        return "grace" if self.idle_s < grace else "stale"

    def owner(self) -> dict[str, Any]:
        """The first rank's record (every rank of a namespace records the same job)."""
        return next((r.owner for r in self.ranks if r.owner), {})

    def describe(self, grace: float) -> dict[str, Any]:
        """What ``ckpt ls --memory --json`` and the agent's metrics say of it."""
        o = self.owner()  # untrusted (its user wrote it): only values of the expected types are shown
        pid, (host, run, root) = o.get("pid"), (o.get(k) if isinstance(o.get(k), str) else None
                                                for k in ("host", "run", "root"))
        newest = max((r.newest for r in self.ranks if r.newest is not None), default=None)
        return {"namespace": str(self.path), "bytes": self.bytes, "user": _user(self.uid), "uid": self.uid,
                "pid": pid if type(pid) is int else None, "host": host, "run": run, "root": root,
                "replicas": "replica_of" in o, "ranks": len(self.ranks), "owner_alive": self.live,
                "newest_step": None if newest is None else newest.step,
                "durable_elsewhere": self.durable, "idle_s": round(self.idle_s, 1), "state": self.state(grace)}


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def committed_ids(owner: dict[str, Any], only: str | None = None) -> list[CheckpointId]:
    """The steps the record says are committed, in ``only`` that tier (a replica's: the object
    store). A disk step whose root is visible here counts only while its commit is still there
    (deleted since, the slots may be its only copy)."""
    rec, root = owner.get("durable"), owner.get("root")
    if not isinstance(rec, dict):
        return []
    only = "object" if only is None and "replica_of" in owner else only
    local = Path(root) if isinstance(root, str) and os.path.isabs(root) and os.path.isdir(root) else None
    ids = [(tier, CheckpointId(*v)) for tier, v in rec.items() if (only is None or tier == only)
           and isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)]
    return [c for tier, c in ids if tier != "disk" or local is None or (local / c.name / MANIFEST_FILE).exists()]


def _lock_id(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _live(lock: Path, locks: set[tuple[int, int, int]] | None) -> bool | None:
    lock_id = _lock_id(lock)
    if lock_id is None:
        return None
    if locks is not None:
        return lock_id in locks
    with owner_gone(lock.parent) as gone:  # no /proc/locks: probe (a starting owner waits for it: SlotPool)
        return not gone


def inspect_rank(rdir: Path, uid: int, locks: set[tuple[int, int, int]] | None) -> RankHolding:
    owner = read_owner(rdir, uid) or {}
    newest = max((CheckpointId(m.generation, m.step) for m in seals(rdir, uid)), default=None)
    last, size = 0.0, 0
    for p in rdir.iterdir():
        with contextlib.suppress(OSError):
            st = p.lstat()
            last = max(last, st.st_mtime)
            size += st.st_blocks * 512 if p.is_file() and not p.is_symlink() else 0
    return RankHolding(rdir, owner, _live(rdir / "lock", locks), newest, committed_ids(owner), last, size)


def survey(shm_dir: str, *, uid: int | None = None) -> list[Holding]:
    """Every namespace under ``shm_dir`` this process may read (of ``uid`` only, when given).
    A namespace counts only if it is private to the uid its name carries (a planted one is skipped)."""
    base = Path(shm_dir)
    if not base.is_dir():
        return []
    locks = held_locks()
    found: list[Holding] = []
    for ns in sorted(base.glob(NAMESPACE_GLOB)):
        m = _NAME.fullmatch(ns.name)
        if m is None or (uid is not None and int(m.group(1)) != uid):
            continue
        owner_uid = int(m.group(1))
        if not is_trusted(ns, directory=True, uid=owner_uid):
            continue
        with contextlib.suppress(OSError):  # not readable by this process, or its owner removed it meanwhile
            os.listdir(ns)
            found.append(Holding(ns, owner_uid, [inspect_rank(d, owner_uid, locks) for d in rank_dirs(ns, owner_uid)]))
    # A peer replica's step is durable once its job committed it to the object store, which the
    # job's own ranks on this node record (the replica pools' owner is another process's code).
    uploaded: dict[tuple[str | None, str | None], list[CheckpointId]] = {}
    for r in (r for h in found for r in h.ranks if "replica_of" not in r.owner):
        uploaded.setdefault(r.job, []).extend(committed_ids(r.owner, "object"))
    for r in (r for h in found for r in h.ranks if "replica_of" in r.owner):
        r.durable_ids += uploaded.get(r.job, [])
    return found


def remove_holding(h: Holding, *, force: bool = False) -> bool:
    """Remove a dead namespace, rank by rank under its lock, re-checked under it (a job that
    took a lock meanwhile keeps everything); ``force``: durable or not. Returns whether it is gone."""
    for rank in h.ranks:
        with owner_gone(rank.path) as gone:
            if not gone:
                return False  # taken meanwhile (a restart), or no lock to take
            again = inspect_rank(rank.path, h.uid, set())
            again.durable_ids += rank.durable_ids
            if not force and not again.durable:
                return False
            shutil.rmtree(rank.path, ignore_errors=True)
    return remove_if_unheld(h.path)


def reclaim(shm_dir: str, *, uid: int | None = None, grace: float | None = None,
            keep: Callable[[Holding], bool] = lambda h: False) -> tuple[list[Holding], list[Holding]]:
    """Remove every dead, durable namespace of ``uid`` (default: this user) but those ``keep``
    names. Returns (removed, stale: past the grace time, kept)."""
    grace = grace_s() if grace is None else grace
    uid = os.getuid() if uid is None else uid
    removed, stale = [], []
    for h in survey(shm_dir, uid=uid):
        if keep(h):
            continue
        state = h.state(grace)
        if state == "reclaimable" and remove_holding(h):
            removed.append(h)
        elif state == "stale":
            stale.append(h)
    return removed, stale


def left_behind(shm_dir: str, *, under: Path | None = None, pid: int | None = None) -> set[Path]:
    """The namespaces whose owner record names a root ``under`` that directory, or ``pid``: what
    a test or a benchmark (its tmp root, its process) left, told apart from a neighbour's."""
    found = set()
    below = str(under.resolve()) + os.sep if under is not None else None
    for owner in Path(shm_dir).glob(f"{NAMESPACE_GLOB}/rank-*/owner.json"):
        record = read_owner(owner.parent) or {}
        root = str(record.get("root"))
        if (pid is not None and record.get("pid") == pid) or (below is not None and (root + os.sep).startswith(below)):
            found.add(owner.parent.parent)
    return found


__all__ = ["DEFAULT_GRACE_S", "GRACE_ENV", "Holding", "grace_s", "held_locks", "left_behind", "reclaim",
           "remove_holding", "survey"]
