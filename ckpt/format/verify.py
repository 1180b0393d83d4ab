"""Checking a shard's bytes against its manifest's chunk checksums. Needs no torch, so
``ckpt verify`` starts in a fraction of a second; ``tensor_io`` uses the same pieces."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..errors import DamagedCheckpoint
from .checksum import crc32c_of
from .manifest import TensorEntry
from .read_items import ReadItem, read_items
from .shard_reader import ShardReader

Progress = Callable[[int], None]
DEFAULT_THREADS = 4


def mismatch(reader: ShardReader, e: TensorEntry, lo: int, hi: int, step: int, tier: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(step, reader.location, f"checksum mismatch in tensor {e.path!r} bytes {lo}..{hi}", tier)


def verify_shard(reader: ShardReader, *, step: int = -1, tier: str = "", threads: int = DEFAULT_THREADS,
                 progress: Progress | None = None) -> None:
    """Read every byte the manifest describes and check its CRC; no tensors are kept."""
    man = reader.manifest
    if not man.has_checksums:
        raise DamagedCheckpoint(step, reader.location, "no checksums recorded", tier)
    chunk = man.chunk_bytes

    def one(item: ReadItem) -> None:
        e, lo, hi = item.tensor, item.lo, item.hi
        buf = reader.view(e.offset + lo, hi - lo)
        if buf is None:
            buf = memoryview(bytearray(hi - lo))
            reader.read_into(e.offset + lo, buf)
        if crc32c_of(buf) != e.checksums[lo // chunk]:
            raise mismatch(reader, e, lo, hi, step, tier)
        if progress:
            progress(hi - lo)

    run_parallel(one, read_items(man), threads)


def run_parallel(fn: Callable[[Any], None], items: list, threads: int,
                 meanwhile: Callable[[], None] | None = None) -> None:
    """``fn`` over ``items`` on ``threads`` threads (CRC32C and file reads release the GIL)
    while the calling thread runs ``meanwhile`` (say, the device's copies). The first error
    is raised and the items not yet started are dropped."""
    if (threads <= 1 or len(items) <= 1) and meanwhile is None:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futures = [pool.submit(fn, it) for it in items]
        try:
            if meanwhile is not None:
                meanwhile()
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
