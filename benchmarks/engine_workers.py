"""The other engines' workers, run in the engines' venv (benchmarks/harness/engines.py) by the
driver benchmarks/recovery_engines.py: one rank of an NVRx in-process job (``nvrx``, or with our
checkpoint tiers: ``nvrx_tiers``), one torchft replica group (``torchft``) or torchft's
Lighthouse. Each writes its events, one JSON line each, for the driver to time.

    python benchmarks/engine_workers.py --worker nvrx --events DIR [--fault kill|stop|raise|none] ...
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS, FAULT_STEP = 60, 12


@dataclass(frozen=True)
class TorchftSettings:
    """The two torchft knobs that decide its hung row. gloo cannot abort a blocked collective,
    so a survivor in an all-reduce with the stopped group waits out ``collective_timeout_s``;
    a stop that lands in a step's idle padding (``step_s``) is found by the next quorum after
    the Lighthouse's 1 s heartbeat timeout instead."""
    collective_timeout_s: float = 5.0
    step_s: float = 0.2  # group 0 must still train when a restarted group 1 is up to join it


def add_torchft_args(ap: argparse.ArgumentParser) -> None:
    default = TorchftSettings()
    ap.add_argument("--torchft-timeout-s", type=float, default=default.collective_timeout_s,
                    help="torchft's gloo collective timeout (default %(default)s)")
    ap.add_argument("--torchft-step-s", type=float, default=default.step_s,
                    help="torchft's steps padded to this (default %(default)s; 0: no idle part, as ours)")


def torchft_settings(args: argparse.Namespace) -> TorchftSettings:
    return TorchftSettings(args.torchft_timeout_s, args.torchft_step_s)


# ---------------------------------------------------------------- workers (run in the engines' python)

class _Events:
    """One JSON line per event, stamped with wall time, in this rank's file."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


def nvrx_worker(events_dir: str, fault: str, digest_out: str) -> None:
    """One rank of the job under ``inprocess.Wrapper``; rank 1 raises at FAULT_STEP if ``fault`` is raise."""
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks import recovery_model
    from examples.train_torchrun import weights_digest
    initial_rank = int(os.environ["RANK"])
    log = _Events(f"{events_dir}/rank{initial_rank}.jsonl")
    model, optim = recovery_model.model()
    progress = {"step": 0, "raised": False}
    base_store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], _aux_port(0),
                                            int(os.environ["WORLD_SIZE"]), is_master=initial_rank == 0,
                                            multi_tenant=True, wait_for_workers=True, use_libuv=True)

    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        log("fn_start", iteration=call_wrapper.iteration, rank=rank, world=world)
        dist.init_process_group("gloo", store=torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store),
                                rank=rank, world_size=world, timeout=timedelta(seconds=5))
        log("pg_ready", iteration=call_wrapper.iteration)
        ddp = DDP(model)  # broadcasts rank 0's weights: the survivors' memory is the state source
        step = torch.tensor([progress["step"]])
        dist.broadcast(step, 0)
        progress["step"] = int(step)
        log("restored", iteration=call_wrapper.iteration, step=progress["step"])
        while progress["step"] < STEPS:
            s = progress["step"]
            if fault == "raise" and initial_rank == 1 and s == FAULT_STEP and not progress["raised"]:
                progress["raised"] = True
                log("fault", step=s)
                raise RuntimeError("injected fault")
            x, y = recovery_model.batch(s, rank, world)
            loss = recovery_model.loss(ddp, x, y)  # through DDP's forward: its gradient hooks
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            progress["step"] = s + 1
            log("step", step=s, iteration=call_wrapper.iteration, world=world)
        dist.barrier()
        if rank == 0:
            Path(digest_out).write_text(weights_digest(model))
        dist.destroy_process_group()

    # NVRx finds the parameter to fill by its annotation, as a class: not the string that
    # ``from __future__ import annotations`` leaves
    train.__annotations__["call_wrapper"] = inprocess.CallWrapper
    wrapped = inprocess.Wrapper(store_kwargs={"port": _aux_port(1)}, abort=_timed_abort(log),
                                **NVRX_TIMEOUTS)(train)
    wrapped()


NVRX_TIMEOUTS = {k: timedelta(seconds=v) for k, v in {
    "soft_timeout": 4, "hard_timeout": 8, "heartbeat_timeout": 4, "barrier_timeout": 120, "completion_timeout": 120,
    "last_call_wait": 0.2, "termination_grace_time": 2, "monitor_thread_interval": 0.2,
    "monitor_process_interval": 0.2, "heartbeat_interval": 0.5, "progress_watchdog_interval": 0.2}.items()}


def _aux_port(i: int) -> int:
    """The ``i``-th port the launcher found free besides MASTER_PORT (the stores of NVRx's jobs)."""
    return int(os.environ["AUX_PORTS"].split(",")[i])


def _timed_abort(log: _Events) -> Any:
    """NVRx's own abort, its start and end stamped (the phases' boundaries)."""
    from nvidia_resiliency_ext import inprocess

    class TimedAbort(inprocess.abort.AbortTorchDistributed):
        def __call__(self, state: Any) -> Any:
            log("abort_begin")
            out = super().__call__(state)
            log("abort_end")
            return out

    return TimedAbort()


def nvrx_tiers_worker(events_dir: str, fault: str, digest_out: str, steps: int, resume_step: int | None,
                      root: str, memory_dir: str) -> None:
    """One rank under ``ckpt.integrations.nvrx.run``: NVRx restarts the function, our tiers are the
    state source (a snapshot every step, overlapped); the same model, batches and fault as above."""
    import torch.distributed as dist

    from benchmarks import recovery_model
    from ckpt.integrations.nvrx import run
    from examples.train_torchrun import weights_digest
    initial_rank = int(os.environ["RANK"])
    log = _Events(f"{events_dir}/rank{initial_rank}.jsonl")
    raised = []

    def build(ctx: Any) -> dict[str, Any]:
        log("fn_start", iteration=ctx.round, rank=ctx.rank, world=ctx.world_size)
        log("pg_ready", iteration=ctx.round)  # run() joined the group before it builds
        model, optim = recovery_model.model()
        return {"model": model, "optim": optim, "ctx": ctx, "first": True}

    def step(objects: dict[str, Any], s: int) -> None:
        ctx, model, optim = objects["ctx"], objects["model"], objects["optim"]
        if objects.pop("first", False):
            log("restored", iteration=ctx.round, step=s)
        if fault == "raise" and initial_rank == 1 and s == FAULT_STEP and not raised:
            raised.append(s)
            log("fault", step=s)
            raise RuntimeError("injected fault")
        optim.zero_grad(set_to_none=True)
        recovery_model.loss(model, *recovery_model.batch(s, ctx.rank, ctx.world_size)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        optim.step()
        log("step", step=s, iteration=ctx.round, world=ctx.world_size)

    result = run(build, step, steps=steps, resume_step=resume_step, collective_timeout_s=5.0,
                 state_of=lambda o: {"model": o["model"], "optim": o["optim"]},
                 checkpoint={"root": root, "memory_dir": memory_dir, "keep_last": 1000,
                             "replicated": ["model", "optim"], "overlap": True},
                 abort=_timed_abort(log), store_kwargs={"port": _aux_port(0)}, **NVRX_TIMEOUTS)
    if result.objects["ctx"].rank == 0:
        Path(digest_out).write_text(weights_digest(result.objects["model"]))


def torchft_worker(events_dir: str, group: int, lighthouse: str, digest_out: str, settings: TorchftSettings) -> None:
    """Replica group ``group`` (one rank) of the job under torchft's Manager."""
    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from benchmarks import recovery_model
    from examples.train_torchrun import weights_digest
    log = _Events(f"{events_dir}/group{group}.jsonl")
    model, optim = recovery_model.model()
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)

    def heal(sd: dict[str, Any]) -> None:  # the state source: the live peer's, over torchft's HTTP transport
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        log("healed")

    pg = ProcessGroupGloo(timeout=timedelta(seconds=settings.collective_timeout_s))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=heal,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
                      replica_id=f"group{group}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    # torchft's DistributedDataParallel trips on a failed all-reduce (``assert fut._fut`` in its
    # comm hook, torchft 0.2.0 with torch 2.13): the gradients go through Manager.allreduce instead
    opt = Optimizer(manager, optim)
    log("start")
    while manager.current_step() < STEPS:
        s, t_step = manager.current_step(), time.time()
        opt.zero_grad()  # starts the step's quorum
        x, y = recovery_model.batch(s, 0, 1)
        recovery_model.loss(model, x, y).backward()
        for work in [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]:
            work.wait()
        committed = manager.should_commit()  # what torchft's OptimizerWrapper.step does, with its answer
        if committed:
            optim.step()
        time.sleep(max(0.0, settings.step_s - (time.time() - t_step)))
        log("step", step=s, committed=bool(committed), participants=manager.num_participants())
    if group == 0:
        Path(digest_out).write_text(weights_digest(model))
    manager.shutdown()


def lighthouse_worker(events_dir: str) -> None:
    """torchft's Lighthouse on loopback until killed; its address in ``lighthouse.jsonl``.
    Heartbeat timeout 1 s: the lower end of the issue's 1-5 s (torchft's default is 5 s)."""
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
                              heartbeat_timeout_ms=1000)
    _Events(f"{events_dir}/lighthouse.jsonl")("ready", address=server.address())
    signal.sigwait({signal.SIGTERM})
    server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", required=True, choices=("nvrx", "nvrx_tiers", "torchft", "lighthouse"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--resume-step", type=int, default=None)
    ap.add_argument("--root")
    ap.add_argument("--memory-dir")
    ap.add_argument("--events", required=True, help="the directory of the events files")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--digest", help="write the final weights' digest here")
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--lighthouse")
    add_torchft_args(ap)
    args = ap.parse_args()
    if args.worker == "nvrx":
        return nvrx_worker(args.events, args.fault, args.digest)
    if args.worker == "nvrx_tiers":
        return nvrx_tiers_worker(args.events, args.fault, args.digest, args.steps, args.resume_step, args.root,
                                 args.memory_dir)
    if args.worker == "torchft":
        return torchft_worker(args.events, args.group, args.lighthouse, args.digest, torchft_settings(args))
    return lighthouse_worker(args.events)


if __name__ == "__main__":
    main()
