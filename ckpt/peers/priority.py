"""Periodic replication yields the CPU to training: the threads that send and receive
periodic replicas run at a higher nice value (Linux keeps nice per thread), so where a
node's cores are all busy the trainer's threads run first, and where cores are idle
nothing changes. Urgent sends (evacuation) and restores keep normal priority. Raising
nice needs no privilege; lowering it again does, so only short-lived threads are
lowered, and the threads they start inherit it. ``CKPT_GUARD_PEER_NICE`` sets the value
(0: off)."""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
ENV = "CKPT_GUARD_PEER_NICE"
DEFAULT_NICE = 10
T = TypeVar("T")


def replication_nice() -> int:
    """The nice value for periodic replication threads: ``CKPT_GUARD_PEER_NICE``, else 10."""
    raw = os.environ.get(ENV, "").strip()
    try:
        return min(19, max(0, int(raw))) if raw else DEFAULT_NICE
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", ENV, raw, DEFAULT_NICE)
        return DEFAULT_NICE


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value to at least ``nice`` (never lowers it)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # a sandbox that forbids it: replication still works, at normal priority
        log.debug("cannot lower replication thread priority: %s", e)


def at_low_priority(fn: Callable[[], T], nice: int, name: str) -> T:
    """``fn()`` on a thread of its own with nice ``nice`` (the caller keeps its priority)."""
    if nice <= 0:
        return fn()
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        lower_this_thread(nice)
        try:
            out.append(fn())
        except BaseException as e:  # re-raised on the calling thread
            failed.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return out[0]
