"""Elastic training: a job that continues on fewer nodes when one is lost.

    torchrun --nnodes=1:2 --nproc-per-node=8 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29400 --rdzv-id=job-42 \\
        --rdzv-conf=join_timeout=600,last_call_timeout=10 \\
        examples/train_elastic.py --root /shared/ckpt --global-batch 64

An FSDP2 (``fully_shard``) model with AdamW, checkpointed by ``ckpt.resumable``. When a
node (its torchrun agent) is lost, the ranks on the others fail their next collective;
their agents restart them in a new rendezvous round without it: ``last_call_timeout``
is how long a round waits for late nodes once ``--nnodes``' minimum is there,
``join_timeout`` how long it waits for that minimum. The restarted ranks then:

* **restore the newest checkpoint, resharded**: saved by 16 ranks, read by 8; each rank
  reads the parts of the saved shards that overlap its new ones (``ckpt/restore/reshard.py``),
  model and AdamW moments alike;
* **keep the global batch**: each rank takes ``global_batch / world`` samples a step
  (the world size must divide it), so the optimisation is the same at any size;
* **continue the data order**: ``ResumableSampler`` re-splits the rest of the epoch over
  the new ranks (no sample seen twice or skipped);
* **RNG policy**: at another world size every rank restores saved rank 0's generators
  (``RNGState``: at the same size, each its own). This model draws no per-rank random
  numbers; one that does (dropout) should fold the rank in after restoring, e.g.
  ``torch.manual_seed(torch.initial_seed() + rank)``.

The checkpoint root must be readable from every node (a shared filesystem, or
``--object-store``): a lost node's local disk is lost with it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt  # noqa: E402
from ckpt.distributed import exit_rank, init_process_group  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="checkpoint directory every node can read")
    ap.add_argument("--object-store", default=None, help="fsspec URL of the off-node tier")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4, help="checkpoint interval, steps")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--step-time", type=float, default=0.0, help="pad each step to this many seconds (tests)")
    ap.add_argument("--out", default=None, help="rank 0 appends one JSON line per step here (step, world, loss)")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(message)s")
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
    torch.manual_seed(0)  # the same initial weights on every rank, at every size
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(args.global_batch * 16, 32, generator=g))
    sampler = ckpt.ResumableSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    state = {"model": model, "optim": optim, "sampler": sampler, "rng": ckpt.RNGState()}

    mgr = ckpt.CheckpointManager(args.root, memory_dir=args.memory_dir, keep_last=2, object_store=args.object_store,
                                 run="elastic")
    out = open(args.out, "a", buffering=1) if args.out and rank == 0 else None
    batches = iter(loader)
    for step in ckpt.resumable(mgr, state, total=args.steps, every=args.every):
        t0 = time.monotonic()
        try:
            (x,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            (x,) = next(batches)
        loss = (model(x) - x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if out:
            out.write(json.dumps({"step": step + 1, "world": world, "loss": loss.item()}) + "\n")
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
    mgr.close()
    exit_rank()  # barrier, destroy the group, exit without teardown (gloo can abort it)


if __name__ == "__main__":
    main()
