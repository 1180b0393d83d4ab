"""Moving tensor bytes between a shard reader and memory, in checksum-sized pieces.

Pieces are the manifest's checksum chunks, so every read is verified exactly where
it lands, and a few threads keep the device busy (file reads, CRC32C and torch
copies all release the GIL).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

import torch

from .checksum import chunk_checksums, crc32c_of
from .device_reads import DevicePiece, StagedDeviceReads
from .manifest import ITEMSIZE, ShardManifest, TensorEntry
from .read_items import ChunkRead, ReadItem, read_items
from .shard_reader import ShardReader
from .state import local_tensor
from .verify import DEFAULT_THREADS, Progress, mismatch, run_parallel

log = logging.getLogger(__name__)


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, writable, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def writable_bytes(t: torch.Tensor) -> bool:
    """Whether bytes can be written straight into ``t``'s memory (a contiguous CPU or CUDA
    tensor whose values are its bytes: not a conj or neg view, whose bytes hold the value's
    conjugate or negation); other targets get new memory and are copied into (``load_into``)."""
    return t.device.type in ("cpu", "cuda") and t.is_contiguous() and not t.is_conj() and not t.is_neg()


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

    A target on a GPU is filled from a pinned slot (the memory tier) by asynchronous
    copies, each piece verified before it reaches its target (on the device; under a MiB,
    on the host: ``StagedDeviceReads``); from other readers each piece is verified in host memory,
    then copied. Every copy is complete when this returns."""
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
        if local is None or not writable_bytes(local) or local.dtype != e.torch_dtype or tuple(local.shape) != e.shape:
            t = local = torch.empty(e.shape, dtype=e.torch_dtype)
        out.append(t)
        dests.append(byte_view(local) if local.device.type == "cpu" else local.reshape(-1).view(torch.uint8))
    items = [i for i in read_items(man) if only is None or i.tensor.id in only]
    chunk = man.chunk_bytes

    def crc_of(item: ReadItem) -> int | None:
        e = item.tensor
        return e.checksums[item.lo // chunk] if verify and e.checksums is not None else None

    # A pinned slot's pieces bound for a GPU go there by asynchronous copies, each verified
    # first (``StagedDeviceReads``); every other piece is read, verified and copied by a
    # thread of the pool.
    on_device: dict[torch.device, list[DevicePiece]] = {}
    on_host = items
    if any(isinstance(d, torch.Tensor) for d in dests) and _pinned(reader):
        on_host = []
        for item in items:
            e, lo, hi, dst = item.tensor, item.lo, item.hi, dests[item.tensor.id]
            src = reader.tensor(e.offset + lo, hi - lo) if isinstance(dst, torch.Tensor) else None
            if src is None:
                on_host.append(item)
            else:
                on_device.setdefault(dst.device, []).append(DevicePiece(src, dst[lo:hi], crc_of(item), item))

    def one(item: ReadItem) -> None:
        e, lo, hi, dst = item.tensor, item.lo, item.hi, dests[item.tensor.id]
        if isinstance(dst, torch.Tensor):
            host = _verified_piece(reader, e, lo, hi, crc_of(item), step, tier)
            if hi > lo:
                dst[lo:hi].copy_(host)
        else:
            _to_host(reader, e, lo, hi, dst[lo:hi], crc_of(item), step, tier)
        if progress:
            progress(hi - lo)

    def to_devices() -> None:
        for device, pieces in on_device.items():
            try:
                StagedDeviceReads(device, threads=threads).run(
                    pieces, lambda p: mismatch(reader, p.tag.tensor, p.tag.lo, p.tag.hi, step, tier), progress)
            except torch.OutOfMemoryError:  # no room to stage: verify on the host (any piece again)
                log.warning("no device memory to stage a restore on %s: checking its pieces on the host", device)
                run_parallel(one, [p.tag for p in pieces], threads)

    # the device reads finish (and wait for their copies) before the reader may be closed
    run_parallel(one, on_host, threads, meanwhile=to_devices if on_device else None)
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


def _pinned(reader: ShardReader) -> bool:
    """Whether the reader's bytes are CUDA pinned memory (a registered slot), asked once:
    the check is a driver call."""
    probe = reader.tensor(0, 1) if reader.manifest.data_bytes else None
    return probe is not None and probe.is_pinned()


def _verified_piece(reader: ShardReader, e: TensorEntry, lo: int, hi: int, crc: int | None, step: int,
                    tier: str) -> torch.Tensor:
    """The piece's host bytes, verified before anything is copied from them."""
    host = reader.tensor(e.offset + lo, hi - lo)
    if host is None:
        host = torch.empty(hi - lo, dtype=torch.uint8)
        reader.read_into(e.offset + lo, byte_view(host))
    if crc is not None and crc32c_of(byte_view(host)) != crc:
        raise mismatch(reader, e, lo, hi, step, tier)
    return host


def read_chunks(reader: ShardReader, reads: list[ChunkRead], dests: dict[str, torch.Tensor], *, verify: bool = True,
                step: int = -1, tier: str = "", threads: int = DEFAULT_THREADS) -> int:
    """Copy each read's boxes from the saved shard into ``dests[read.target]`` (a local
    shard, at least 1-d); returns the bytes read, whole checksum chunks, each verified.

    A box of whole rows that lands on whole rows of a CPU target (``Shard(0)`` to
    ``Shard(0)``, FSDP's case) is read straight into it, chunk by chunk: only a chunk's
    bytes outside the box go through a small buffer (the CRC runs over all three parts).
    Any other box is read a slab of rows (about one chunk) at a time into a buffer,
    verified, then copied: memory stays at threads x (slab + 2 chunks)."""
    chunk, items, done = reader.manifest.chunk_bytes, [], []
    for rd in reads:
        e, dst = rd.tensor, dests[rd.target]
        row = e.nbytes // max(1, (e.shape or (1,))[0])
        if row and _whole_rows(rd, dst):
            for box in rd.boxes:
                lo, hi = box.src[0] * row, (box.src[0] + box.size[0]) * row
                shift = box.dst[0] * row - lo  # saved byte x lands at byte x + shift of dst
                items += [(e, k, lo, hi, byte_view(dst), shift) for k in range(lo // chunk, -(-hi // chunk))]
        else:
            lo, hi = rd.rows
            per = max(1, chunk // row) if row else max(1, hi - lo)
            items += [(rd, a, min(hi, a + per), row) for a in range(lo, hi, per)]
    reader.expect([_span(item, chunk) for item in items])

    def direct(e: TensorEntry, k: int, lo: int, hi: int, dst: memoryview, shift: int) -> None:
        c_lo, c_hi = k * chunk, min(e.nbytes, (k + 1) * chunk)
        a, b = max(c_lo, lo), min(c_hi, hi)
        into = dst[a + shift:b + shift]
        crc = e.checksums[k] if verify and e.checksums is not None else None
        src = reader.view(e.offset + c_lo, c_hi - c_lo)
        if src is not None:  # in memory: check first, a bad slot clobbers nothing
            if crc is not None and crc32c_of(src) != crc:
                raise mismatch(reader, e, c_lo, c_hi, step, tier)
            into[:] = src[a - c_lo:b - c_lo]
        else:
            head, tail = memoryview(bytearray(a - c_lo)), memoryview(bytearray(c_hi - b))
            for off, buf in ((c_lo, head), (a, into), (b, tail)):
                if len(buf):
                    reader.read_into(e.offset + off, buf)
            if crc is not None and crc32c_of(tail, crc32c_of(into, crc32c_of(head))) != crc:
                raise mismatch(reader, e, c_lo, c_hi, step, tier)
        done.append(c_hi - c_lo)

    def one(item: tuple) -> None:
        if len(item) == 6:
            return direct(*item)
        rd, a, b, row = item
        e = rd.tensor
        offset, n = _span(item, chunk)
        start, end = offset - e.offset, offset - e.offset + n
        c0, c1 = start // chunk, -(-end // chunk)
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

    run_parallel(one, items, threads)
    return sum(done)


def _span(item: tuple, chunk: int) -> tuple[int, int]:
    """(offset in the data file, nbytes) that ``read_chunks`` reads for one item: whole chunks."""
    if len(item) == 6:
        e, k = item[0], item[1]
        return e.offset + k * chunk, min(e.nbytes, (k + 1) * chunk) - k * chunk
    rd, a, b, row = item
    c0, c1 = a * row // chunk, max(a * row // chunk + 1, -(-(b * row) // chunk))
    return rd.tensor.offset + c0 * chunk, min(rd.tensor.nbytes, c1 * chunk) - c0 * chunk


def _whole_rows(rd: ChunkRead, dst: torch.Tensor) -> bool:
    """Whether each box is whole rows of both the saved shard and ``dst`` (a contiguous CPU tensor)."""
    rest = tuple(rd.tensor.shape[1:])
    return (dst.device.type == "cpu" and writable_bytes(dst) and tuple(dst.shape[1:]) == rest and len(rd.tensor.shape)
            > 0 and all(b.size[1:] == rest and not any(b.src[1:]) and not any(b.dst[1:]) for b in rd.boxes))


def with_checksums(reader: ShardReader, threads: int = DEFAULT_THREADS,
                   visit: Callable[[TensorEntry], Callable[[memoryview], None] | None] | None = None) -> ShardManifest:
    """The reader's manifest with CRCs computed from its bytes (memory slots are sealed without).
    ``visit(entry)``: a callable to see that entry's bytes in the same read (``chunk_checksums``)."""
    man = reader.manifest

    def one(e: TensorEntry) -> TensorEntry:
        buf = reader.view(e.offset, e.nbytes)
        if buf is None:
            buf = memoryview(bytearray(e.nbytes))
            reader.read_into(e.offset, buf)
        return e.with_checksums(chunk_checksums(buf, man.chunk_bytes, visit(e) if visit is not None else None))

    with ThreadPoolExecutor(threads) as pool:
        tensors = list(pool.map(one, sorted(man.tensors, key=lambda e: -e.nbytes)))
    return dataclasses.replace(man, tensors=sorted(tensors, key=lambda e: e.id))
