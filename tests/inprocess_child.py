"""A worker of ``python -m ckpt.inprocess.launch`` for tests and the recovery benchmark: a small
MLP trained data-parallel on gloo (gradients all-reduced by hand), a fixed global batch split
over however many ranks are left, a checkpoint every step.

    inprocess_child.py --root DIR --steps N --events FILE [--kill-worker W --kill-at S] [--resume-step S]
        [--evict-worker W | --node-failed-gpu G | --stall-worker W] --kill-at S [--alarm-at S --save-every N]
        [--memory-dir D] [--peers 1 | --object-store URL] [--model gpt] [--overlap] [--loader-workers N] [--own-dirs]

Each worker appends JSON lines to ``--events``: start (pid), recovery (phases), done (weights digest).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ckpt.distributed import exit_rank
from ckpt.inprocess import Context, Recovery, group, membership, run
from ckpt.integrations.data import ResumableDataLoader, ResumableSampler
from ckpt.integrations.risk import RiskListener
from ckpt.integrations.urgency import SaveRequests
from ckpt.peers.placement import node_name
from tests.procs import running, stat_fields

GLOBAL_BATCH = 12  # divisible by 3, 2 and 1: the global batch is kept when the world shrinks


def resources() -> dict[str, int]:
    """What a survivor holds: threads, open fds, resident KiB (nothing may grow per recovery)."""
    rss_pages = int(open("/proc/self/statm").read().split()[1])
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "children": len(children()),
            "rss_kib": rss_pages * os.sysconf("SC_PAGE_SIZE") // 1024,
            "fd_targets": sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                 if os.path.exists(f"/proc/self/fd/{fd}"))}


def children() -> list[int]:
    """This process's live child processes (a data loader's workers)."""
    out = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if int(stat_fields(pid)[1]) == os.getpid() and running(pid):
                out.append(pid)
        except (OSError, IndexError):
            continue
    return out


def flip_bit(t: torch.Tensor, bit: int = 22) -> None:
    """Flip one bit of a float32 tensor's first element in place (a silent data corruption)."""
    t.detach().view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--events", required=True)
    ap.add_argument("--kill-worker", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank-every", type=int, default=0,
                    help="the worker at rank 1 SIGKILLs itself every this many steps (after a step of its own)")
    ap.add_argument("--hang", action="store_true", help="SIGSTOP instead of SIGKILL (the launcher must kill it)")
    ap.add_argument("--evict-worker", type=int, default=-1,
                    help="at --kill-at, worker 0 asks the launcher to evict this worker (an XID 79 on its GPU)")
    ap.add_argument("--node-failed-gpu", type=int, default=-1,
                    help="at --kill-at, worker 0's predictor listener hears node_failed for this GPU of its node")
    ap.add_argument("--stall-worker", type=int, default=-1,
                    help="this worker sleeps at the end of step --kill-at: alive and beating, never stepping again")
    ap.add_argument("--sdc", choices=("param", "optim", "nan_forward", "grad"), default=None,
                    help="at --kill-at, worker --sdc-worker goes silently wrong once (benchmarks/fault_campaign.py): a "
                    "bit flipped in a parameter after its optimizer step, in its optimizer state, a NaN loss from "
                    "its forward, or a bit flipped in its local gradient before the all-reduce")
    ap.add_argument("--sdc-worker", type=int, default=1)
    ap.add_argument("--sdc-rounds", type=int, default=1,
                    help="the --sdc fault comes back in each of the first N rounds of the first launch (a device "
                    "that keeps going wrong: the launcher's bound on going back in process)")
    ap.add_argument("--canary", action="store_true", help="each step returns its loss: the runner records it (the "
                    "canary's reference, and its check after a restore)")
    ap.add_argument("--canary-fault", choices=("once", "always"), default=None,
                    help="in the first step after a restore (once in this process, or after every one), every "
                    "rank's parameters are not what was saved (0.1 added): the canary must fail (implies --canary)")
    ap.add_argument("--slow-worker", type=int, default=-1, help="this worker sleeps --slow-s per step (a straggler)")
    ap.add_argument("--slow-s", type=float, default=0.3)
    ap.add_argument("--kill-in-recovery", type=int, default=-1,
                    help="this worker (a spare) SIGKILLs itself as it builds in round 1: a second fault in a recovery")
    ap.add_argument("--lmr", action="store_true", help="after each step, lm-resiliency's C3 compares parameters and "
                    "optimizer state across the ranks (its SDC check; events 'lmr')")
    ap.add_argument("--alarm-at", type=int, default=-1,
                    help="in step --alarm-at, worker 0's predictor listener hears \"checkpoint now\" (as on the alarm)")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--listen", action="store_true",
                    help="start the predictor listener (nothing listens at its address: the predictor is down)")
    ap.add_argument("--peer-fault", choices=("wrong_at_save", "stall_receive"), default=None,
                    help="on node --peer-fault-node, the first peer replica of step >= --kill-at it receives is "
                    "sealed with a byte flipped, or held as it is received (benchmarks/fault_campaign_hooks.py)")
    ap.add_argument("--peer-fault-node", default="node0")
    ap.add_argument("--own-copies", action="store_true",
                    help="every rank saves its own copy of the model and optimizer (not replicated=: one a node)")
    ap.add_argument("--log-info", action="store_true", help="log the library's INFO lines (uploads, retries)")
    ap.add_argument("--resume-step", type=int, default=None)
    ap.add_argument("--step-s", type=float, default=0.0, help="sleep per step (a slower model)")
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                    help="gpt: the recovery benchmark's model (benchmarks/recovery_model.py), as every engine's row")
    ap.add_argument("--overlap", action="store_true",
                    help="overlapped snapshots every step (superseded drains skipped, not paced: the peer "
                    "replicas a lost node restores from must keep up)")
    ap.add_argument("--loader-workers", type=int, default=-1,
                    help="N >= 0: the MLP's batches come from a ResumableDataLoader with N worker processes, "
                    "its position in the checkpointed state (rebuilt and rewound by each recovery)")
    ap.add_argument("--memory-dir", default="/dev/shm", help="this node's memory tier")
    ap.add_argument("--peers", type=int, default=0, help="peer replicas on other nodes (CKPT_GUARD_NODE)")
    ap.add_argument("--object-store", default=None, help="the job's shared object store (file://DIR)")
    ap.add_argument("--own-dirs", action="store_true",
                    help="each worker its own disk root and memory dir (ROOT/wN, MEMORY_DIR/wN: a node of its own), "
                    "which the killed worker wipes as it dies (its node lost with it)")
    args = ap.parse_args()
    if args.log_info:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    inprocess = "CKPT_INPROCESS_WORKER" in os.environ  # else under plain torchrun: the same script, relaunched
    worker = int(os.environ.get("CKPT_INPROCESS_WORKER", os.environ.get("RANK", "0")))
    if args.own_dirs:
        args.root, args.memory_dir = f"{args.root}/w{worker}", f"{args.memory_dir}/w{worker}"
        os.makedirs(args.memory_dir, mode=0o700, exist_ok=True)
    attempt = os.environ.get(membership.ATTEMPT_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    recovery_model = importlib.import_module("benchmarks.recovery_model") if args.model == "gpt" else None

    def emit(**event) -> None:
        with open(args.events, "a") as f:
            f.write(json.dumps({"worker": worker, "pid": os.getpid(), "t": time.time(), **event}) + "\n")

    emit(event="start")
    if args.peer_fault and node_name() == args.peer_fault_node:
        importlib.import_module("benchmarks.fault_campaign_hooks").install(args.peer_fault, args.kill_at, emit)
    evicted: list[int] = []
    listener = RiskListener("http://127.0.0.1:9", [node_name()], SaveRequests())  # fed by hand; started: down
    if args.listen:
        listener.start()
    store = membership.worker_store(60.0) if inprocess else None  # under torchrun: no launcher, no store of ours

    def build(ctx: Context) -> dict:
        if worker == args.kill_in_recovery and ctx.round == 1:
            emit(event="fault", step=None)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.model == "gpt":
            model, optim = recovery_model.model()
            return {"model": model, "optim": optim, "ctx": ctx, "first": True}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        objects = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "ctx": ctx,
                   "first": True}
        if args.loader_workers >= 0:  # 4 steps an epoch: the runs cross epochs
            g = torch.Generator().manual_seed(7)
            n = 4 * GLOBAL_BATCH
            data = TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g))
            sampler = ResumableSampler(data, seed=3, rank=ctx.rank, world_size=ctx.world_size)
            objects["loader"] = ResumableDataLoader(data, sampler=sampler, batch_size=GLOBAL_BATCH // ctx.world_size,
                                                    num_workers=args.loader_workers)
        return objects

    def next_batch(objects: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The loader's next batch; its iterator (and worker processes) made after the restore,
        anew at each epoch."""
        for _ in range(2):
            it = objects.setdefault("batches", iter(objects["loader"]))
            try:
                return next(it)
            except StopIteration:
                del objects["batches"]
        raise RuntimeError("the loader is empty")

    own_steps: list[int] = []
    perturbed: list[int] = []

    def spares_ready() -> None:
        """The fault waits for the job's spares to be warm (a busy machine may still be importing
        torch in them): what is measured is a fault with a spare ready, not a start-up race."""
        if not inprocess:  # torchrun has no spares
            return
        spares = membership.wait_round(store, 0, 60.0).spares
        deadline = time.monotonic() + 300
        while not all(store.has(membership.ready_key(s)) for s in spares) and time.monotonic() < deadline:
            time.sleep(0.05)

    def acted_on() -> None:
        """An eviction asked for is seen by the launcher within a beat (``BEAT_S``); ms-long test
        steps would end the job first, so the asker waits for the round it starts (a real step is
        longer than a beat)."""
        membership.wait_round(store, 1, 300.0)

    def step(objects: dict, i: int) -> torch.Tensor | None:
        every = args.kill_rank_every
        if every and objects["ctx"].rank == 1 and i % every == 0 and own_steps:
            emit(event="fault", step=i)
            os.kill(os.getpid(), signal.SIGKILL)
        own_steps.append(i)
        if worker == args.kill_worker and i == args.kill_at and attempt == "0":
            spares_ready()
            emit(event="fault", step=i)
            if args.own_dirs:  # its node's memory and disk go with it
                shutil.rmtree(args.root, ignore_errors=True)
                shutil.rmtree(args.memory_dir, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGSTOP if args.hang else signal.SIGKILL)
        if worker == 0 and args.evict_worker >= 0 and i == args.kill_at and not evicted:
            spares_ready()
            evicted.append(i)
            emit(event="fault", step=i)
            membership.evict(store, args.evict_worker, "XID 79 on its GPU (simulated)")
            acted_on()
        if worker == 0 and args.node_failed_gpu >= 0 and i == args.kill_at and not evicted:
            spares_ready()
            evicted.append(i)
            emit(event="fault", step=i)
            gpu = args.node_failed_gpu  # the event as `predictor serve` sends it (tests/test_node_failed.py)
            listener.on_node_failed({"event": "node_failed", "node": node_name(), "gpu": gpu, "xid": 79,
                                     "reason": f"critical XID 79 on GPU {gpu}"})
            acted_on()
        if worker == 0 and i == args.alarm_at:
            listener.requests.request()  # what the listener does on the predictor's "checkpoint" event
        ctx, model, optim = objects["ctx"], objects["model"], objects["optim"]
        sdc = args.sdc if worker == args.sdc_worker and i == args.kill_at and ctx.round < args.sdc_rounds and \
            os.environ[membership.ATTEMPT_ENV] == "0" else None
        if sdc:
            emit(event="fault", step=i, sdc=sdc)
        if objects.pop("first", False) and i > 0 and args.canary_fault and \
                (args.canary_fault == "always" or not perturbed):  # the first step after a restore
            perturbed.append(i)
            emit(event="fault", step=i, canary=args.canary_fault)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
        optim.zero_grad()
        if args.model == "gpt":
            loss = recovery_model.loss(model, *recovery_model.batch(i, ctx.rank, ctx.world_size))
        elif "loader" in objects:
            x, y = next_batch(objects)
            loss = torch.nn.functional.mse_loss(model(x), y)
        else:
            g = torch.Generator().manual_seed(1000 + i)
            x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
            share = GLOBAL_BATCH // ctx.world_size
            mine = slice(ctx.rank * share, (ctx.rank + 1) * share)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        (loss * float("nan") if sdc == "nan_forward" else loss).backward()
        if sdc == "grad":
            flip_bit(next(model.parameters()).grad)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        optim.step()
        if sdc in ("param", "optim"):
            flip_bit(next(model.parameters()) if sdc == "param" else next(iter(optim.state.values()))["exp_avg"])
        if args.lmr:
            lmr_check(model, optim, i + 1)
        if args.step_s or worker == args.slow_worker:
            time.sleep(args.step_s + (args.slow_s if worker == args.slow_worker else 0.0))
        if worker == args.stall_worker and i == args.kill_at:
            spares_ready()
            emit(event="fault", step=i)
            time.sleep(3600)  # the launcher's progress deadline must end it
        emit(event="step", step=i + 1, world=ctx.world_size)
        return loss.detach() if args.canary or args.canary_fault else None

    def lmr_check(model: torch.nn.Module, optim: torch.optim.Optimizer, done: int) -> None:
        from lm_resiliency.detection.c3 import C3  # on the path only in the campaign's lm-resiliency rows
        t0 = time.perf_counter()
        opt = [t for st in optim.state.values() for t in st.values() if t.dim()]
        found = C3().run_tensor_groups({"params": [p.detach() for p in model.parameters()], "optim": opt})
        emit(event="lmr", step=done, s=time.perf_counter() - t0,
             **{k: {"status": r.status.value, "bitmap": list(r.bitmap)} for k, r in found.items()})

    def warm_up() -> None:  # a spare, while it waits: the first step's one-off costs, paid now
        objects = build(Context(0, 1, -1, worker))
        sample = recovery_model.batch(0, 0, 1)[0] if recovery_model else torch.zeros(1, 16)
        objects["model"](sample).sum().backward()
        objects["optim"].step()
        emit(event="warm")

    def on_recovery(r: Recovery) -> None:
        emit(event="recovery", leaked_groups=group.leaked(), **resources(), **r.__dict__)

    def state_of(objects: dict) -> dict:
        return {k: objects[k] for k in ("model", "optim", "loader") if k in objects}

    result = run(build, step, steps=args.steps, state_of=state_of,
                 checkpoint={"root": args.root, "keep_last": 1000,
                             "replicated": [] if args.own_copies else ["model", "optim"],
                             "memory_dir": args.memory_dir, "peers": args.peers, "object_store": args.object_store,
                             **({"overlap": True} if args.overlap else {})},
                 save_every=args.save_every, resume_step=args.resume_step, collective_timeout_s=20.0,
                 on_recovery=on_recovery, warm_up=warm_up, listener=listener)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in result.objects["model"].parameters()))
    finite = all(bool(torch.isfinite(p).all()) for p in result.objects["model"].parameters())
    emit(event="done", steps=result.steps_done, digest=digest.hexdigest(), finite=finite,
         world=result.objects["ctx"].world_size, children=len(children()))
    exit_rank(0)


if __name__ == "__main__":
    main()
