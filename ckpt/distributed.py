"""Ranks under torch.distributed: who commits, and agreeing on one decision.

Control traffic runs on a dedicated gloo group, so it works beside NCCL and never
queues behind the training's own collectives. Everything here is called from the
training thread, at the same point on every rank; the background drain never
communicates: the coordinator learns that the other ranks' shards are durable by
seeing their shard manifests in the tier.
"""
from __future__ import annotations

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
