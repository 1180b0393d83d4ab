"""Child process for test_ckpt_hostile: check_restorable compares a DTensor by its local
shard and tells DTensors from plain tensors. Runs alone because it starts a (one-rank,
in-memory) process group, which would change how every later CheckpointManager in the
test process sees the world. It leaves through exit_rank (ckpt/recovery/leaving.py)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckpt.format.state import flatten
from ckpt.recovery.leaving import exit_rank
from ckpt.restore.state_load import StateMismatch, check_restorable
from ckpt.tiers.memory.copier import plan_layout

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


def dtensor(*shape: int) -> torch.Tensor:
    return distribute_tensor(torch.zeros(*shape), mesh, [Shard(0)])


flat = flatten({"w": dtensor(8, 4), "p": torch.zeros(3)})
entries, _ = plan_layout(flat.tensors)
check_restorable({"w": dtensor(8, 4), "p": torch.ones(3)}, flat.tree, entries)
try:
    check_restorable({"w": dtensor(8, 5), "p": dtensor(3)}, flat.tree, entries)
except StateMismatch as e:
    print(e, flush=True)
exit_rank()
