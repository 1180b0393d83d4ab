"""torchrun child for test_ckpt_import: an FSDP2 model and its AdamW state saved the
torchtitan way (``get_state_dict``, ``dcp.save``) by every rank, each writing its own
shards; rank 0 also writes the whole tensors (``full_tensor()``) as the reference, named by their
path in the state joined with "/"."""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckpt.distributed import exit_rank, init_process_group
from tests.test_ckpt_import import Net

out, reference = sys.argv[1], sys.argv[2]
init_process_group("gloo")
model = Net(0)
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters())
torch.manual_seed(1 + dist.get_rank())
model(torch.randn(3, 8)).sum().backward()
optim.step()
msd, osd = get_state_dict(model, optim)
assert all(isinstance(t, DTensor) for t in msd.values()), "the test needs sharded tensors"
dcp.save({"model": msd, "optim": osd, "epoch": 3}, checkpoint_id=out)
whole = {f"model/{k}": v.full_tensor() for k, v in msd.items()}
whole.update({f"optim/state/{p}/{k}": v.full_tensor() if isinstance(v, DTensor) else v
              for p, moments in osd["state"].items() for k, v in moments.items()})
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in whole.items()}, reference)
exit_rank()
