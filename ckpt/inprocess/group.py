"""Leaving a broken process group without waiting on it, and joining the next round's.

``destroy_process_group`` shuts every gloo group down, which joins its worker threads: with
a peer that is stopped rather than dead, that can block for the whole collective timeout.
So a survivor forgets the broken groups at once (torch's registry is cleared, the objects
are kept) and a daemon thread shuts them down; once it has, nothing of them is left
(``leaked()`` counts what is still held, for the no-accumulation check).

Leaving also closes this rank's side of the group's connections (``socket.shutdown`` on the
pair sockets the group opened), which is what "abort" can mean for gloo: a peer blocked in a
collective that waits on this rank then fails at once ("Connection closed by peer") instead of
waiting out the collective timeout. Gloo's own ``shutdown``/``abort`` and
``destroy_process_group`` leave the connections open (measured: the peer waited 20 s of 20).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

_held: list[object] = []  # broken groups whose shutdown has not returned yet
_held_lock = threading.Lock()
_pair_sockets: dict[int, str] = {}  # fd -> its /proc link ("socket:[inode]"): the current group's connections
_joined_round: int | None = None  # the membership round those connections belong to
_pairs_lock = threading.Lock()  # the beat thread interrupts while the training thread joins or leaves


def join(store: "dist.Store", round_id: int, rank: int, world_size: int, timeout_s: float,
         backend: str = "gloo", *, arrival_s: float | None = None, check: Callable[[], None] = lambda: None) -> None:
    """The default group of membership round ``round_id``, on keys of its own, once every
    member has arrived (``arrive``: ``arrival_s``, ``check``). ``nccl`` is left the same way
    (``leave`` shuts its communicators down on a daemon thread, which for NCCL aborts them:
    scripts/gpu_inprocess_nccl.py measures it on a GPU)."""
    prefix = dist.PrefixStore(f"ckpt-guard/inprocess/pg/{round_id}", store)
    arrive(prefix, round_id, rank, world_size, timeout_s if arrival_s is None else arrival_s, check)
    before = _sockets()
    dist.init_process_group(backend, store=prefix, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    global _joined_round
    with _pairs_lock:
        _pair_sockets.clear()
        _pair_sockets.update(_opened_since(before))
        _joined_round = round_id


def arrive(store: "dist.Store", round_id: int, rank: int, world_size: int, timeout_s: float,
           check: Callable[[], None]) -> None:
    """Wait until every member of the round has said it is here, before torch's rendezvous,
    whose store waits cannot be interrupted. A member still caught in an older round's set-up
    (a store wait on a peer that died there, up to a collective timeout) then arrives late
    instead of finding its peers gone; ``check`` raises once a newer round is out, which ends
    the wait at once. Polled, backing off from 5 to 50 ms (one ``check`` a tenth of a second)."""
    store.set(f"arrived/{rank}", b"1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    start = last_check = time.monotonic()
    pause = 0.005
    while not store.check(keys):
        now = time.monotonic()
        if now - last_check >= 0.1:
            check()
            last_check = now
        if now - start >= timeout_s:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            raise TimeoutError(f"round {round_id}: rank(s) {missing} did not join within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


@contextmanager
def holding(round_id: int) -> Iterator[None]:
    """Connections opened inside (the checkpoint manager's own gloo group, whose collectives
    at save time wait 120 s on a stopped peer) belong to round ``round_id``: ``interrupt`` and
    ``leave`` shut them down with the default group's."""
    before = _sockets()
    try:
        yield
    finally:
        with _pairs_lock:
            if _joined_round == round_id:
                _pair_sockets.update(_opened_since(before))


def interrupt(round_id: int) -> None:
    """From another thread, once a newer round is out: round ``round_id``'s group is broken, so
    shut down its connections now. A collective blocked on a peer that vanished (stopped, not
    dead: its sockets stay open, nothing fails) then fails at once instead of waiting out the
    collective timeout. A later round's group is left alone."""
    with _pairs_lock:
        if _joined_round == round_id:
            _close_connections()


def leave() -> None:
    """Forget every process group now; shut them down in the background."""
    with _pairs_lock:
        _close_connections()
    if not dist.is_initialized():
        return
    world = c10d._world
    groups = list(world.pg_names)
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    world.pg_coalesce_state.clear()
    world.group_count = 0
    c10d._update_default_pg(None)
    c10d._unregister_all_process_groups()
    with _held_lock:
        _held.extend(groups)
    threading.Thread(target=_shut_down, args=(groups,), name="ckpt-inprocess-reap", daemon=True).start()


def _sockets() -> dict[int, str]:
    links: dict[int, str] = {}
    if not os.path.isdir("/proc/self/fd"):  # not Linux: the peer waits out the collective timeout
        return links
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            links[int(name)] = link
    return links


def _opened_since(before: dict[int, str]) -> dict[int, str]:
    """The sockets open now that were not (an fd reused for another socket counts as new)."""
    return {fd: link for fd, link in _sockets().items() if before.get(fd) != link}


def _close_connections() -> None:
    """Shut down (not close: gloo still owns the fds) the connected sockets the current group
    opened. Its listener is left alone (gloo's accept loop aborts the process on an error), and
    so is anything on the store's port (a reconnect of another thread during the join); an fd
    whose link changed since the join was reused and is not ours."""
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    for fd, link in list(_pair_sockets.items()):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with conn:
            try:
                if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if store_port in (conn.getsockname()[1], conn.getpeername()[1]):
                    continue
                conn.shutdown(socket.SHUT_RDWR)
            except OSError as e:  # already reset by the peer: nothing to close
                log.debug("closing a pair socket: %s", e)
    _pair_sockets.clear()


def _shut_down(groups: list) -> None:
    for pg in groups:
        try:
            pg.shutdown()
        except Exception as e:  # a broken group may refuse: it is released all the same
            log.debug("shutting down a broken group: %s", e)
        with _held_lock:
            _held.remove(pg)


def leaked() -> int:
    """Broken groups still held (a shutdown blocked on a stopped peer)."""
    with _held_lock:
        return len(_held)
