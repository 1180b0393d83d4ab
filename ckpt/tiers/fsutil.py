"""Durable local-file primitives: fsync'd atomic writes and directory syncs.

A rename is atomic but not durable until the directory itself is fsynced; these
helpers do both so that a power cut leaves either the old state or the new one.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, *, durable: bool = True, mode: int = 0o644) -> Iterator[int]:
    """A file descriptor to fill; on success it is fsynced and renamed over ``path``,
    on failure the temporary file is removed and ``path`` is untouched."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        yield fd
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, path)
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes, *, durable: bool = True, mode: int = 0o644) -> None:
    """Write ``data`` under a temporary name, fsync, and rename over ``path``."""
    with atomic_file(path, durable=durable, mode=mode) as fd:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def pread_exact(fd: int, out: memoryview, offset: int, what: str) -> None:
    """Fill ``out`` from ``fd`` at ``offset``; raise EOFError naming ``what`` if the file is short."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{what}: file ends at {offset + done}, needed {offset + len(out)}")
        done += n


def newest_mtime(path: Path) -> float:
    """Latest modification time of a directory or anything directly in it."""
    times = [path.stat().st_mtime]
    for child in path.iterdir():
        try:
            times.append(child.stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


def age_s(path: Path) -> float:
    return time.time() - newest_mtime(path)


@contextmanager
def made_for(path: str | os.PathLike) -> Iterator[Path]:
    """Create ``path`` (and missing parents) for work that fills it; if the work fails, remove
    what was created here, so a failed restore leaves no empty folder behind. A folder that
    existed before is never removed."""
    path = Path(path).absolute()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)  # the topmost folder made here, and what is under it
        raise
