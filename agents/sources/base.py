"""The one interface every sample source implements."""
from __future__ import annotations

import collections
from abc import ABC, abstractmethod


class Source(ABC):
    """Yields telemetry rows and XID events in the SCHEMA layout.

    A row is a dict with ``timestamp`` (epoch milliseconds), ``node``, ``gpu``,
    ``uuid`` and the DCGM metric columns (None where a field is blank); an XID
    event has ``timestamp``, ``node``, ``gpu`` and ``xid``. ``read`` is called once
    per sampling tick; ``xids`` may be called more often and returns each event once.
    """

    def __init__(self) -> None:
        self._xids: collections.deque[dict] = collections.deque()

    @abstractmethod
    def read(self) -> list[dict]:
        """This tick's rows, one per GPU that answered."""

    def xids(self) -> list[dict]:
        """XID events logged since the last call (thread-safe: popleft is atomic)."""
        out = []
        while self._xids:
            out.append(self._xids.popleft())
        return out

    def model_name(self, node: str, gpu: int) -> str:
        """The GPU's marketing name (dcgm-exporter's ``modelName`` label)."""
        return "unknown"

    def metrics(self) -> list:
        """Prometheus metric families about the source itself (scrape errors, missing fields)."""
        return []

    @property
    def finished(self) -> bool:
        """True once a finite source (a replay) has nothing more to give."""
        return False

    def close(self) -> None:
        """Release devices and threads."""
