"""A resharding rank opens only the saved shards that overlap its own (issue 52: O(1) manifests
a rank, not N), found from the anchor's layouts (``restore/narrow.py``), and falls back to every
shard, with the same bytes, when the checkpoint does not bear the prediction out.

Single process: each saved rank's shard is written by the format's own code (``flatten``,
``plan_layout``, checksums, ``LocalDiskTier.write_shard``) from DTensors on a fake process
group of N ranks at that rank, and restored at another world size the same way."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ckpt.errors import CheckpointError
from ckpt.format import layout
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import Layout, layout_at
from ckpt.format.manifest import Manifest, ManifestError, ShardManifest, dumps
from ckpt.format.state import flatten
from ckpt.format.tensor_io import with_checksums
from ckpt.interop.offline_write import TensorsReader
from ckpt.restore.narrow import _chunks
from ckpt.restore.plan import Inventory, plans, shard_needs
from ckpt.restore.reshard import load_values
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.local import LocalDiskTier
from ckpt.tiers.memory.copier import plan_layout

SHAPES = {"w": (16, 6), "uneven": (13, 5), "few": (3, 4), "v": (10,)}  # "few": fewer rows than ranks
CID = CheckpointId(1, 0)


class Counted(LocalDiskTier):
    """A disk tier that records which saved ranks' shards were opened."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.opened: list[int] = []

    def open_shard(self, ckpt_id, ref):
        self.opened.append(ref.rank)
        return super().open_shard(ckpt_id, ref)


def full(name: str) -> torch.Tensor:
    shape = SHAPES[name]
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * len(name)


def _mesh(rank: int, world: int, order: list[int] | None = None, name: str | None = None):
    if dist.is_initialized():
        dist.destroy_process_group()
    # one process plays every rank: layouts (and DTensor's ops) are cached per mesh, and meshes
    # of one shape are equal whatever the rank; a restoring rank's mesh is named after it
    layout._layout.cache_clear()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    if order:
        return DeviceMesh("cpu", order)
    return init_device_mesh("cpu", (world,), mesh_dim_names=(name,) if name else None)


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(t, world)
    return chunks[rank].clone() if rank < len(chunks) else t[:0].clone()


def state_at(rank: int, world: int, *, fill: bool, order: list[int] | None = None) -> dict:
    """Rank ``rank``'s state: each tensor ``Shard(0)`` (its real chunk, or zeros to restore into),
    AdamW-like moments beside it, a plain tensor and a value. ``order``: the mesh's ranks."""
    mesh = _mesh(rank, world, order, None if fill else f"to{rank}")
    held = mesh.get_coordinate()[0]

    def dt(name: str, scale: float) -> DTensor:
        local = _local(full(name) * scale, held, world)
        local = local if fill else torch.zeros_like(local)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full(name).shape,
                                  stride=full(name).stride())

    return {"model": {k: dt(k, 1.0) for k in SHAPES},
            "optim": {k: {"exp_avg": dt(k, 2.0), "step": torch.tensor(7.0 if fill else 0.0)} for k in SHAPES},
            "plain": torch.arange(5.0) if fill else torch.zeros(5), "epoch": 3 if fill else -1}


def save(root: Path, world: int, order: list[int] | None = None) -> None:
    """An SPMD checkpoint of ``world`` ranks; ``order``: the mesh's ranks, out of order, while
    every layout claims they run in order (an index that lies)."""
    tier, refs = LocalDiskTier(root), []
    for r in range(world):
        flat = flatten(state_at(r, world, fill=True, order=order))
        if order:
            assert all(v.mesh_start is None for v in flat.layouts.values())
            flat.layouts = {i: dataclasses.replace(v, mesh_start=0) for i, v in flat.layouts.items()}
        entries, nbytes = plan_layout(flat.tensors)
        entries = [dataclasses.replace(e, layout=flat.layouts.get(e.id)) for e in entries]
        man = ShardManifest(r, CID.step, CID.generation, nbytes, entries, flat.tree, 64 << 10, world)
        reader = TensorsReader(man, [t.contiguous() for _, t in flat.tensors])
        reader.manifest = with_checksums(reader)
        refs.append(tier.write_shard(CID, reader))
    tier.commit(CID, Manifest(CID.step, CID.generation, world, refs))


def restore(root: Path, rank: int, world: int) -> tuple[dict, list[int]]:
    """Rank ``rank`` of a ``world``-rank job restores the checkpoint: its values and the shards it opened."""
    tier = Counted(root)
    state = state_at(rank, world, fill=False)
    chosen = plans(Inventory([tier]), lambda w: shard_needs(w, rank=rank, world=world, replicated=frozenset(),
                                                             holder=0))[0]
    return load_values(chosen, state, rank, world)[0], tier.opened


def check(values: dict, rank: int, world: int) -> None:
    for k in SHAPES:
        got = values["model"][k]
        assert torch.equal(got.to_local(), _local(full(k), rank, world)), k
        assert torch.equal(values["optim"][k]["exp_avg"].to_local(), _local(full(k) * 2.0, rank, world)), k
        assert values["optim"][k]["step"].item() == 7.0
    assert torch.equal(values["plain"], torch.arange(5.0)) and values["epoch"] == 3


def holders(rank: int, world: int, saved: int) -> set[int]:
    """The saved ranks whose rows of some tensor overlap ``rank``'s (torch.chunk's split)."""
    def rows(n: int, r: int, w: int) -> set[int]:
        return set(_local(torch.arange(n), r, w).tolist())

    return {s for shape in SHAPES.values() for s in range(saved)
            if rows(shape[0], s, saved) & rows(shape[0], rank, world)}


def rewrite(root: Path, rank: int, change) -> None:
    """Saved rank ``rank``'s manifest, its JSON changed by ``change``, the commit's CRC updated."""
    folder = root / CID.name
    path = folder / f"rank-{rank:05d}.json"
    doc = json.loads(path.read_bytes())
    change(doc)
    raw = dumps(doc)
    path.write_bytes(raw)
    commit = Manifest.from_bytes((folder / "manifest.json").read_bytes())
    refs = [dataclasses.replace(s, manifest_crc32c=crc32c_of(raw)) if s.rank == rank else s for s in commit.shards]
    (folder / "manifest.json").write_bytes(dataclasses.replace(commit, shards=refs).to_bytes())


@pytest.fixture(autouse=True)
def _no_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    layout._layout.cache_clear()


def test_the_anchor_says_which_shards_to_open(tmp_path: Path) -> None:
    save(tmp_path, 8)
    for rank in range(4):  # 8 -> 4: each new shard is about two saved ones
        values, opened = restore(tmp_path, rank, 4)
        check(values, rank, 4)
        assert set(opened) == {0} | holders(rank, 4, 8), opened
        assert len(opened) == len(set(opened)), "a shard opened twice"
    values, opened = restore(tmp_path, 1, 8)  # the same world size: its own shard only
    check(values, 1, 8)
    assert opened == [1]


def test_without_the_index_every_shard_is_opened(tmp_path: Path) -> None:
    save(tmp_path, 8)
    for r in range(8):  # as saved before layouts recorded where a mesh starts
        rewrite(tmp_path, r, lambda doc: [t["layout"].pop("mesh_start") for t in doc["tensors"] if "layout" in t])
    values, opened = restore(tmp_path, 1, 4)
    check(values, 1, 4)
    assert sorted(opened) == list(range(8))


def test_a_mesh_out_of_order_falls_back_to_every_shard(tmp_path: Path) -> None:
    save(tmp_path, 8, order=[0, 1, 3, 2, 4, 5, 6, 7])  # ranks 2 and 3 swapped, the layouts say "in order"
    values, opened = restore(tmp_path, 1, 4)
    check(values, 1, 4)
    assert sorted(set(opened)) == list(range(8))


def test_a_lying_index_never_gives_wrong_bytes(tmp_path: Path) -> None:
    save(tmp_path, 8)
    rewrite(tmp_path, 0, lambda doc: [t["layout"].update(mesh_start=1) for t in doc["tensors"] if "layout" in t])
    values, _ = restore(tmp_path, 1, 4)  # the mesh would end past the world: no prediction
    check(values, 1, 4)
    rewrite(tmp_path, 0, lambda doc: [t["layout"].update(mesh_start=-1) for t in doc["tensors"] if "layout" in t])
    with pytest.raises(CheckpointError, match="mesh start -1"):
        restore(tmp_path, 1, 4)


def test_hostile_mesh_start_is_refused() -> None:
    good = {"global_shape": [8], "mesh_shape": [2], "mesh_dims": [""], "placements": ["Shard(0)"],
            "coordinate": [1], "runs": [[[4, 4]]]}
    assert Layout.from_json({**good, "mesh_start": 6}, (4,), "t").mesh_start == 6
    for bad in (-1, "0", 1.5, True, 1 << 40):
        with pytest.raises(ManifestError, match="mesh start"):
            Layout.from_json({**good, "mesh_start": bad}, (4,), "t")


def test_chunk_arithmetic_is_torchs() -> None:
    """``_chunks`` (which Shard(0) chunks hold a run) against ``layout_at`` (torch's offsets)."""
    for size, n in itertools.product((0, 1, 3, 7, 16, 33), (1, 2, 3, 5, 8)):
        like = Layout((size,), (n,), ("",), ("Shard(0)",), (0,), ((),), 0)
        holders = [layout_at(like, (c,)).runs[0] for c in range(n)]
        for a, b in itertools.combinations_with_replacement(range(size + 1), 2):
            if a == b:
                continue
            want = {c for c, runs in enumerate(holders) if any(max(s, a) < min(s + k, b) for s, k in runs)}
            assert set(_chunks(size, n, ((a, b - a),))) >= want, (size, n, a, b)
