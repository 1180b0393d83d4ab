"""The snapshot copy: where each tensor goes in the slot (``plan_layout``), the
device-to-shared-memory copy the trainer waits for (``TensorCopier.copy``), and the
one it does not (``TensorCopier.start``: overlapped with the next step's compute)."""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from ...format.manifest import DTYPE_NAMES, TensorEntry

ALIGN = 64
T = TypeVar("T")


def plan_layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    """Offsets for each tensor in the shard's data file, aligned for any dtype view."""
    entries, offset = [], 0
    for i, (path, t) in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(i, path, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination in the slot, source)


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """A copy's pairs split by where they run (``TensorCopier.run``); never changed once made, so a
    slot keeps it while its layout, its tensors and which of them are deferred stay the same
    (``SlotPool.start_snapshot``): splitting 72 pairs read each source's device three times a save."""

    now: bool  # anything to copy before returning
    cpu_now: Pairs
    cuda_now: Pairs
    cpu_later: Pairs
    cuda_later: Pairs

    @classmethod
    def of(cls, later: Pairs, now: Pairs = ()) -> CopyPlan:
        return cls(bool(now), [(d, s) for d, s in now if not s.is_cuda], [(d, s) for d, s in now if s.is_cuda],
                   [(d, s) for d, s in later if not s.is_cuda], [(d, s) for d, s in later if s.is_cuda])


PIECE_BYTES = 8 << 20  # what the waiter can take over from the worker


class _Pieces:
    """A CPU copy cut into pieces: the worker copies them in order; a waiter takes the
    ones not started yet, so waiting is never slower than copying (a busy machine may
    not have run the worker at all). A pair is cut (byte views; pieces of ``PIECE_BYTES``)
    by whoever takes it, not by the trainer that hands it over: a reshape and a view of
    each side were a third of ``save()``. ``first`` (unsealing the slot) runs once, before
    any piece is taken; if it fails, nothing is copied."""

    def __init__(self, pairs: Pairs, first: Callable[[], None] | None = None) -> None:
        self._pieces: Pairs = pairs  # the caller's own list: cut pieces take their pair's place
        self._first = first
        self._next, self._lock = 0, threading.Lock()

    def _take(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """The next piece: (destination, source, whether both are contiguous CPU bytes)."""
        with self._lock:
            if self._first is not None:
                first, self._first = self._first, None
                try:
                    first()
                except BaseException:
                    self._next = len(self._pieces)  # the slot may still be sealed: no byte of it may change
                    raise
            if self._next == len(self._pieces):
                return None
            d, s = self._pieces[self._next]
            self._next += 1
            # (``is_cpu``, not ``device.type``: a torch.device is made anew at each read, 30x slower)
            if not (s.is_cpu and s.is_contiguous()):
                return d, s, False
            db, sb = d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)
            if sb.numel() <= PIECE_BYTES:
                return db, sb, True
            cut = [(db[lo : lo + PIECE_BYTES], sb[lo : lo + PIECE_BYTES]) for lo in range(0, sb.numel(), PIECE_BYTES)]
            self._pieces[self._next - 1 : self._next] = cut
            return (*cut[0], True)

    def work(self) -> None:
        """The worker: one thread's memcpy (numpy's releases the GIL and, unlike torch's,
        starts no thread pool to compete with the training step's)."""
        while (piece := self._take()) is not None:
            d, s, raw = piece
            if raw:
                np.copyto(d.numpy(), s.numpy())
            else:
                d.copy_(s)

    def help(self) -> None:
        """The waiter (the training thread, its step's compute done): torch's threaded copy."""
        while (piece := self._take()) is not None:
            piece[0].copy_(piece[1])


class _Job:
    """The copy thread's job: a copy's pieces, then what ``TensorCopier.then`` handed over before they
    ended (the seal's bytes: one thread submission a save, not two)."""

    def __init__(self, pieces: _Pieces) -> None:
        self.pieces, self.after, self.open, self.lock = pieces, [], True, threading.Lock()

    def __call__(self) -> None:
        try:
            self.pieces.work()
        finally:
            with self.lock:
                self.open = False
            for future, fn in self.after:
                if future.set_running_or_notify_cancel():  # as the pool runs a job (unless cancelled)
                    try:
                        result = fn()
                    except BaseException as e:  # noqa: BLE001 - raised to whoever waits for it
                        future.set_exception(e)
                    else:
                        future.set_result(result)

    def add(self, fn: Callable[[], T]) -> "Future[T] | None":
        """``fn``'s future, run once the pieces are copied; None once this job has ended."""
        with self.lock:
            if not self.open:
                return None
            future: Future[T] = Future()
            self.after.append((future, fn))
            return future


class PendingCopy:
    """A copy running behind the trainer's back: ``wait()`` returns once every byte is in
    the slot (and raises what the copy raised)."""

    def __init__(self, pieces: _Pieces | None, future: "Future[None] | None",
                 event: "torch.cuda.Event | None") -> None:
        self._pieces, self._future, self._event = pieces, future, event

    def done(self) -> bool:
        """Whether every byte is in the slot (or the copy failed), without waiting. Only
        ``wait()`` helps the worker, so a finished worker means a finished copy."""
        return ((self._event is None or self._event.query())
                and (self._future is None or self._future.done()))

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if self._pieces is not None:
            self._pieces.help()
        if self._future is not None:
            self._future.result()


class TensorCopier:
    """Device→shared-memory copy. CPU: torch's multi-threaded copy, or one thread of its
    own copying in the background (memcpy releases the GIL). CUDA: copies into the pinned
    slot run on a side stream, after the work already queued on the current one."""

    def __init__(self) -> None:
        self._stream = None
        self._worker: ThreadPoolExecutor | None = None  # started on first use, kept (a thread start is not free)
        self._last: _Job | None = None  # the last copy handed to the worker

    def copy(self, pairs: Pairs) -> None:
        """Copy now; returns when every byte is in the slot."""
        self.start([], pairs).wait()

    def start(self, later: Pairs, now: Pairs = (), first: Callable[[], None] | None = None) -> PendingCopy:
        """Copy ``now`` before returning (as far as the work queued after it can tell: on
        CUDA the current stream waits for it on the device), and start copying ``later``.
        ``first`` (unsealing the slot) runs before any byte is copied: on the copy thread
        when every byte is copied there, else before anything is."""
        return self.run(CopyPlan.of(later, now), first)

    def run(self, plan: CopyPlan, first: Callable[[], None] | None = None) -> PendingCopy:
        """``start`` with its pairs already split by device (a plan kept while the slot, layout and tensors are)."""
        if first is not None and (plan.now or not plan.cpu_later or plan.cuda_later):
            first()
            first = None
        for d, s in plan.cpu_now:
            d.copy_(s)
        event = self._start_cuda(plan.cuda_now, plan.cuda_later) if plan.cuda_now or plan.cuda_later else None
        if not plan.cpu_later:
            return PendingCopy(None, None, event)
        pieces = _Pieces(list(plan.cpu_later), first)  # its own list: it cuts pieces in place
        self._last = job = _Job(pieces)
        return PendingCopy(pieces, self._thread().submit(job), event)

    def then(self, fn: Callable[[], T]) -> "Future[T]":
        """Run ``fn`` on the copy thread once what it was given before is done (the seal's
        bytes: serialising a manifest is no work for the trainer's thread): in the last copy's
        job while it runs (it is the last thing handed over), else as a job of its own."""
        job = self._last
        return (job is not None and job.add(fn)) or self._thread().submit(fn)

    def _thread(self) -> ThreadPoolExecutor:
        """The copy thread (one: copies and what follows them run in the order given), made at first use."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage")
        return self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _start_cuda(self, now: Pairs, later: Pairs) -> "torch.cuda.Event":
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)  # after the step that produced the state
        with torch.cuda.stream(self._stream):
            for d, s in now:
                d.copy_(s, non_blocking=True)
            current.wait_event(self._stream.record_event())  # the next forward waits for these, the host does not
            for d, s in later:
                d.copy_(s, non_blocking=True)
            return self._stream.record_event()
