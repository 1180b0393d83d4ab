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

Checkpoints of sharded DTensors (FSDP2) need the global layout that restore at another
world size records and are refused with a message saying so.
"""
from __future__ import annotations

import io
import os
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
from ..format.manifest import ShardManifest, TensorEntry
from ..format.state import tree_holds, unflatten
from ..format.tensor_io import read_tensors
from ..restore.execute import LOCAL, first_sound, open_shard, restore_agreed, shard_manifest
from ..restore.plan import Inventory, RestorePlan, ShardNeed
from ..tiers.locations import tiers_for
from ..tiers.memory import DEFAULT_SHM_DIR


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
        self._tensors: dict[str, TensorEntry] = {}
        self._values: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.location = os.fspath(checkpoint_id)
        self._plan, self._tensors, self._values = None, {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(tiers_for(checkpoint_id)[-1].list())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        def manifest_of(plan: RestorePlan) -> ShardManifest:
            return shard_manifest(plan.shards[0], plan.ckpt_id)

        found = restore_agreed(LOCAL, Inventory(tiers_for(self.location, run=self.run, memory_dir=self.memory_dir)),
                               lambda world: [ShardNeed(0)],
                               manifest_of, step=self.step)
        if found is None:
            raise CheckpointError(f"no checkpoint in {self.location}")
        self._plan, manifest = found
        if tree_holds(manifest.tree, "__dtensor__"):
            raise CheckpointError("this checkpoint holds sharded DTensors (FSDP2 / tensor parallel): reading them with "
                                  "DCP needs the global layout that restore at another world size records")
        tree = unflatten(manifest.tree, lambda i: _Placeholder(manifest.tensors[i]))
        metadata: dict[str, Any] = {}

        def visit(path: tuple, value: Any) -> None:
            fqn = ".".join(map(str, path))
            if isinstance(value, _Placeholder):
                e = value.entry
                self._tensors[fqn] = e
                metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=e.torch_dtype), torch.Size(e.shape),
                                                      [ChunkStorageMetadata(torch.Size([0] * len(e.shape)),
                                                                            torch.Size(e.shape))])
            else:
                self._values[fqn] = value
                metadata[fqn] = BytesStorageMetadata()

        traverse_state_dict(tree, visit, keep_traversing=lambda v: isinstance(v, _Placeholder))
        return Metadata(state_dict_metadata=metadata)

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
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._values[item.storage_index.fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
        wanted = {self._tensors[r.storage_index.fqn].id for r in tensor_items}
        shard, ckpt_id = self._plan.shards[0], self._plan.ckpt_id

        def read(tier: Any) -> list[torch.Tensor | None]:
            reader = open_shard(tier, ckpt_id, shard.rank)
            try:
                return read_tensors(reader, step=ckpt_id.step, tier=tier.name, only=wanted)
            finally:
                reader.close()

        tensors = first_sound(shard, ckpt_id, read)
        for item in tensor_items:
            src = narrow_tensor_by_index(tensors[self._tensors[item.storage_index.fqn].id], item.storage_offsets,
                                         item.lengths)
            dst = planner.resolve_tensor(item).detach()
            dst.copy_(src)
            planner.commit_tensor(item, dst)
        done: Future[None] = Future()
        done.set_result(None)
        return done

