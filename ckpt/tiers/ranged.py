"""Reading a remote object in large ranged GETs with read-ahead.

``tensor_io`` asks for checksum-sized pieces (16 MiB) roughly in order. Fetching each
piece with its own GET would pay a round trip per piece and, on S3, a request fee
per piece; and some servers read the whole object for every range. So the object
is fetched in ``block``-sized ranges, ``depth`` blocks ahead of the reader on a pool,
and a block is dropped as soon as every byte the manifest needs from it is handed out.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ..format.manifest import ShardManifest
from .base import ShardReader

Fetch = Callable[[int, int], bytes]  # (offset, nbytes) -> those bytes, from the store


class RangedReader(ShardReader):
    def __init__(self, fetch: Fetch, manifest: ShardManifest, location: str, *, block: int, depth: int,
                 pool: ThreadPoolExecutor) -> None:
        self.manifest, self.location = manifest, location
        self._fetch, self._block, self._depth, self._pool = fetch, block, depth, pool
        self._size = manifest.data_bytes
        self._count = -(-self._size // block)
        self._blocks: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.expect([(t.offset, t.nbytes) for t in manifest.tensors])

    def expect(self, ranges: list[tuple[int, int]]) -> None:
        """Count, per block, the bytes that will be read (every tensor, unless told otherwise):
        blocks are fetched ahead only where needed and dropped once all of it is handed out."""
        need = [0] * self._count
        for offset, n in ranges:
            for i in range(offset // self._block, -(-(offset + n) // self._block)):
                need[i] += min(offset + n, (i + 1) * self._block) - max(offset, i * self._block)
        with self._lock:
            self._need, self._served = need, [0] * self._count  # a new pass (one reader serves several)

    def _get(self, i: int) -> Future:
        """Block ``i``'s future, started if needed (call with the lock held)."""
        fut = self._blocks.get(i)
        if fut is None:
            lo = i * self._block
            n = min(self._block, self._size - lo)
            fut = self._blocks[i] = self._pool.submit(self._fetch_exact, lo, n)
        return fut

    def _fetch_exact(self, offset: int, nbytes: int) -> bytes:
        data = self._fetch(offset, nbytes)
        if len(data) != nbytes:
            raise EOFError(f"{self.location}: object ends at {offset + len(data)}, needed {offset + nbytes}")
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if not n:
            return
        first, last = offset // self._block, (offset + n - 1) // self._block
        with self._lock:
            futures = {i: self._get(i) for i in range(first, last + 1)}
            for i in range(last + 1, min(self._count, last + self._depth)):
                if self._need[i]:
                    self._get(i)  # read-ahead
        for i, fut in futures.items():
            lo, hi = max(offset, i * self._block), min(offset + n, (i + 1) * self._block)
            base = i * self._block
            out[lo - offset : hi - offset] = memoryview(fut.result())[lo - base : hi - base]
            with self._lock:
                self._served[i] += hi - lo
                if self._served[i] >= self._need[i]:
                    self._blocks.pop(i, None)

    def close(self) -> None:
        with self._lock:
            for fut in self._blocks.values():
                fut.cancel()
            self._blocks.clear()
