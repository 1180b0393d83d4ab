"""The demo's training job (``make demo``): one script for both of its runs, written for
``ckpt.inprocess.run``, so the two runs differ only in how they are launched.

    python -m ckpt.inprocess.launch --nodes 3 --spare-nodes 1 ... examples/demo_train.py --predictor URL ...
    torchrun --nproc-per-node 2 examples/demo_train.py ...

A small GPT trained data-parallel (DDP on gloo, CPU), each step padded to ``--step-time``,
a checkpoint every ``--every`` steps (memory, disk, peers with ``--peers``, the object store).
With ``--predictor`` every rank listens (its own node registered as a job): an alarm makes the
next step save urgently on every rank, then every ``--elevated-every`` steps while a node is at
risk. Rank 0 appends one JSON line per completed step to ``--timeline``.
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
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt  # noqa: E402
import ckpt.inprocess  # noqa: E402
from ckpt.distributed import exit_rank  # noqa: E402
from ckpt.integrations.risk import RiskListener, read_token  # noqa: E402
from ckpt.peers.placement import node_name  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

BATCH = 8  # global: split over the ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="this node's disk tier")
    ap.add_argument("--memory-dir", default="/dev/shm", help="this node's memory tier")
    ap.add_argument("--object-store", default=None, help="the job's off-node tier (fsspec URL)")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=120, help="checkpoint interval, steps")
    ap.add_argument("--elevated-every", type=int, default=None, help="the interval while a node is at risk")
    ap.add_argument("--step-time", type=float, default=0.5, help="pad each step to this many seconds")
    ap.add_argument("--peers", type=int, default=0, help="replicas of each rank's snapshot on other nodes")
    ap.add_argument("--predictor", default=None, help="predictor URL (job token in $CKPT_GUARD_JOB_TOKEN)")
    ap.add_argument("--timeline", default=None, help="rank 0 appends one JSON line per completed step here")
    args = ap.parse_args()
    worker = os.environ.get("CKPT_INPROCESS_WORKER", os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {node_name()} w{worker} %(message)s")
    torch.set_num_threads(1)
    cfg = GPTConfig.tiny()
    listener = None
    if args.predictor:  # on every rank: each agrees at every boundary whether any rank heard an alarm
        listener = RiskListener(args.predictor, [node_name()], ckpt.SaveRequests(), token=read_token(),
                                name=f"demo-{node_name()}-w{worker}").start()
    timeline = open(args.timeline, "a", buffering=1) if args.timeline else None

    def build(ctx: ckpt.inprocess.Context) -> dict:
        torch.manual_seed(0)
        model = DDP(GPT(cfg))  # on this round's group
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        return {"model": model, "optim": optim, "rng": ckpt.RNGState(), "ctx": ctx}

    def step(objects: dict, i: int) -> float:
        t0, ctx = time.monotonic(), objects["ctx"]
        g = torch.Generator().manual_seed(i)  # step i's global batch, this rank's share of it
        tokens = torch.randint(0, cfg.vocab, (BATCH, cfg.context + 1), generator=g)
        share = BATCH // ctx.world_size
        x, y = tokens[ctx.rank * share:(ctx.rank + 1) * share, :-1], tokens[ctx.rank * share:(ctx.rank + 1) * share, 1:]
        logits = objects["model"](x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        objects["optim"].zero_grad(set_to_none=True)
        loss.backward()
        objects["optim"].step()
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
        if timeline is not None and ctx.rank == 0:
            timeline.write(json.dumps({"step": i + 1, "t": time.time(), "worker": int(worker), "round": ctx.round})
                           + "\n")
        return float(loss.detach())

    def warm_up() -> None:  # a spare, while it waits: its first step's one-off costs, paid now
        import torch._dynamo  # noqa: F401 - DDP's first construction imports it (800 modules: 4-17 s on this box)

        model = GPT(cfg)
        model(torch.zeros(1, cfg.context, dtype=torch.long)).sum().backward()

    ckpt.inprocess.run(build, step, steps=args.steps, save_every=args.every, elevated_every=args.elevated_every,
                       state_of=lambda o: {k: o[k] for k in ("model", "optim", "rng")},
                       checkpoint={"root": args.root, "run": "demo", "memory_dir": args.memory_dir, "keep_last": 2,
                                   "replicated": ["model", "optim"], "object_store": args.object_store,
                                   "peers": args.peers},
                       warm_up=warm_up, listener=listener)
    exit_rank(0)


if __name__ == "__main__":
    main()
