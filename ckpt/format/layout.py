"""Where a DTensor's local shard sits in its global tensor: recorded at save, intersected at
restore, so a checkpoint saved by N ranks restores into M.

Per dimension, a local shard holds a list of global index *runs* (start, length), in
local order: one run for ``Shard(d)`` (torch.chunk's uneven split, as DTensor does), several
for ``_StridedShard`` (FSDP2 over tensor parallelism), the whole dimension otherwise. A
shard is the Cartesian product of its runs, which is what ``overlap`` intersects: the result
is a few boxes, each copied from the saved local tensor straight into the target's. The
runs come from torch's own offset computation (``_get_shard_size_and_offsets``, as
``compute_local_shape_and_global_offset`` uses), so the record follows DTensor's semantics
rather than a copy of them. ``Partial`` holds unreduced values: refused at save.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ManifestError, StateMismatch

if TYPE_CHECKING:
    import torch

MAX_RUNS = 1 << 16  # per tensor: a hostile manifest cannot make intersections costly
_PLACEMENT = re.compile(r"^(Replicate\(\)|Shard\(\d{1,3}\)|_StridedShard\(\d{1,3},\d{1,9}\))$")
_MESH_DIM = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")

Runs = tuple[tuple[int, int], ...]  # (global start, length) in local order


@dataclass(frozen=True)
class Layout:
    """One saved (or target) local shard of a DTensor, in global coordinates."""

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]  # the mesh's dimension names ("" where unnamed)
    placements: tuple[str, ...]  # "Shard(0)", "Replicate()", "_StridedShard(0,2)": one per mesh dim
    coordinate: tuple[int, ...]  # this shard's coordinate in the mesh
    runs: tuple[Runs, ...]  # per tensor dim
    mesh_start: int | None = None  # the mesh's first rank, when its ranks run in order (``_mesh_start``)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(n for _, n in r) for r in self.runs)

    def to_json(self) -> dict:
        return {"global_shape": list(self.global_shape), "mesh_shape": list(self.mesh_shape),
                "mesh_dims": list(self.mesh_dims), "placements": list(self.placements),
                "coordinate": list(self.coordinate), "runs": [[list(r) for r in d] for d in self.runs],
                **({"mesh_start": self.mesh_start} if self.mesh_start is not None else {})}

    @classmethod
    def from_json(cls, d: Any, shape: tuple[int, ...], what: str) -> "Layout":
        """Checked against the saved local ``shape``: runs inside the global shape, summing to it."""
        try:
            g, mesh = _ints(d["global_shape"]), _ints(d["mesh_shape"])
            dims, places, coord = tuple(d["mesh_dims"]), tuple(d["placements"]), _ints(d["coordinate"])
            runs = tuple(tuple((int(a), int(n)) for a, n in dim) for dim in d["runs"])
            start = d.get("mesh_start")
            if start is not None and (type(start) is not int or not 0 <= start < 1 << 31):
                raise ValueError(f"mesh start {start!r}")
            if not (len(mesh) == len(dims) == len(places) == len(coord)) or not len(g) == len(shape) == len(runs):
                raise ValueError("lengths disagree")
            if not all(isinstance(x, str) and _MESH_DIM.match(x) for x in dims):
                raise ValueError(f"mesh dims {dims}")
            if not all(isinstance(p, str) and _PLACEMENT.match(p) for p in places):
                raise ValueError(f"placements {places}")
            if any(c >= m for c, m in zip(coord, mesh)) or sum(len(r) for r in runs) > MAX_RUNS:
                raise ValueError("coordinate outside the mesh, or too many runs")
            for size, total, dim in zip(g, shape, runs):
                if any(type(a) is not int or a < 0 or n < 1 or a + n > size for a, n in dim):
                    raise ValueError(f"run outside 0..{size}")
                if sum(n for _, n in dim) != total:
                    raise ValueError(f"runs do not add up to the local shape {shape}")
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{what}: bad DTensor layout: {e}") from None
        return cls(g, mesh, dims, places, coord, runs, start)


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise ValueError(f"expected a list of integers >= 0, got {v!r}")
    return tuple(v)


def layout_of(t: Any, path: str = "") -> Layout:
    """The layout of a DTensor's local shard on this rank. Raises for ``Partial``."""
    try:
        layout = _layout(tuple(t.shape), t.device_mesh, tuple(t.placements))
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if layout.local_shape != tuple(t.to_local().shape) and not (outside_mesh(t) and t.to_local().numel() == 0):
        # the state contradicts itself, not the checkpoint: no older step would restore into it either
        raise StateMismatch(f"{path}: DTensor local shape {tuple(t.to_local().shape)} does not match its placements "
                            f"{list(layout.placements)} ({layout.local_shape}); cannot record where it lies (a "
                            "DeviceMesh over ranks out of order with FSDP2 gives such shards: build the mesh in rank "
                            "order, or use one rank)")
    return layout


def outside_mesh(t: Any) -> bool:
    """Whether this rank is outside a DTensor's mesh (a sub-mesh): it holds none of the tensor."""
    return t.device_mesh.get_coordinate() is None


@functools.lru_cache(maxsize=4096)  # a model's tensors share a few layouts; save() must stay cheap
def _layout(global_shape: tuple[int, ...], mesh: Any, placements: tuple) -> Layout:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    names = []
    for p in placements:
        if isinstance(p, _StridedShard):
            names.append(f"_StridedShard({p.dim},{p.split_factor})")
        elif isinstance(p, Shard):
            names.append(f"Shard({p.dim})")
        elif isinstance(p, Replicate):
            names.append("Replicate()")
        else:
            raise CheckpointError(f"cannot checkpoint a DTensor with placement {p} (partial sums are not values "
                                  "yet: reduce it first, e.g. .redistribute(placements=[Replicate()]))")
    coord = mesh.get_coordinate()
    outside = coord is None  # a DTensor on a sub-mesh: this rank holds none of it
    coord = tuple(coord or [0] * mesh.ndim)
    runs = tuple(() for _ in global_shape) if outside else _placed(global_shape, tuple(mesh.shape), coord,
                                                                    placements)
    return Layout(global_shape, tuple(mesh.shape), tuple(n or "" for n in (mesh.mesh_dim_names or [""] * mesh.ndim)),
                  tuple(names), coord, runs, _mesh_start(mesh))


def _mesh_start(mesh: Any) -> int | None:
    """The first rank of a mesh whose ranks run in order (``mesh.mesh`` is ``arange(start, start + n)``
    in its shape), so that a reader knows every rank's coordinate from one shard's record; None otherwise."""
    ranks = mesh.mesh.flatten().tolist()
    return ranks[0] if ranks == list(range(ranks[0], ranks[0] + len(ranks))) else None


def layout_at(like: Layout, coordinate: tuple[int, ...]) -> Layout:
    """``like``'s tensor as the rank at ``coordinate`` of the same mesh holds it: what an SPMD
    checkpoint's other shards record, computed as at save (torch's offsets), without a mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def placement(name: str) -> Any:
        args = [int(a) for a in re.findall(r"\d+", name)]
        if name.startswith("_StridedShard"):
            return _StridedShard(args[0], split_factor=args[1])
        return Shard(args[0]) if name.startswith("Shard") else Replicate()

    runs = _placed(like.global_shape, like.mesh_shape, coordinate, tuple(placement(p) for p in like.placements))
    return Layout(like.global_shape, like.mesh_shape, like.mesh_dims, like.placements, tuple(coordinate), runs,
                  like.mesh_start)


def _placed(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
            placements: tuple) -> tuple[Runs, ...]:
    """The runs of the local shard at ``coord``, from torch's own offset computation."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    local = list(global_shape)
    offsets: dict[int, "torch.Tensor"] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):  # Replicate()
            continue
        d = p.dim
        size, index = _get_shard_size_and_offsets(local[d], mesh_shape[mesh_dim], coord[mesh_dim], p,
                                                  offsets.get(d), global_shape[d], False)
        local[d] = size
        offsets[d] = index[:size]
    return tuple(_runs(offsets[d]) if d in offsets else (((0, n),) if n else ()) for d, n in enumerate(global_shape))


def _runs(index: "torch.Tensor") -> Runs:
    if index.numel() == 0:
        return ()
    idx = index.long().flatten()
    breaks = ((idx[1:] - idx[:-1]) != 1).nonzero().flatten().add(1).tolist()
    starts, ends = [0, *breaks], [*breaks, idx.numel()]
    return tuple((int(idx[s]), e - s) for s, e in zip(starts, ends))


def full_layout(shape: tuple[int, ...]) -> Layout:
    """A tensor that is whole on its rank (not a DTensor), as a layout."""
    return Layout(shape, (), (), (), (), tuple(((0, n),) if n else () for n in shape))


@dataclass(frozen=True)
class Box:
    """A block copied from a saved local shard (at ``src``) into a target local shard (at ``dst``)."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)


def overlap(saved: Layout, target: Layout) -> list[Box]:
    """Every block of ``target``'s shard that ``saved``'s shard holds (none: no overlap).
    A 0-d tensor is one element (the one box ``(0,)``)."""
    if not saved.runs:
        return [Box((0,), (0,), (1,))]
    per_dim = [_segments(s, t) for s, t in zip(saved.runs, target.runs)]
    return [Box(*(tuple(x) for x in zip(*combo))) for combo in itertools.product(*per_dim)]


def _segments(saved: Runs, target: Runs) -> list[tuple[int, int, int]]:
    """(saved local start, target local start, length) of each overlap of two dims' runs."""
    out, s_pos = [], 0
    for gs, n in saved:
        t_pos = 0
        for gt, m in target:
            lo, hi = max(gs, gt), min(gs + n, gt + m)
            if lo < hi:
                out.append((s_pos + lo - gs, t_pos + lo - gt, hi - lo))
            t_pos += m
        s_pos += n
    return out
