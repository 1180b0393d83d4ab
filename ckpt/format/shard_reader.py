"""The reading side of a saved shard, whatever tier holds it: random access to its data
file plus its parsed manifest. Tiers implement it; tensor I/O and verification only read
through it, so the format never depends on a tier."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from .manifest import ShardManifest

if TYPE_CHECKING:
    import torch


class ShardReader(ABC):
    """Random access to one rank's data file, plus its parsed shard manifest."""

    manifest: ShardManifest
    location: str  # for messages: the data file's path or URL

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the data file's bytes at ``offset``; raise if short."""

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        """Zero-copy access where the bytes already sit in memory (the memory tier)."""
        return None

    def tensor(self, offset: int, nbytes: int) -> "torch.Tensor | None":
        """The same bytes as ``view``, as a CPU uint8 tensor: the source of a device copy."""
        return None

    def expect(self, ranges: list[tuple[int, int]]) -> None:
        """The (offset, nbytes) ranges that will be read, when not every tensor whole
        (restore at another world size): a reader that fetches ahead fetches only these."""

    def close(self) -> None:
        """Release handles; memory readers re-check their seal here."""
