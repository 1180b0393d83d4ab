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
from contextlib import suppress
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class Coordinator:
    """Rank, world size and the few collectives checkpointing needs; trivial when alone."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        # Its own gloo group with a bounded timeout: a dead peer fails a step-boundary
        # agreement (or the group's own set-up) in ``timeout_s`` instead of the default 30 min.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.active else None

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

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` (on the CPU) from rank ``src`` into every other rank's, in place."""
        if self.active:
            dist.broadcast(tensor, src, group=self._group)

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self._group)

    def close(self) -> None:
        """Destroy the control group: each one holds gloo threads and sockets, so a process
        that builds many managers (tests, in-process recovery) would otherwise accumulate them."""
        if self._group is not None:
            group, self._group = self._group, None
            if dist.is_initialized():
                dist.destroy_process_group(group)


def store_connector(namespace: str, timeout_s: float) -> Callable[[], "dist.Store"] | None:
    """A function returning this thread's client of the job's store, keys under ``namespace``
    (None when not distributed). Callers make ``namespace`` unique to one incarnation of
    the job, agreed by all ranks (torchrun's restart count is not: it differs between
    nodes after a membership change). Under torchrun and ``env://`` the store is the one
    at MASTER_ADDR:MASTER_PORT, reached on a connection of the calling thread's own;
    otherwise the default group's store is shared."""
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
            else:  # a connection of this thread's own where the store can make one (the commit blocks in it)
                base = dist.distributed_c10d._get_default_store()
                with suppress(RuntimeError, NotImplementedError):
                    base = base.clone()
            store = local.store = dist.PrefixStore(prefix, base)
        return store

    return connect
