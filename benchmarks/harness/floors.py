"""The physical floors a figure is read against: copying the same bytes into warm memory (and
back), and writing them sequentially to disk with one fsync (and reading them back cold). A
save at 1.1x the memcpy floor has little left to gain; one at 10x has. torch is imported by the
caller: these take its tensors."""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from benchmarks.harness.timing import samples

if TYPE_CHECKING:
    import torch

PIECE = 16 << 20  # bytes per write/read call: large enough to be sequential
Stat = Callable[[list[float]], float]


def sync(tensors: list[torch.Tensor]) -> None:
    """Wait for the GPU when any tensor is on it (a copy's time is its completion's)."""
    if any(t.is_cuda for t in tensors):
        import torch
        torch.cuda.synchronize()


def drop_cache(path: Path) -> None:
    """Evict a file (or every file under a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memcpy_floor(tensors: list[torch.Tensor], repeats: int, stat: Stat = statistics.median
                 ) -> tuple[float, float, list[torch.Tensor]]:
    """Seconds to copy the tensors into warm host memory (pinned when they are on a GPU) and
    back: the snapshot floor and the restore-from-memory floor. Also returns the host copies."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    cuda = any(t.is_cuda for t in tensors)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    dst.fill_(0)  # fault it in: the floor is a copy into warm memory
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(dst[off:off + n].view(t.dtype).view(t.shape))
        off += n

    def out() -> None:
        for v, t in zip(views, tensors):
            v.copy_(t, non_blocking=cuda)
        sync(tensors)

    def back() -> None:
        for v, t in zip(views, tensors):
            t.copy_(v, non_blocking=cuda)
        sync(tensors)
    out()
    return stat(samples(out, repeats)), stat(samples(back, repeats)), views


def disk_floor(tensors: list[torch.Tensor], workdir: Path, repeats: int, stat: Stat = statistics.median
               ) -> tuple[float, float]:
    """Seconds of a sequential write + fsync, and of a sequential cold read, of the same bytes
    (host tensors) in one file under ``workdir``."""
    import torch

    path = workdir / "floor.bin"
    blobs = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for b in blobs:
            for i in range(0, len(b), PIECE):
                os.write(fd, b[i:i + PIECE])
        os.fsync(fd)
        os.close(fd)

    total = sum(len(b) for b in blobs)
    buf = torch.empty(total, dtype=torch.uint8)
    buf.fill_(0)
    view = memoryview(buf.numpy())

    def read() -> None:
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        off = 0
        while off < total:
            off += os.readv(fd, [view[off:off + PIECE]])
        os.close(fd)

    w, r = stat(samples(write, repeats)), stat(samples(read, repeats))
    path.unlink()
    return w, r
