"""Chunk checksums: CRC32C over fixed-size chunks of each tensor's bytes.

CRC32C is hardware-accelerated (SSE4.2 / ARMv8) and the ``crc32c`` package releases
the GIL, so several threads checksum at memory bandwidth. Per-chunk sums let a
ranged download or a partial read verify exactly the bytes it fetched.
"""
from __future__ import annotations

from typing import Callable

import crc32c as _crc

DEFAULT_CHUNK_BYTES = 16 << 20
# Readers refuse smaller chunks: `chunk_bytes: 1` in a hostile manifest would turn a
# small checkpoint into millions of checksums to parse and verify.
MIN_CHUNK_BYTES = 64 << 10
ALGORITHM = "crc32c"


def check_chunk_bytes(chunk_bytes: int) -> int:
    """``chunk_bytes`` for a writer, refused now if readers would refuse the manifest later."""
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be an integer >= {MIN_CHUNK_BYTES} (64 KiB), got {chunk_bytes!r}")
    return chunk_bytes


VISIT_BYTES = 1 << 20  # a ``visit`` sees the bytes in pieces this size, while they are still in cache


def chunk_checksums(buf: memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    visit: Callable[[memoryview], None] | None = None) -> list[int]:
    """CRC32C of each ``chunk_bytes`` piece of ``buf`` (at least one entry, even if empty).
    ``visit``: also called on every piece of ``buf`` (in order, ``VISIT_BYTES`` at most, cut
    at multiples of it), right after the CRC read it: a second check for one read of the bytes."""
    n = len(buf)
    if n == 0:
        return [_crc.crc32c(b"")]
    if visit is None:
        return [_crc.crc32c(buf[i : i + chunk_bytes]) for i in range(0, n, chunk_bytes)]
    sums = []
    for i in range(0, n, chunk_bytes):
        crc = 0
        for j in range(i, min(i + chunk_bytes, n), VISIT_BYTES):
            piece = buf[j : min(j + VISIT_BYTES, i + chunk_bytes, n)]
            crc = _crc.crc32c(piece, crc)
            visit(piece)
        sums.append(crc)
    return sums


def crc32c_of(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C of one buffer (a manifest, or one chunk); ``value``: the CRC of the bytes before it."""
    return _crc.crc32c(data, value)
