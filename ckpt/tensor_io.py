"""Moving tensor bytes between a shard reader and memory, in checksum-sized pieces.

Pieces are the manifest's checksum chunks, so every read is verified exactly where
it lands, and a few threads keep the device busy (file reads, CRC32C and torch
copies all release the GIL).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch

from .checksum import chunk_checksums, crc32c_of
from .manifest import ITEMSIZE, ShardManifest, TensorEntry
from .plan import ChunkRead, ReadItem, read_items
from .state import local_tensor
from .tiers.base import ShardReader
from .verify import DEFAULT_THREADS, Progress, mismatch, run_parallel


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, writable, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def read_tensors(
    reader: ShardReader,
    targets: dict[int, torch.Tensor] | None = None,
    *,
    verify: bool = True,
    step: int = -1,
    tier: str = "",
    threads: int = DEFAULT_THREADS,
    progress: Progress | None = None,
    only: Collection[int] | None = None,
) -> list[torch.Tensor | None]:
    """Read every tensor of the shard (or those whose ids are in ``only``; the others are
    None) into ``targets[id]`` (its local shard, for a DTensor) where it fits, else into
    a new tensor; verify each piece's CRC when the manifest has them. Returns the
    targets used and the new tensors, by id.

    A target on a GPU is filled piece by piece: each piece is verified in host memory
    (the slot itself for the memory tier) and copied to the device once."""
    man = reader.manifest
    targets = targets or {}
    out: list[torch.Tensor | None] = []
    dests: list[memoryview | torch.Tensor | None] = []  # host bytes, or a device tensor's bytes
    for e in man.tensors:
        if only is not None and e.id not in only:
            out.append(None)
            dests.append(None)
            continue
        t = targets.get(e.id)
        local = local_tensor(t) if t is not None else None
        if (local is None or local.device.type not in ("cpu", "cuda") or local.dtype != e.torch_dtype
                or tuple(local.shape) != e.shape or not local.is_contiguous()):
            t = local = torch.empty(e.shape, dtype=e.torch_dtype)
        out.append(t)
        dests.append(byte_view(local) if local.device.type == "cpu" else local.reshape(-1).view(torch.uint8))
    chunk = man.chunk_bytes

    def one(item: ReadItem) -> None:
        e, lo, hi = item.tensor, item.lo, item.hi
        crc = e.checksums[lo // chunk] if verify and e.checksums is not None else None
        dst = dests[e.id]
        if isinstance(dst, torch.Tensor):
            _to_device(reader, e, lo, hi, dst, crc, step, tier)
        else:
            _to_host(reader, e, lo, hi, dst[lo:hi], crc, step, tier)
        if progress:
            progress(hi - lo)

    run_parallel(one, [i for i in read_items(man) if only is None or i.tensor.id in only], threads)
    return out


def _to_host(reader: ShardReader, e: TensorEntry, lo: int, hi: int, buf: memoryview, crc: int | None,
             step: int, tier: str) -> None:
    src = reader.view(e.offset + lo, hi - lo)
    if src is not None and crc is not None and crc32c_of(src) != crc:
        raise mismatch(reader, e, lo, hi, step, tier)  # checked first: a bad slot clobbers nothing
    if hi > lo:
        reader.read_into(e.offset + lo, buf)
    if src is None and crc is not None and crc32c_of(buf) != crc:
        raise mismatch(reader, e, lo, hi, step, tier)


def _to_device(reader: ShardReader, e: TensorEntry, lo: int, hi: int, dst: torch.Tensor, crc: int | None,
               step: int, tier: str) -> None:
    host = reader.tensor(e.offset + lo, hi - lo)
    if host is None:
        host = torch.empty(hi - lo, dtype=torch.uint8)
        reader.read_into(e.offset + lo, byte_view(host))
    if crc is not None and crc32c_of(byte_view(host)) != crc:
        raise mismatch(reader, e, lo, hi, step, tier)
    if hi > lo:
        dst[lo:hi].copy_(host)


def read_chunks(reader: ShardReader, reads: list[ChunkRead], dests: dict[str, torch.Tensor], *, verify: bool = True,
                step: int = -1, tier: str = "", threads: int = DEFAULT_THREADS) -> int:
    """Copy each read's boxes from the saved shard straight into ``dests[read.target]`` (a
    local shard, at least 1-d), a slab of dim-0 rows (about one checksum chunk) at a time:
    each slab is read as the whole chunks covering it and verified before any byte of it is
    copied, so memory stays at threads x (slab + 2 chunks). Returns the bytes read."""
    chunk, slabs, done = reader.manifest.chunk_bytes, [], []
    for rd in reads:
        row = rd.tensor.nbytes // max(1, (rd.tensor.shape or (1,))[0])
        lo, hi = rd.rows
        per = max(1, chunk // row) if row else max(1, hi - lo)
        slabs += [(rd, a, min(hi, a + per), row) for a in range(lo, hi, per)]

    def one(slab: tuple[ChunkRead, int, int, int]) -> None:
        rd, a, b, row = slab
        e = rd.tensor
        c0, c1 = a * row // chunk, max(a * row // chunk + 1, -(-(b * row) // chunk))
        start, end = c0 * chunk, min(e.nbytes, c1 * chunk)
        host = reader.tensor(e.offset + start, end - start)
        if host is None:
            host = torch.empty(end - start, dtype=torch.uint8)
            reader.read_into(e.offset + start, byte_view(host))
        if verify and e.checksums is not None:
            for k in range(c0, c1):
                lo, hi = k * chunk, min(e.nbytes, (k + 1) * chunk)
                if crc32c_of(byte_view(host[lo - start:hi - start])) != e.checksums[k]:
                    raise mismatch(reader, e, lo, hi, step, tier)
        piece = host[a * row - start:b * row - start]
        if piece.storage_offset() % ITEMSIZE[e.dtype]:
            piece = piece.clone()  # a chunk size that is not a multiple of the item size
        src = piece.view(e.torch_dtype).reshape(b - a, *e.shape[1:])
        dst = dests[rd.target]
        for box in rd.boxes:
            r0, r1 = max(a, box.src[0]), min(b, box.src[0] + box.size[0])
            if r0 >= r1:
                continue
            s, d = src[r0 - a:r1 - a], dst[box.dst[0] + r0 - box.src[0]:box.dst[0] + r1 - box.src[0]]
            for dim in range(1, len(box.size)):
                s, d = s.narrow(dim, box.src[dim], box.size[dim]), d.narrow(dim, box.dst[dim], box.size[dim])
            d.copy_(s)
        done.append(end - start)

    run_parallel(one, slabs, threads)
    return sum(done)


def with_checksums(reader: ShardReader, threads: int = DEFAULT_THREADS) -> ShardManifest:
    """The reader's manifest with CRCs computed from its bytes (memory slots are sealed without)."""
    man = reader.manifest

    def one(e: TensorEntry) -> TensorEntry:
        buf = reader.view(e.offset, e.nbytes)
        if buf is None:
            buf = memoryview(bytearray(e.nbytes))
            reader.read_into(e.offset, buf)
        return e.with_checksums(chunk_checksums(buf, man.chunk_bytes))

    with ThreadPoolExecutor(threads) as pool:
        tensors = list(pool.map(one, sorted(man.tensors, key=lambda e: -e.nbytes)))
    return dataclasses.replace(man, tensors=sorted(tensors, key=lambda e: e.id))
