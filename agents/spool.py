"""A bounded on-disk FIFO of encoded batches, so nothing is lost while the predictor is away.

Every batch is spooled before its first send and deleted once accepted: one
path for the happy case and the outage, and batches survive an agent restart.
File names carry order, kind, row count and batch id
(``<seq>.<kind>.<rows>.<uuid>.arrows.gz``), so a retried batch keeps its id and
the receiver counts it once. When the spool is over ``max_bytes`` the oldest
batches are dropped and reported to the caller, who counts them.
"""
from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass

SUFFIX = ".arrows.gz"
REJECTED_DIR = "rejected"
REJECTED_KEEP = 64  # batches refused as malformed, kept for a human to look at


@dataclass(frozen=True)
class Entry:
    """One spooled batch."""

    path: str
    order: str  # sorts like the batches were made; split halves sort in place
    kind: str
    rows: int
    batch_id: str
    size: int

    def read(self) -> bytes:
        with open(self.path, "rb") as fh:
            return fh.read()


def _parse(directory: str, name: str) -> Entry | None:
    if not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split(".")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return None
    return Entry(path, parts[0], parts[1], int(parts[2]), parts[3], size)


class Spool:
    """FIFO of batches in ``directory``, at most ``max_bytes`` on disk."""

    def __init__(self, directory: str, max_bytes: int = 256 << 20):
        self.directory, self.max_bytes = directory, max_bytes
        os.makedirs(os.path.join(directory, REJECTED_DIR), exist_ok=True)
        self._lock = threading.Lock()
        self._in_flight: Entry | None = None  # never dropped while being sent
        for name in os.listdir(directory):  # a crash between write and rename leaves these
            if name.endswith(".tmp"):
                os.unlink(os.path.join(directory, name))
        self._entries = sorted(filter(None, (_parse(directory, n) for n in os.listdir(directory))),
                               key=lambda e: e.order)
        self._bytes = sum(e.size for e in self._entries)
        last = self._entries[-1].order if self._entries else "0"
        self._seq = int(last.rstrip("ab") or 0) + 1

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def head(self) -> Entry | None:
        """The oldest batch, marked as being sent until it is popped, split or set aside."""
        with self._lock:
            self._in_flight = self._entries[0] if self._entries else None
            return self._in_flight

    def push(self, kind: str, body: bytes, rows: int) -> list[Entry]:
        """Append a batch; return the oldest batches dropped to stay within ``max_bytes``."""
        with self._lock:
            order = f"{self._seq:016d}"
            self._seq += 1
            self._entries.append(self._write(order, kind, body, rows))
            return self._trim()

    def pop(self, entry: Entry) -> None:
        """The batch was accepted: forget it (a no-op if it was dropped meanwhile)."""
        with self._lock:
            self._remove(entry)

    def split(self, entry: Entry, halves: list[tuple[bytes, int]]) -> None:
        """Replace a batch by smaller ones, in the same place in the queue (after a 413)."""
        with self._lock:
            if entry not in self._entries:
                return
            i = self._entries.index(entry)
            parts = [self._write(entry.order + tag, entry.kind, body, rows) for tag, (body, rows) in zip("ab", halves)]
            self._entries[i:i + 1] = parts
            self._bytes -= entry.size
            os.unlink(entry.path)

    def set_aside(self, entry: Entry) -> None:
        """The batch is malformed and never will be accepted: keep it out of the way."""
        with self._lock:
            if entry not in self._entries:
                return
            self._entries.remove(entry)
            self._bytes -= entry.size
            rejected = os.path.join(self.directory, REJECTED_DIR)
            os.replace(entry.path, os.path.join(rejected, os.path.basename(entry.path)))
            for old in sorted(os.listdir(rejected))[:-REJECTED_KEEP]:
                os.unlink(os.path.join(rejected, old))

    # -- under the lock ---------------------------------------------------------

    def _write(self, order: str, kind: str, body: bytes, rows: int) -> Entry:
        name = f"{order}.{kind}.{rows}.{uuid.uuid4()}{SUFFIX}"
        path = os.path.join(self.directory, name)
        with open(path + ".tmp", "wb") as fh:
            fh.write(body)
        os.replace(path + ".tmp", path)  # a reader never sees half a batch
        self._bytes += len(body)
        return Entry(path, order, kind, rows, name.split(".")[3], len(body))

    def _remove(self, entry: Entry) -> None:
        if entry in self._entries:
            self._entries.remove(entry)
            self._bytes -= entry.size
            os.unlink(entry.path)

    def _trim(self) -> list[Entry]:
        dropped = []
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            oldest = self._entries[1] if self._entries[0] is self._in_flight else self._entries[0]
            if oldest is self._entries[-1]:
                break  # only the batch being sent and the newest are left
            dropped.append(oldest)
            self._remove(oldest)
        return dropped
