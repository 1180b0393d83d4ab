"""Writing a whole state as a committed one-rank checkpoint, outside any training job
(``ckpt import``): the same layout, checksums and tier write path as a job's save
(``write_shard``, then the commit record last), so ``ckpt.load``, ``ckpt verify`` and a
one-process ``CheckpointManager`` treat it like any other; an interrupted write leaves
nothing committed.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError
from ..format.checksum import DEFAULT_CHUNK_BYTES
from ..format.manifest import Manifest, ShardManifest
from ..format.state import flatten
from ..format.tensor_io import byte_view, with_checksums
from ..save.ownership import claim, owner_run, refusal
from ..tiers.base import CheckpointId, DurableTier, ShardReader
from ..tiers.memory.copier import plan_layout


class TensorsReader(ShardReader):
    """A shard's data file as ``plan_layout`` lays it out, served from the tensors
    themselves (no second copy of the state; alignment gaps read as zeros)."""

    def __init__(self, manifest: ShardManifest, tensors: list[torch.Tensor],
                 progress: Callable[[int], None] | None = None) -> None:
        self.manifest, self.location, self._progress = manifest, "(memory)", progress
        self._views = [byte_view(t) for t in tensors]
        self._starts = [e.offset for e in manifest.tensors]

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        i = bisect.bisect_right(self._starts, offset) - 1
        e = self.manifest.tensors[i] if i >= 0 else None
        if e is None or offset + nbytes > e.offset + e.nbytes:
            return None  # spans a gap or two tensors: read_into assembles it
        self._count(nbytes)
        return self._views[i][offset - e.offset:offset - e.offset + nbytes]

    def read_into(self, offset: int, out: memoryview) -> None:
        end = offset + len(out)
        out[:] = bytes(len(out))
        for i in range(max(0, bisect.bisect_right(self._starts, offset) - 1), len(self._starts)):
            e = self.manifest.tensors[i]
            if e.offset >= end:
                break
            lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
            if lo < hi:
                out[lo - offset:hi - offset] = self._views[i][lo - e.offset:hi - e.offset]
        self._count(len(out))

    def _count(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress(nbytes)


def import_target(tier: DurableTier, step: int, *, run: str, replace: bool = False) -> CheckpointId:
    """The id an import of ``step`` gets in ``tier``, checked before anything is read or
    written: the root must be this run's (or no run's), and empty unless ``replace``,
    in which case the import becomes the newest checkpoint there (a new generation), so a
    job resumes from it."""
    other = owner_run(tier)
    if other is not None and other != run:
        raise refusal(tier, run, other)
    existing = [i.id for i in tier.list()]
    if existing and not replace:
        raise CheckpointError(f"{tier.location} already holds {len(existing)} checkpoint(s); an import becomes the "
                              "newest one there only when asked to (--force)")
    return CheckpointId(max((i.generation + 1 for i in existing), default=0), step)


def write_state(tier: DurableTier, ckpt_id: CheckpointId, state: Mapping[str, Any], *, run: str,
                progress: Callable[[int], None] | None = None) -> None:
    """Commit ``state`` (CPU tensors and plain values) as ``ckpt_id`` of a one-rank job with
    run id ``run``. ``progress`` counts the bytes twice: checksummed, then written."""
    other = claim(tier, run)
    if other is not None:
        raise refusal(tier, run, other)
    flat = flatten(state)
    tensors = [t.detach().cpu().contiguous() for _, t in flat.tensors]
    entries, nbytes = plan_layout(flat.tensors)
    manifest = ShardManifest(0, ckpt_id.step, ckpt_id.generation, nbytes, entries, flat.tree, DEFAULT_CHUNK_BYTES, 1)
    reader = TensorsReader(manifest, tensors, progress)
    reader.manifest = with_checksums(reader)
    try:
        ref = tier.write_shard(ckpt_id, reader)
        tier.commit(ckpt_id, Manifest(ckpt_id.step, ckpt_id.generation, 1, [ref]))
    except BaseException:
        tier.delete(ckpt_id)  # the uncommitted part
        raise
