"""torchrun child (2 ranks, gloo): saves through disk to a file:// object store, then a
"fresh node" (another disk root, another memory namespace) restores from the store alone."""
import sys

import torch
import torch.distributed as dist

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group

out, shm = sys.argv[1], sys.argv[2]
init_process_group("gloo")
rank = dist.get_rank()
url = f"file://{out}/store"
state = {"w": torch.full((1000,), float(rank)), "step": 0}
with CheckpointManager(f"{out}/disk", object_store=url, memory_dir=shm, run="a", keep_last={"object": 2}) as mgr:
    for step in (1, 2, 3):
        state["w"] += 1
        state["step"] = step
        mgr.save(step, state).wait()
got = {"w": torch.zeros(1000), "step": None}
with CheckpointManager(f"{out}/fresh", object_store=url, memory_dir=shm, run="a") as mgr:  # same job, new nodes
    assert mgr.restore(got) == 3
assert torch.equal(got["w"], torch.full((1000,), rank + 3.0)) and got["step"] == 3, got
print(f"objstore dist ok rank {rank}", flush=True)
exit_rank()
