"""One rank of a job under NVRx's in-process restarts with our tiers as its state source
(``ckpt.integrations.nvrx.run``), run by tests/test_nvrx.py in an interpreter that has
nvidia-resiliency-ext. An MLP, a global batch split over the ranks left, a checkpoint every
step (overlapped).

    python tests/nvrx_child.py --root DIR --events FILE --memory-dir D --steps N
        [--kill-rank R --kill-at S [--fault kill|stop]] [--resume-step S]

The rank started as ``--kill-rank`` SIGKILLs (``stop``: SIGSTOPs, a hung rank) itself before
step ``--kill-at``; every rank logs
its steps, the recovery and, at the end, a digest of its weights.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_workers import NVRX_TIMEOUTS  # noqa: E402 - the benchmark's NVRx timeouts
from ckpt.inprocess.runner import Context, Recovery  # noqa: E402
from ckpt.integrations.nvrx import run  # noqa: E402

GLOBAL_BATCH = 12  # 3 or 2 ranks split it evenly


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--memory-dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--fault", choices=["kill", "stop"], default="kill")
    ap.add_argument("--resume-step", type=int, default=None)
    args = ap.parse_args()
    initial = int(os.environ["RANK"])

    def emit(**event) -> None:
        with open(args.events, "a") as f:
            f.write(json.dumps({"rank0": initial, "pid": os.getpid(), "t": time.time(), **event}) + "\n")

    def build(ctx: Context) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "ctx": ctx}

    def step(objects: dict, i: int) -> None:
        ctx, model, optim = objects["ctx"], objects["model"], objects["optim"]
        if initial == args.kill_rank and i == args.kill_at:
            emit(event="fault", step=i)
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        share = GLOBAL_BATCH // ctx.world_size
        mine = slice(ctx.rank * share, (ctx.rank + 1) * share)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        optim.step()
        emit(event="step", step=i + 1, world=ctx.world_size, iteration=ctx.round)

    def on_recovery(r: Recovery) -> None:
        emit(event="recovery", **r.__dict__)

    result = run(build, step, steps=args.steps, state_of=lambda o: {"model": o["model"], "optim": o["optim"]},
                 checkpoint={"root": args.root, "memory_dir": args.memory_dir, "keep_last": 1000,
                             "replicated": ["model", "optim"], "overlap": True},
                 resume_step=args.resume_step, collective_timeout_s=5.0, on_recovery=on_recovery,
                 **NVRX_TIMEOUTS,  # NVRx's store on the port run() agrees on
                 monitor_process_logfile=str(Path(args.events).resolve().parent / "nvrx-monitor-{rank}.log"))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in result.objects["model"].parameters()))
    emit(event="done", steps=result.steps_done, digest=digest.hexdigest(), world=result.objects["ctx"].world_size)


if __name__ == "__main__":
    main()
