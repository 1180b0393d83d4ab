"""Which bytes of a saved shard a read takes: a whole tensor in checksum-sized pieces
(``read_items``), or at another world size the rows of a saved local shard that overlap the
target (``ChunkRead``). They describe the format, so the tiers, verification and tensor I/O
share them without depending on restore planning."""
from __future__ import annotations

from dataclasses import dataclass

from .layout import Box
from .manifest import ShardManifest, TensorEntry


@dataclass(frozen=True)
class ReadItem:
    """Bytes ``lo..hi`` of one saved tensor: one verified piece (a checksum chunk)."""

    tensor: TensorEntry
    lo: int
    hi: int


def read_items(manifest: ShardManifest) -> list[ReadItem]:
    """Every tensor of a shard, whole, in checksum-sized pieces: each read is verified
    exactly where it lands."""
    chunk = manifest.chunk_bytes
    return [ReadItem(e, k * chunk, min(e.nbytes, (k + 1) * chunk))
            for e in manifest.tensors for k in range(max(1, -(-e.nbytes // chunk)))]


@dataclass(frozen=True)
class ChunkRead:
    """At another world size: saved rank ``rank``'s local shard ``tensor`` overlaps the
    target at ``target`` (a state path) in ``boxes``. Only rows ``rows`` (of dim 0) are read,
    widened to whole checksum chunks so that every byte read is verified."""

    rank: int
    tensor: TensorEntry
    target: str
    boxes: tuple[Box, ...]

    @property
    def rows(self) -> tuple[int, int]:
        if not self.tensor.shape:
            return 0, 1
        return min(b.src[0] for b in self.boxes), max(b.src[0] + b.size[0] for b in self.boxes)
