"""The README's quick start, runnable as is: a single-process loop that restores at start-up,
saves every 50 steps and at the end, and survives SIGTERM (an urgent save, then exit 143).

    python examples/quickstart.py /tmp/ckpt-quickstart   # run it, kill it, run it again
"""
import sys

import torch

import ckpt

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ckpt-quickstart"
model = torch.nn.Linear(16, 4)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = ckpt.ResumableSampler(range(10_000))  # remembers where the epoch stood
state = {"model": model, "optim": optim, "sampler": data, "rng": ckpt.RNGState()}

# its end frees the shared memory; an error or SIGTERM keeps it for the restart (keep_memory=True: always)
with ckpt.CheckpointManager(root, keep_last=3, state=state) as mgr:
    for step in ckpt.resumable(mgr, state, total=200, every=50):  # restores first; saves; SIGTERM-safe
        loss = model(torch.randn(32, 16)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}")

print("weights of the last step:", sorted(ckpt.load(root)["model"]))
