"""The snapshot copy, the one thing the trainer waits for: where each tensor goes in
the slot (``plan_layout``) and the device-to-shared-memory copy (``TensorCopier``)."""
from __future__ import annotations

from typing import Sequence

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


class TensorCopier:
    """Device→shared-memory copy. CPU: torch's multi-threaded copy. CUDA: copies into the
    pinned slot run on a side stream, after the work already queued on the current one."""

    def __init__(self) -> None:
        self._stream = None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        for d, s in pairs:
            if not s.is_cuda:
                d.copy_(s)
        if cuda:
            self._copy_cuda(cuda)

    def _copy_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
        self._stream.synchronize()
