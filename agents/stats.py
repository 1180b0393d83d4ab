"""The agent's own counters, shared by the sender (writes) and the exporter (reads)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class AgentStats:
    """Monotonic counters; ``add`` is thread-safe, ``snapshot`` a consistent copy."""

    samples_collected: int = 0
    xid_events_collected: int = 0
    samples_sent: int = 0
    xid_events_sent: int = 0
    batches_sent: int = 0
    send_errors: int = 0
    samples_dropped: int = 0  # spool full (oldest batches dropped), or a row no batch can hold
    xid_events_dropped: int = 0
    samples_rejected: int = 0  # answered 400: malformed, set aside
    xid_events_rejected: int = 0
    sample_errors: int = 0  # a sampling tick that raised
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
