"""Pieces of pinned host memory (a memory slot) restored onto their device near the DMA's
speed, each verified on the device before it reaches its target.

Checksumming on the host first made a restore from memory 3.5-4.5x the host→device floor
on an H100 (benchmarks/results/restore_gpu_probe_h100_2026-11-27.json): CRC32C of every
byte on 16 threads took longer than the DMA itself. Here the host only issues copies, and
4.2 GB of pieces land checked in 1.58x the floor
(benchmarks/results/restore_gpu_probe_h100_staged_2026-11-27.json):

1. a block of pieces is copied into a staging buffer on the device, each piece right-aligned
   in a row of zeros (``device_crc``: leading zeros leave its CRC unchanged);
2. the device computes every row's CRC32C and compares it with the manifest's;
3. only a block that matched is copied into its targets, so damage clobbers nothing.

Pieces under ``host_check_below`` (1 MiB) are checked on the host instead, by a pool of
threads while the blocks are staged, and copied together once all of them passed: the
device's checks cost a few dozen kernel launches per row size, and the GPT of the benchmark
has 874 such pieces (60 MB of 4.26 GB).

Blocks pipeline on two streams (copies; checks and scatters) through ``depth`` staging
buffers, so the DMA of one block overlaps the checks of the ones before it. On a CPU device
(the tests) the same steps run in order.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .checksum import crc32c_of
from .device_crc import RowCRC, crc0_from_crc32c, row_bytes
from .verify import DEFAULT_THREADS, run_parallel

# 128 MiB blocks, three deep: 1.58x the floor for 4.2 GB on an H100 (four deep 1.58x, 256 MiB
# 1.57x; 64 MiB, with every small piece staged too, 2.41x); staging and the checks'
# temporaries take about 1 GiB of device memory.
BLOCK_BYTES = 128 << 20
DEPTH = 3
HOST_CHECK_BELOW = 1 << 20


@dataclass(frozen=True)
class DevicePiece:
    """Bytes to restore: ``host`` (uint8, pinned) into ``dst`` (uint8, same length, on the
    device), whose CRC32C must be ``crc`` (None: copied unverified); ``tag`` names them in
    the caller's error."""

    host: torch.Tensor
    dst: torch.Tensor
    crc: int | None
    tag: Any = None


@dataclass
class _Block:
    """Verified pieces ``first..first + len(pieces)`` (in ``run``'s order), each in a row of ``row`` bytes."""

    row: int
    first: int
    pieces: list[DevicePiece]
    buffer: int = 0
    rows: torch.Tensor | None = None
    checked: torch.cuda.Event | None = None


class StagedDeviceReads:
    """Restores pieces onto one device; ``run`` returns when every byte is in place."""

    def __init__(self, device: torch.device, *, block_bytes: int = BLOCK_BYTES, depth: int = DEPTH,
                 host_check_below: int = HOST_CHECK_BELOW, threads: int = DEFAULT_THREADS) -> None:
        self.device, self.block_bytes, self.depth = device, block_bytes, depth
        self.host_check_below, self.threads = host_check_below, threads
        self.cuda = device.type == "cuda"
        self.copies = self._stream()
        self.checks = self._stream()

    def run(self, pieces: list[DevicePiece], on_bad: Callable[[DevicePiece], Exception],
            progress: Callable[[int], None] | None = None) -> None:
        """Copy every piece; raise ``on_bad(piece)`` for a piece that fails its check. A piece
        that fails reaches no target, nor does any piece of its block or a later one, nor any
        piece checked on the host."""
        here = [p for p in pieces if p.crc is not None and 0 < p.host.numel() < self.host_check_below]
        there = [p for p in pieces if p.crc is not None and p.host.numel() >= max(1, self.host_check_below)]

        def check_here(p: DevicePiece) -> None:
            if crc32c_of(memoryview(p.host.numpy())) != p.crc:
                raise on_bad(p)

        self._copy([p for p in pieces if p.crc is None], progress)
        run_parallel(check_here, here, self.threads, meanwhile=lambda: self._staged(there, on_bad, progress))
        self._copy(here, progress)

    def _copy(self, pieces: list[DevicePiece], progress: Callable[[int], None] | None) -> None:
        """Copy pieces as they are: unchecked, or checked on the host already."""
        try:
            with self._on(self.copies):
                for p in pieces:
                    p.dst.copy_(p.host, non_blocking=True)
                    if progress:
                        progress(p.host.numel())
        finally:
            self._drain()

    def _staged(self, pieces: list[DevicePiece], on_bad: Callable[[DevicePiece], Exception],
                progress: Callable[[int], None] | None) -> None:
        """Stage, check on the device and scatter the pieces, a block at a time."""
        checked = sorted(pieces, key=lambda p: row_bytes(p.host.numel()))
        blocks = self._blocks(checked)
        with self._on(self.checks):  # ordered before the checks that read it
            expected = crc0_from_crc32c([p.crc for p in checked], [p.host.numel() for p in checked]).to(self.device)
        verdict = torch.zeros(len(checked), dtype=torch.bool, pin_memory=self.cuda)
        largest = max((b.row * len(b.pieces) for b in blocks), default=0)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=self.device)
                   for _ in range(min(self.depth, len(blocks)))]
        released: list[torch.cuda.Event | None] = [None] * len(buffers)
        try:
            inflight: deque[_Block] = deque()
            for i, block in enumerate(blocks):
                if len(inflight) == len(buffers):
                    done = inflight.popleft()
                    released[done.buffer] = self._finish(done, verdict, on_bad, progress)
                block.buffer = i % len(buffers)
                staged = self._stage(block, buffers[block.buffer], released[block.buffer])
                self._check(block, staged, expected, verdict)
                inflight.append(block)
            while inflight:
                self._finish(inflight.popleft(), verdict, on_bad, progress)
        finally:
            self._drain()

    def _drain(self) -> None:
        """Wait until both streams are done: nothing may still read the slot."""
        for stream in (self.copies, self.checks):
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                stream.synchronize()

    def _blocks(self, pieces: list[DevicePiece]) -> list[_Block]:
        """Consecutive pieces of one row size, ``block_bytes`` of rows (at least one) each."""
        blocks: list[_Block] = []
        for i, p in enumerate(pieces):
            row = row_bytes(p.host.numel())
            b = blocks[-1] if blocks else None
            if b is None or b.row != row or (len(b.pieces) + 1) * row > max(row, self.block_bytes):
                blocks.append(b := _Block(row, i, []))
            b.pieces.append(p)
        return blocks

    def _stage(self, block: _Block, buffer: torch.Tensor, released: torch.cuda.Event | None
               ) -> torch.cuda.Event | None:
        """Issue the block's copies into ``buffer``, once the block before in it has left."""
        block.rows = rows = buffer[:block.row * len(block.pieces)].view(len(block.pieces), block.row)
        with self._on(self.copies):
            if released is not None:
                self.copies.wait_event(released)
            if any(p.host.numel() < block.row for p in block.pieces):
                rows.zero_()
            for r, p in enumerate(block.pieces):
                rows[r, block.row - p.host.numel():].copy_(p.host, non_blocking=True)
            return self._event()

    def _check(self, block: _Block, staged: torch.cuda.Event | None, expected: torch.Tensor,
               verdict: torch.Tensor) -> None:
        span = slice(block.first, block.first + len(block.pieces))
        with self._on(self.checks):
            if staged is not None:
                self.checks.wait_event(staged)
            bad = RowCRC(block.row, self.device)(block.rows) != expected[span]
            verdict[span].copy_(bad, non_blocking=True)
            block.checked = self._event()

    def _finish(self, block: _Block, verdict: torch.Tensor, on_bad: Callable[[DevicePiece], Exception],
                progress: Callable[[int], None] | None) -> torch.cuda.Event | None:
        """Wait for the block's check; scatter it into its targets, or raise. Returns the event
        after which its buffer is free."""
        if block.checked is not None:
            block.checked.synchronize()
        bad = verdict[block.first:block.first + len(block.pieces)]
        if bad.any():
            raise on_bad(block.pieces[int(bad.nonzero()[0])])
        with self._on(self.checks):
            torch._foreach_copy_([p.dst for p in block.pieces],
                                 [block.rows[r, block.row - p.host.numel():] for r, p in enumerate(block.pieces)])
            done = self._event()
        if progress:
            progress(sum(p.host.numel() for p in block.pieces))
        return done

    # streams and events on a GPU; none (everything in order) on the CPU

    def _stream(self) -> torch.cuda.Stream | None:
        if not self.cuda:
            return None
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))  # after whatever made the targets
        return s

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def _event(self) -> torch.cuda.Event | None:
        """An event recorded on the current stream (the GPU), or None."""
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record()
        return e
