"""torchrun child for test_distributed_torchrun: DTensor state (what FSDP2 and tensor
parallelism hold) is saved as each rank's local shard and restored in place."""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group

root, memory_dir = sys.argv[1], sys.argv[2]
init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": distribute_tensor(full[0], mesh, [Replicate()]),
         "step": 7}
local = state["w"].to_local()
with CheckpointManager(root, memory_dir=memory_dir, run="dtensor") as mgr:
    mgr.save(7, state).wait()
    ptr = local.data_ptr()
    local.zero_()
    state["b"].to_local().zero_()
    assert mgr.restore(state) == 7
assert state["w"].to_local().data_ptr() == ptr, "restore must write into the DTensor's own shard"
assert torch.equal(state["w"].full_tensor(), full) and torch.equal(state["b"].full_tensor(), full[0])
assert state["w"].to_local().shape == (8 // dist.get_world_size(), 8)
print(f"rank {dist.get_rank()} dtensor ok", flush=True)
exit_rank()
