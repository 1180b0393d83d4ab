"""torchrun child for test_sound_state: DDP ranks (gloo) save every step; at step ``bad``,
after its optimizer step, rank ``culprit`` goes wrong (``flip``: one bit of one parameter;
``nan``: a parameter set to NaN). The commit of that step must be suspect (unhealthy),
naming that rank; the next save raises ``UnsoundState``; a plain restore goes back to the
step before; ``step=`` still restores the suspect step. Prints one JSON line per rank."""
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group
from ckpt.errors import UnsoundState

root, memory_dir, mode, culprit, bad, steps = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = {"model": model, "opt": opt, "rng": torch.get_rng_state(), "rank": rank}
out: dict = {"rank": rank}
with CheckpointManager(root, memory_dir=memory_dir, run="sound", keep_last=100, compare_replicas=True) as mgr:
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(rank * 1000 + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == bad and rank == culprit:
            with torch.no_grad():
                p = next(model.parameters())
                if mode == "flip":
                    p.view(-1).view(torch.int32)[3] ^= 1 << 22
                else:
                    p.view(-1)[3] = float("nan")
        try:
            mgr.save(step, state)
        except UnsoundState as e:
            out.update(raised_at=step, health=e.health)
            break
        mgr.wait()  # every drain committed: every rank sees the verdict at the same save
    probe = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    target = {"model": probe, "opt": torch.optim.Adam(probe.parameters(), lr=1e-2)}
    out["restored"] = mgr.restore(target)
    out["named_restore"] = mgr.restore(target, step=bad)
    out["listing"] = {f"{r['generation']}.{r['step']}": r["health"] for r in mgr.list()}
print("SOUND " + json.dumps(out), flush=True)
exit_rank()
