"""torchrun child for test_ckpt_overlap: two ranks save every step with ``overlap=True``;
rank 1's disk is slow, so the ranks' drain queues differ. Every rank must skip the same
steps (a step skipped on one rank only would never commit), and every committed step
must restore bitwise on both ranks."""
import copy
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group
from ckpt.tiers.local import LocalDiskTier

root, memory_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    write = LocalDiskTier.write_shard
    LocalDiskTier.write_shard = lambda self, *a, **k: (time.sleep(0.3), write(self, *a, **k))[1]
torch.manual_seed(rank)
model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters())
state = {"model": model, "opt": opt}
expected = {}
with CheckpointManager(root, memory_dir=memory_dir, run="overlap", keep_last=1000, overlap=True) as mgr:
    handles = []
    for step in range(1, steps + 1):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        expected[step] = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        handles.append(mgr.save(step, state))
    mgr.wait()
    committed = sorted({i["step"] for i in mgr.list() if "disk" in i["tiers"] and i["status"] == "complete"})
    skipped = [h.step for h in handles if h.superseded_by is not None]
    agreed = [None] * dist.get_world_size()
    dist.all_gather_object(agreed, (committed, skipped))
    assert all(a == agreed[0] for a in agreed), agreed
    assert committed[-1] == steps and skipped, (committed, skipped)
    for step in committed:
        probe = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
        target = {"model": probe, "opt": torch.optim.AdamW(probe.parameters())}
        assert mgr.restore(target, step=step) == step
        got = {"model": probe.state_dict(), "opt": target["opt"].state_dict()}
        for key in ("model",):
            for name, t in got[key].items():
                assert torch.equal(t, expected[step][key][name]), (step, name)
        for p, s in expected[step]["opt"]["state"].items():
            for name, t in s.items():
                assert torch.equal(got["opt"]["state"][p][name], t), (step, p, name)
print(f"rank {rank} overlap ok: committed {committed}, skipped {skipped}", flush=True)
exit_rank()
