"""The snapshot copy: where each tensor goes in the slot (``plan_layout``), the
device-to-shared-memory copy the trainer waits for (``TensorCopier.copy``), and the
one it does not (``TensorCopier.start``: overlapped with the next step's compute)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ...format.manifest import DTYPE_NAMES, TensorEntry

ALIGN = 64


def plan_layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    """Offsets for each tensor in the shard's data file, aligned for any dtype view."""
    entries, offset = [], 0
    for i, (path, t) in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(i, path, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination in the slot, source)


class PendingCopy:
    """A copy running behind the trainer's back: ``wait()`` returns once every byte is in
    the slot (and raises what the copy raised)."""

    def __init__(self, future: "Future[None] | None", event: "torch.cuda.Event | None") -> None:
        self._future, self._event = future, event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if self._future is not None:
            self._future.result()


class TensorCopier:
    """Device→shared-memory copy. CPU: torch's multi-threaded copy, or one thread of its
    own copying in the background (memcpy releases the GIL). CUDA: copies into the pinned
    slot run on a side stream, after the work already queued on the current one."""

    def __init__(self) -> None:
        self._stream = None
        self._worker: ThreadPoolExecutor | None = None  # started on first use, kept (a thread start is not free)

    def copy(self, pairs: Pairs) -> None:
        """Copy now; returns when every byte is in the slot."""
        self.start([], pairs).wait()

    def start(self, later: Pairs, now: Pairs = ()) -> PendingCopy:
        """Copy ``now`` before returning (as far as the work queued after it can tell: on
        CUDA the current stream waits for it on the device), and start copying ``later``."""
        for d, s in now:
            if not s.is_cuda:
                d.copy_(s)
        cuda_now = [(d, s) for d, s in now if s.is_cuda]
        cuda_later = [(d, s) for d, s in later if s.is_cuda]
        event = self._start_cuda(cuda_now, cuda_later) if cuda_now or cuda_later else None
        cpu_later = [(d, s) for d, s in later if not s.is_cuda]
        if not cpu_later:
            return PendingCopy(None, event)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage")
        return PendingCopy(self._worker.submit(_memcpy_all, cpu_later), event)

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


def _memcpy_all(pairs: Pairs) -> None:
    for d, s in pairs:
        _memcpy(d, s)


def _memcpy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """One thread's copy (numpy's releases the GIL and, unlike torch's, uses no thread pool
    that would compete with the training step's); torch's for strided sources."""
    if src.is_contiguous() and src.numel():
        out = dest.reshape(-1).view(torch.uint8).numpy()
        np.copyto(out, src.reshape(-1).view(torch.uint8).numpy())
    else:
        dest.copy_(src)
