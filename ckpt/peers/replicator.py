"""Sending sealed snapshots to their holders, on a thread of its own, never in the way
of training: ``submit`` returns at once, only the newest snapshot waits (an older
one not yet sent is superseded), the slot is not held (a save that reuses it while
it is being sent makes the receiver's checksums fail: that send is abandoned), and a
peer that is dead or slower than ``timeout_s`` costs one abandoned send, logged and
counted, never an error in training.

An urgent snapshot (the predictor expects this node to fail: evacuation) goes ahead
of everything: a periodic send in flight is cut off (its connection shut down; the
holder keeps its newest sealed replica), and the urgent one is sent unpaced, ignoring
the bandwidth cap. Periodic sends run on a thread with nice ``nice`` (``priority``), so
on busy cores training runs first; urgent ones at normal priority."""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from ..restore.execute import DAMAGE
from ..tiers.base import ShardReader
from . import wire
from .priority import at_low_priority

log = logging.getLogger(__name__)


@dataclass
class ReplicaJob:
    step: int
    open: Callable[[], ShardReader]  # the sealed slot; close() raises if it was overwritten meanwhile
    done: Callable[[bool], None]  # told whether every holder sealed it
    urgent: bool = False  # evacuation: jumps the queue, cuts off a periodic send, ignores the cap
    to: list[str] | None = None  # these holders only (default: all)
    cut: threading.Event = field(default_factory=threading.Event)  # set when an urgent job cuts this one off


class Replicator:
    """``count`` is told each outcome ("sent", "failed" per holder; "superseded"): metrics."""

    def __init__(self, holders: list[str], secret: bytes, *, bytes_per_s: float | None, timeout_s: float,
                 count: Callable[[str], None] = lambda outcome: None, nice: int = 0, node: str | None = None) -> None:
        self.holders, self._secret, self.nice = holders, secret, nice
        self.node = node  # this rank's node, told to holders: they keep a step common to its ranks
        self.bytes_per_s, self.timeout_s = bytes_per_s, timeout_s
        self.sent = self.failed = self.superseded = 0  # counted per holder, per snapshot
        self._count = count
        self._pending: ReplicaJob | None = None
        self._cond = threading.Condition()
        self._busy: ReplicaJob | None = None  # the job being sent
        self._sock: socket.socket | None = None  # its connection, shut down to cut the send off
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
            if job.urgent and self._busy is not None and not self._busy.urgent and not self._busy.cut.is_set():
                self._busy.cut.set()
                log.info("replica of step %d cut off for the urgent step %d", self._busy.step, job.step)
                if self._sock is not None:
                    _shut(self._sock)
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, self._pending
            sealed = at_low_priority(partial(self._send_all, job), 0 if job.urgent else self.nice,
                                     "ckpt-replicate-periodic")
            with self._cond:
                self._busy = None
                self._cond.notify_all()
            cut = job.cut.is_set()
            if cut:
                self.superseded += 1
                self._count("superseded")
            job.done(all(sealed) and not cut)

    def _send_all(self, job: ReplicaJob) -> list[bool]:
        sealed = []
        for addr in job.to if job.to is not None else self.holders:
            if job.cut.is_set():
                break
            sealed.append(self._send(job, addr))  # every holder, even after a failure
        return sealed

    def _send(self, job: ReplicaJob, addr: str) -> bool:
        t0 = time.monotonic()
        try:
            reader = job.open()
            try:
                deadline = t0 + self.timeout_s
                with wire.connect(addr, self._secret, self.timeout_s) as session:
                    with self._cond:
                        self._sock = session.sock
                        if job.cut.is_set():  # cut off while connecting
                            _shut(session.sock)
                    try:
                        session.send_frame({"op": "put", "manifest": reader.manifest.to_bytes().decode(),
                                            "node": self.node}, deadline=deadline)
                        session.send_data(reader.view(0, reader.manifest.data_bytes),
                                          bytes_per_s=None if job.urgent else self.bytes_per_s,
                                          deadline=deadline, stop=job.cut)
                        reply = session.recv_frame(deadline=deadline)
                    finally:
                        with self._cond:
                            self._sock = None
            finally:
                reader.close()
            if not reply.get("ok"):
                raise wire.PeerError(f"refused: {str(reply.get('error'))[:500]}")
        except (wire.PeerError, *DAMAGE) as e:
            if job.cut.is_set():
                return False  # counted once, as superseded, by the loop
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
            while self._pending is not None or self._busy is not None:
                self._cond.wait()

    def close(self) -> None:
        """Stop once the send in flight and the pending one are done: each holder's send,
        handshake included, ends by ``timeout_s`` whatever the holder does."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def abort(self) -> None:
        """Stop now, waiting on no holder (a rank failed and this one goes on in process): the
        pending replica is dropped and the one in flight cut off. A send past its handshake
        fails at its next write, and is waited for: it reads the slot. One still connecting
        is not: once connected it sees the cut before it reads anything, so a holder that
        vanished (stopped, its socket open) cannot hold this up."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, None
            if self._busy is not None:
                self._busy.cut.set()
                if self._sock is not None:
                    _shut(self._sock)
            reading = self._sock is not None
            self._cond.notify_all()
        if pending is not None:
            pending.done(False)
        if reading:
            self._thread.join()


def _shut(sock: socket.socket) -> None:
    """End a send from another thread: the sender's next write fails at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
