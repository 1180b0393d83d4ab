"""Reading our checkpoints with ``torch.distributed.checkpoint.load`` and its own planner:

    import torch.distributed.checkpoint as dcp
    from ckpt.dcp_reader import CheckpointReader
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 0}
    dcp.load(state, storage_reader=CheckpointReader("/nvme/ckpt/run-42"))

``read_metadata`` describes rank 0's shard of the newest valid checkpoint (or ``step``)
the way DCP names a state dict: tensors by their dotted path, as one chunk each; the
other values as DCP's "bytes" items, at the paths DCP's own traversal gives them. Tensor
bytes come through our tiers' readers, every chunk verified against its CRC32C; plain
values are decoded from our JSON tree and handed over in DCP's format (serialised here,
from values that never were pickled on disk). There is no writer: DCP stores some items
as pickles, which our format never holds.

Modules and optimizers are described both ways: as saved (``model.state_dict()``,
``optim.state_dict()``) and as ``get_state_dict`` names them (no ``module.`` prefix; an
optimizer whose parameters' names are recorded keyed by those names), so
``dcp.load`` into ``get_state_dict``'s dicts then ``set_state_dict`` matches moments by name
(the one restore path's rule, invariant 14) whatever order the loading optimizer has.

A sharded DTensor (FSDP2, tensor parallel) is described whole, at its global shape; each
region DCP asks for is read from the saved shards overlapping it (``plan.reshard_reads``,
as restore at another world size does). Checkpoints from before the layout record (format
1.1) hold no such record: their DTensors are refused with the reason.
"""
from __future__ import annotations

import io
import os
from functools import partial
from itertools import groupby
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ..errors import CheckpointError
from ..format.layout import Layout
from ..format.manifest import ShardManifest, TensorEntry
from ..format.state import tree_holds, unflatten
from ..format.tensor_io import read_chunks, read_tensors
from ..restore.execute import LOCAL, first_sound, open_shard, restore_agreed, shard_manifest
from ..restore.optim_names import keyed_by_name
from ..restore.plan import Inventory, RestorePlan, ShardNeed, every_shard, reshard_reads
from ..restore.reshard import require_layouts
from ..tiers.base import CheckpointId
from ..tiers.locations import tiers_for
from ..tiers.memory import DEFAULT_SHM_DIR


def _read_chunks(tier: Any, *, ckpt_id: CheckpointId, rank: int, reads: list, dests: dict) -> None:
    reader = open_shard(tier, ckpt_id, rank)
    try:
        read_chunks(reader, reads, dests, step=ckpt_id.step, tier=tier.name)
    finally:
        reader.close()


class _Placeholder:
    """Stands for a saved tensor while DCP's traversal names the tree's leaves."""

    def __init__(self, entry: TensorEntry) -> None:
        self.entry = entry


class CheckpointReader(StorageReader):
    def __init__(self, location: str | os.PathLike, *, step: int | None = None, run: str | None = None,
                 memory_dir: str = DEFAULT_SHM_DIR) -> None:
        super().__init__()
        self.location, self.step, self.run, self.memory_dir = os.fspath(location), step, run, memory_dir
        self._plan: RestorePlan | None = None
        self._manifests: dict[int, ShardManifest] = {}
        self._tensors: dict[str, TensorEntry] = {}
        self._values: dict[str, Any] = {}
        self._by_name: dict[str, Any] = {}  # an optimizer's param_groups.N.params as names, where asked so

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.location = os.fspath(checkpoint_id)
        self._plan, self._manifests, self._tensors, self._values, self._by_name = None, {}, {}, {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(tiers_for(checkpoint_id)[-1].list())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        inventory = Inventory(tiers_for(self.location, run=self.run, memory_dir=self.memory_dir))

        def manifests_of(plan: RestorePlan) -> tuple[RestorePlan, dict[int, ShardManifest]]:
            first = shard_manifest(plan.shards[0], plan.ckpt_id)
            if plan.world_size == 1 or not tree_holds(first.tree, "__dtensor__"):
                return plan, {0: first}  # rank 0 holds it all, whole
            plan = every_shard(inventory, plan, "it holds sharded DTensors")
            return plan, {s.rank: first if s.rank == 0 else shard_manifest(s, plan.ckpt_id) for s in plan.shards}

        found = restore_agreed(LOCAL, inventory, lambda world: [ShardNeed(0)], manifests_of, step=self.step)
        if found is None:
            raise CheckpointError(f"no checkpoint in {self.location}")
        self._plan, self._manifests = found[1]
        if self._plan.world_size > 1:  # format 1.1 recorded no layout: a DTensor's shard is not the tensor
            require_layouts(self._manifests, self._plan.ckpt_id)
        manifest = self._manifests[0]
        tree = unflatten(manifest.tree, lambda i: _Placeholder(manifest.tensors[i]))
        metadata: dict[str, Any] = {}

        def visit(path: tuple, value: Any, named: bool = False) -> None:
            fqn = ".".join(map(str, path))
            if named:  # the same values keyed by parameter name: aliases, for get_optimizer_state_dict's layout
                if fqn not in metadata:
                    visit(path, value)
                elif not isinstance(value, _Placeholder) and value != self._values.get(fqn):
                    self._by_name[fqn] = value
                return
            if isinstance(value, _Placeholder):
                e = value.entry
                self._tensors[fqn] = e
                shape = e.layout.global_shape if e.layout is not None else e.shape  # a DTensor: whole
                metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=e.torch_dtype), torch.Size(shape),
                                                      [ChunkStorageMetadata(torch.Size([0] * len(shape)),
                                                                            torch.Size(shape))])
            else:
                self._values[fqn] = value
                metadata[fqn] = BytesStorageMetadata()

        traverse_state_dict(tree, visit, keep_traversing=lambda v: isinstance(v, _Placeholder))
        named = keyed_by_name(tree, manifest.param_names, lambda v: isinstance(v, _Placeholder))
        traverse_state_dict(named, partial(visit, named=True),
                            keep_traversing=lambda v: isinstance(v, _Placeholder))
        return Metadata(state_dict_metadata=metadata)

    def _region(self, e: TensorEntry, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """A box of a DTensor's global tensor, read from the saved chunks that overlap it."""
        assert self._plan is not None
        region = Layout(e.layout.global_shape, (), (), (), (), tuple(((o, n),) if n else () for o, n in
                                                                      zip(offsets, lengths)))
        out = torch.empty(lengths, dtype=e.torch_dtype)
        dest = {e.path: out.reshape(1) if out.dim() == 0 else out}
        shards, ckpt_id = {s.rank: s for s in self._plan.shards}, self._plan.ckpt_id
        for r, group in groupby(sorted(reshard_reads(self._manifests, {e.path: region}, 0), key=lambda rd: rd.rank),
                                key=lambda rd: rd.rank):
            first_sound(shards[r], ckpt_id, partial(_read_chunks, ckpt_id=ckpt_id, rank=r, reads=list(group),
                                                    dests=dest))
        return out

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._plan is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._plan is not None, "read_metadata comes first"
        tensor_items = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        wanted = getattr(planner, "state_dict", {})
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                fqn, buf = item.storage_index.fqn, io.BytesIO()
                mine = wanted.get(fqn) if isinstance(wanted, dict) else None
                by_name = fqn in self._by_name and isinstance(mine, list) and all(isinstance(p, str) for p in mine)
                torch.save(self._by_name[fqn] if by_name else self._values[fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
        plain = [r for r in tensor_items if self._tensors[r.storage_index.fqn].layout is None]
        wanted = {self._tensors[r.storage_index.fqn].id for r in plain}
        shard, ckpt_id = self._plan.shards[0], self._plan.ckpt_id

        def read(tier: Any) -> list[torch.Tensor | None]:
            reader = open_shard(tier, ckpt_id, shard.rank)
            try:
                return read_tensors(reader, step=ckpt_id.step, tier=tier.name, only=wanted)
            finally:
                reader.close()

        tensors = first_sound(shard, ckpt_id, read) if plain else []
        for item in tensor_items:
            e = self._tensors[item.storage_index.fqn]
            if e.layout is None:
                src = narrow_tensor_by_index(tensors[e.id], item.storage_offsets, item.lengths)
            else:  # the region DCP asks for, from the saved shards overlapping it
                src = self._region(e, tuple(item.storage_offsets), tuple(item.lengths))
            dst = planner.resolve_tensor(item).detach()
            dst.copy_(src)
            planner.commit_tensor(item, dst)
        done: Future[None] = Future()
        done.set_result(None)
        return done

