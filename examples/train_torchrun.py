"""Train a small GPT-style model with DDP under torchrun, checkpointed by ckpt-guard.

    torchrun --nproc-per-node=2 --max-restarts=3 examples/train_torchrun.py --root /tmp/ckpt-demo

Kill any worker at any moment: torchrun restarts the group, every rank restores the
newest step all ranks hold (from shared memory when it survived), and training goes
on exactly where it was. ``--faults 13,25:save`` makes rank 1 SIGKILL itself the
first time it completes step 13, and the moment its snapshot of step 25 is sealed in
memory, while that checkpoint drains to disk; ``--faults 12:stop`` SIGSTOPs rank 1
as it begins step 12 and ``12:hang`` makes it sleep there for ever (alive, as in a
stuck kernel): hung ranks for the hang detector (the fault injector the tests use; each
fault fires once, remembered by a marker file in the root).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt  # noqa: E402
from ckpt.distributed import exit_rank, init_process_group  # noqa: E402
from ckpt.recovery.watchdog import HangDetection  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def synthetic_corpus(n: int, cfg: GPTConfig, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (n, cfg.context + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


FAULT_KINDS = ("kill", "save", "stop", "hang")


def parse_faults(spec: str) -> dict[int, str]:
    """'13,25:save,30:stop' -> {13: "kill", 25: "save", 30: "stop"}: step -> SIGKILL after it,
    SIGKILL during its save, SIGSTOP as it begins, sleep for ever as it begins ("hang")."""
    faults = {}
    for f in filter(None, spec.split(",")):
        step, _, kind = f.partition(":")
        if (kind or "kill") not in FAULT_KINDS:
            raise SystemExit(f"--faults: unknown kind {kind!r} in {f!r} (one of {', '.join(FAULT_KINDS)})")
        faults[int(step)] = kind or "kill"
    return faults


def kill_when_sealed(mgr: ckpt.CheckpointManager, step: int) -> None:
    """SIGKILL this process as soon as its memory snapshot of ``step`` is sealed."""
    def watch() -> None:
        while not mgr.memory.holds(step):
            time.sleep(0.0005)
        logging.info("fault injector: SIGKILL rank %d at step %d during save (%.3f)", dist.get_rank(), step,
                     time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="checkpoint directory (local-disk tier)")
    ap.add_argument("--object-store", default=None,
                    help="fsspec URL of the off-node tier (file:///..., s3://bucket/prefix; endpoint from "
                         "AWS_ENDPOINT_URL)")
    ap.add_argument("--run", default=None, help="run id (default: TORCHELASTIC_RUN_ID or 'default')")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5, help="periodic checkpoint interval, steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="", help="fault injection for tests, e.g. '13,27:save'")
    ap.add_argument("--fault-rank", type=int, default=1, help="the rank that faults or asks for --urgent-at")
    ap.add_argument("--urgent-at", type=int, default=None,
                    help="that rank alone requests an urgent checkpoint after this step (all ranks must take it)")
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--peers", type=int, default=0,
                    help="keep each rank's newest snapshot in the memory of this many other nodes (CKPT_GUARD_NODE)")
    ap.add_argument("--out", default=None, help="rank 0 writes the final weights digest and timings here (JSON)")
    ap.add_argument("--predictor", default=None,
                    help="predictor URL: take urgent checkpoints on its alarms (job token in $CKPT_GUARD_JOB_TOKEN)")
    ap.add_argument("--elevated-every", type=int, default=None, help="checkpoint interval while a node is at risk")
    ap.add_argument("--step-time", type=float, default=0.0, help="pad each step to this many seconds (demos)")
    ap.add_argument("--timeline", default=None, help="rank 0 appends one JSON line per completed step here")
    ap.add_argument("--hang-deadline", type=float, default=None,
                    help="declare a rank hung after this many seconds without a step boundary (default: derived)")
    ap.add_argument("--no-hang-detection", action="store_true", help="today's behaviour: wait for the timeouts")
    ap.add_argument("--pg-timeout", type=float, default=600.0, help="the training process group's timeout, s")
    ap.add_argument("--slow-first-step", type=float, default=0.0,
                    help="the fault rank's first step of every incarnation takes this many seconds longer")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(message)s")
    init_process_group(timeout=timedelta(seconds=args.pg_timeout))  # restart-safe under torchrun
    rank, incarnation = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    cfg = GPTConfig.tiny()
    model = DDP(GPT(cfg).to(device))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    data = synthetic_corpus(args.batch * args.steps, cfg)
    sampler = ckpt.ResumableSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch // dist.get_world_size(), sampler=sampler, drop_last=True)
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "rng": ckpt.RNGState()}

    faults = parse_faults(args.faults) if rank == args.fault_rank else {}
    mgr = ckpt.CheckpointManager(args.root, run=args.run or os.environ.get("TORCHELASTIC_RUN_ID"),
                                 memory_dir=args.memory_dir, keep_last=2, replicated=("model", "optim", "sched"),
                                 object_store=args.object_store, state=state, peers=args.peers)
    t_start = time.time()
    batches = iter(loader)
    first = None
    requests = ckpt.SaveRequests()
    timeline = open(args.timeline, "a", buffering=1) if args.timeline and rank == 0 else None
    hang = HangDetection(enabled=not args.no_hang_detection, deadline_s=args.hang_deadline)
    for step in ckpt.resumable(mgr, state, total=args.steps, every=args.every, requests=requests,
                               predictor=args.predictor, elevated_every=args.elevated_every, hang=hang):
        t_step = time.monotonic()
        if first is None:
            first = step
            logging.info("incarnation %d: first step %d at %.3f", incarnation, step, time.time())
            if rank == args.fault_rank:
                time.sleep(args.slow_first_step)
        if faults.get(step) in ("stop", "hang") and not (marker := Path(args.root) / f"fault-{step}.fired").exists():
            marker.touch()
            logging.info("fault injector: %s rank %d at step %d (%.3f)", "SIGSTOP" if faults[step] == "stop" else
                         "hang", rank, step, time.time())
            if faults[step] == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while faults[step] == "hang":
                time.sleep(60)
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        logits = model(x.to(device))  # through DDP: its forward arms the backward's gradient all-reduce
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t_step)))
        if timeline:
            timeline.write(json.dumps({"step": step + 1, "t": time.time(), "incarnation": incarnation}) + "\n")
        if rank == args.fault_rank and step + 1 == args.urgent_at:
            requests.request()
        marker = Path(args.root) / f"fault-{step + 1}.fired"
        if faults.get(step + 1) in ("kill", "save") and not marker.exists():
            marker.touch()
            if faults[step + 1] == "save":
                kill_when_sealed(mgr, step + 1)  # the loop's save at this boundary triggers it
            else:
                logging.info("fault injector: SIGKILL rank %d at step %d (%.3f)", rank, step + 1, time.time())
                os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({"digest": weights_digest(model.module), "first_step": first,
                                              "incarnation": incarnation, "seconds": time.time() - t_start}))
    exit_rank()  # barrier, destroy the group, exit without teardown (gloo can abort it)


if __name__ == "__main__":
    main()
