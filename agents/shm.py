"""Shared memory left behind by checkpoint jobs that are gone.

ckpt-guard's memory tier keeps each job's slots in ``/dev/shm/ckpt-guard-<uid>-<hash>/
rank-N/`` (they are meant to survive the trainer); while a rank lives it holds an
flock on ``rank-N/lock``. A namespace none of whose locks is held belongs to a job that
is gone: its bytes stay in RAM until someone runs ``ckpt gc --orphans`` as that user.
The agent reports them so an operator sees a node filling up.

Locks are read from /proc/locks, never taken: probing them with flock would make a job
that starts at that moment refuse its own slots.
"""
from __future__ import annotations

import os
from pathlib import Path

NAMESPACE_GLOB = "ckpt-guard-*"


def held_locks(proc_locks: str = "/proc/locks") -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every file lock held on this machine."""
    held = set()
    try:
        lines = Path(proc_locks).read_text().splitlines()
    except OSError:
        return held
    for line in lines:
        fields = line.split()
        dev = next((f for f in fields if f.count(":") == 2), None)
        if dev is None:
            continue
        major, minor, inode = dev.split(":")
        try:
            held.add((int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return held


def _lock_id(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        total += st.st_blocks * 512 if p.is_file() and not p.is_symlink() else 0
    return total


def orphaned(shm_dir: str = "/dev/shm") -> tuple[int, int]:
    """(namespaces, bytes) of checkpoint shared memory whose job is gone, any user's."""
    held = held_locks()
    count = size = 0
    for ns in Path(shm_dir).glob(NAMESPACE_GLOB):
        if not ns.is_dir() or ns.is_symlink():
            continue
        locks = [_lock_id(lock) for lock in ns.glob("rank-*/lock")]
        if any(lock in held for lock in locks if lock is not None):
            continue
        count += 1
        size += _bytes(ns)
    return count, size
