"""Sending sealed snapshots to their holders, on a thread of its own, never in the way
of training: ``submit`` returns at once, only the newest snapshot waits (an older
one not yet sent is superseded), the slot is not held (a save that reuses it while
it is being sent makes the receiver's checksums fail: that send is abandoned), and a
peer that is dead or slower than ``timeout_s`` costs one abandoned send, logged and
counted, never an error in training."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..restore import DAMAGE
from ..tiers.base import ShardReader
from . import wire

log = logging.getLogger(__name__)


@dataclass
class ReplicaJob:
    step: int
    open: Callable[[], ShardReader]  # the sealed slot; close() raises if it was overwritten meanwhile
    done: Callable[[bool], None]  # told whether every holder sealed it


class Replicator:
    """``count`` is told each outcome ("sent", "failed" per holder; "superseded"): metrics."""

    def __init__(self, holders: list[str], secret: bytes, *, bytes_per_s: float | None, timeout_s: float,
                 count: Callable[[str], None] = lambda outcome: None) -> None:
        self.holders, self._secret = holders, secret
        self.bytes_per_s, self.timeout_s = bytes_per_s, timeout_s
        self.sent = self.failed = self.superseded = 0  # counted per holder, per snapshot
        self._count = count
        self._pending: ReplicaJob | None = None
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ckpt-replicate", daemon=True)
        self._thread.start()

    def submit(self, job: ReplicaJob) -> None:
        with self._cond:
            if self._pending is not None:
                self.superseded += 1
                self._count("superseded")
                log.info("replica of step %d superseded by step %d before it was sent", self._pending.step, job.step)
                self._pending.done(False)
            self._pending = job
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            sealed = [self._send(job, addr) for addr in self.holders]  # every holder, even after a failure
            job.done(all(sealed))
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _send(self, job: ReplicaJob, addr: str) -> bool:
        t0 = time.monotonic()
        try:
            reader = job.open()
            try:
                with wire.connect(addr, self._secret, self.timeout_s) as sock:
                    wire.send_frame(sock, {"op": "put", "manifest": reader.manifest.to_bytes().decode()})
                    wire.send_paced(sock, reader.view(0, reader.manifest.data_bytes), bytes_per_s=self.bytes_per_s,
                                    deadline=t0 + self.timeout_s)
                    reply = wire.recv_frame(sock)
            finally:
                reader.close()
            if not reply.get("ok"):
                raise wire.PeerError(f"refused: {reply.get('error')}")
        except (wire.PeerError, *DAMAGE) as e:
            self.failed += 1
            self._count("failed")
            log.warning("replica of step %d to %s abandoned after %.1f s: %s", job.step, addr, time.monotonic() - t0, e)
            return False
        self.sent += 1
        self._count("sent")
        log.debug("replica of step %d sealed at %s in %.3f s", job.step, addr, time.monotonic() - t0)
        return True

    def join(self) -> None:
        """Wait until nothing is pending or being sent."""
        with self._cond:
            while self._pending is not None or self._busy:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
