"""Which saved shards a resharding rank opens: those whose chunks overlap its own, found from
one manifest it reads anyway, not from every saved rank's (N manifests on each of M ranks).

An SPMD checkpoint (FSDP2, tensor parallelism: every rank saved the same DTensors, with the
same global shapes, meshes and placements, at its own coordinate) says in any one shard
manifest where every other shard lies: a DTensor's layout records its mesh's shape, its
placements and, when the mesh's ranks run in order, its first rank (``Layout.mesh_start``),
so the shard at any coordinate follows from torch's offsets (``layout.layout_at``). That is the
index: O(tensors) bytes in the anchor's manifest (saved rank 0's at another world size), read
once, checked against the commit's CRC like every manifest.

Nothing in it is trusted to be SPMD: the shards opened on its word must record exactly the
layouts it predicts, and cover this rank's shards exactly (``plan.reshard_reads``); otherwise
(pipeline stages, rank-local tensors, a mesh out of order, another writer) the restore opens
every saved shard, as without an index. The reads always come from the manifests opened.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import Mapping

from ..format.layout import Layout, layout_at
from ..format.manifest import ShardManifest, TensorEntry
from .plan import canonical_path

_SHARD = re.compile(r"^Shard\((\d+)\)$")


def overlapping(anchor: ShardManifest, targets: Mapping[str, Layout], world: int, rank: int) -> set[int] | None:
    """The saved ranks whose shards overlap ``targets`` (this rank's shards, by state path), the
    anchor's included, as if the checkpoint were SPMD; None when the anchor cannot say (a target
    it does not hold, a mesh whose ranks are not in order). Replicas: the one at ``rank``'s turn."""
    saved = {canonical_path(e.path): e for e in anchor.tensors}
    ranks = {anchor.rank}
    known: dict[tuple, set[int]] = {}
    for path, target in targets.items():
        e = saved.get(canonical_path(path))
        if e is None:
            return None
        if e.layout is None:
            ranks.add(0)  # a plain tensor is read from saved rank 0's copy
            continue
        mesh = e.layout
        if mesh.mesh_start is None or mesh.mesh_start + math.prod(mesh.mesh_shape) > world:
            return None
        key = (mesh.global_shape, mesh.mesh_shape, mesh.placements, mesh.mesh_start, target.runs)
        if key not in known:
            known[key] = {mesh.mesh_start + _ravel(c, mesh.mesh_shape) for c in _coordinates(mesh, target, rank)}
        ranks |= known[key]
    return ranks


def agrees(manifests: Mapping[int, ShardManifest], anchor: ShardManifest, targets: Mapping[str, Layout]) -> bool:
    """Whether every opened shard records, for every target, the layout the anchor predicts."""
    saved = {canonical_path(e.path): e for e in anchor.tensors}
    wanted = {canonical_path(p) for p in targets}
    predicted: dict[tuple, Layout | None] = {}
    for r, man in manifests.items():
        for e in man.tensors:
            path = canonical_path(e.path)
            if path not in wanted or r == anchor.rank:
                continue
            a = saved.get(path)
            if a is None or (a.layout is None) != (e.layout is None) or a.dtype != e.dtype:
                return False
            if a.layout is None:
                continue
            key = (a.layout, r)
            if key not in predicted:
                predicted[key] = _at_rank(a.layout, r)
            if predicted[key] != e.layout or not _fits(e):
                return False
    return True


def _at_rank(like: Layout, rank: int) -> Layout | None:
    index = rank - like.mesh_start if like.mesh_start is not None else -1
    if not 0 <= index < math.prod(like.mesh_shape):
        return None
    return layout_at(like, _unravel(index, like.mesh_shape))


def _fits(e: TensorEntry) -> bool:
    return e.layout is not None and e.layout.local_shape == e.shape


def _coordinates(saved: Layout, target: Layout, rank: int) -> list[tuple[int, ...]]:
    """The mesh coordinates whose shards overlap ``target``: per mesh dimension when each shards
    its own tensor dimension as ``Shard`` does (torch.chunk's split), else every coordinate tried."""
    dims = [_SHARD.match(p) for p in saved.placements]
    sharded = [int(m[1]) for m in dims if m]
    if all(m or p == "Replicate()" for m, p in zip(dims, saved.placements)) and len(set(sharded)) == len(sharded):
        per_dim = [_chunks(saved.global_shape[int(m[1])], n, target.runs[int(m[1])]) if m else [rank % n]
                   for m, n in zip(dims, saved.mesh_shape)]
        return list(itertools.product(*per_dim))
    return [c for c in itertools.product(*map(range, saved.mesh_shape))
            if _meets(layout_at(saved, c), target)]


def _chunks(size: int, n: int, runs: tuple[tuple[int, int], ...]) -> list[int]:
    """Which of the n chunks of a dimension of ``size`` (torch.chunk's: ceil(size / n) each) hold a run."""
    q = -(-size // n)
    if q == 0:
        return [0]
    return sorted({c for start, length in runs for c in range(start // q, min(n - 1, (start + length - 1) // q) + 1)})


def _meets(saved: Layout, target: Layout) -> bool:
    return all(any(max(a, b) < min(a + n, b + m) for a, n in s for b, m in t) for s, t in zip(saved.runs, target.runs))


def _ravel(coord: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for c, n in zip(coord, shape):
        index = index * n + c
    return index


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for n in reversed(shape):
        index, c = divmod(index, n)
        coord.append(c)
    return tuple(reversed(coord))
