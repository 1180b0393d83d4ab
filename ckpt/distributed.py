"""Ranks under torch.distributed: agreeing on one decision, and a side channel for the drain.

Control traffic on the training thread runs on a dedicated gloo group, so it works
beside NCCL and never queues behind the training's own collectives; it is called at
the same point on every rank. The background drain never joins a collective: it
talks through the job's key-value store (``store_connector``), one client connection
per thread, so a blocking wait there never holds up anyone else.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import CheckpointError


class Coordinator:
    """Rank, world size and the few collectives checkpointing needs; trivial when alone."""

    def __init__(self) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        # Its own gloo group with a bounded timeout: a dead peer fails a step-boundary
        # agreement in seconds instead of hanging the survivors until the default 30 min.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120)) if self.active else None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _reduce(self, values: list[int], op: "dist.ReduceOp") -> list[int]:
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self._group)
        return t.tolist()

    def any(self, *flags: bool) -> list[bool]:
        """Each flag, true on every rank if it is true on any (one all-reduce for all)."""
        return [bool(v) for v in self._reduce([int(f) for f in flags], dist.ReduceOp.MAX)]

    def all(self, flag: bool) -> bool:
        return bool(self._reduce([int(flag)], dist.ReduceOp.MIN)[0])

    def max(self, value: int) -> int:
        return self._reduce([value], dist.ReduceOp.MAX)[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, trusted: our own ranks, never checkpoint bytes)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self._group)


def store_connector(namespace: str, timeout_s: float) -> Callable[[], "dist.Store"] | None:
    """A function returning this thread's client of the job's store, keys under ``namespace``
    (None when not distributed). Under torchrun and ``env://`` the store is the rendezvous
    store at MASTER_ADDR:MASTER_PORT, reached on a connection of the calling thread's own;
    otherwise the default group's store is shared. ``namespace`` must be unique per start
    of the job (the manager's holds an id rank 0 draws then), not keyed by the restart
    count: the agent of a replacement node starts counting at 0 beside survivors at 1."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    prefix = f"ckpt-guard/{namespace}"
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    local = threading.local()

    def connect() -> "dist.Store":
        store = getattr(local, "store", None)
        if store is None:
            if host and port:
                base = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
            else:
                base = dist.distributed_c10d._get_default_store()
            store = local.store = dist.PrefixStore(prefix, base)
        return store

    return connect


def init_process_group(backend: str | None = None, timeout: timedelta = timedelta(minutes=10)) -> None:
    """``dist.init_process_group`` for torchrun workers that survives restarts.

    torchrun keeps one store across restart attempts; gloo then finds the previous
    attempt's (dead) peer addresses in it and the first restart fails to connect.
    Keying the group by a token rank 0 draws for the round (``worker_round``) gives
    every round a clean namespace.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from .worker_round import agree_round

    def connect() -> "dist.Store":
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                             timeout=timeout)

    store = connect()
    token, done = agree_round(connect, store, rank)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"ckpt-guard/round-{token}", store),
                                rank=rank, world_size=world, timeout=timeout)
    finally:
        done()


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
