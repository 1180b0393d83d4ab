"""The other engines' side of the recovery benchmark: NVRx's in-process restart and torchft.

    python benchmarks/recovery_engines.py --json out.json [--repeats 3] [--python .venv-engines/bin/python]

Issue #33 asks for our in-process recovery "measured side by side with NVRx and torchft".
This runs the recovery benchmark's model and step (examples/train_torchrun.py: the tiny GPT,
AdamW at 3e-3, its synthetic corpus; a global batch of 12 so that 3 and 2 ranks split it
evenly) under each engine, on gloo (CPU, loopback), and writes rows in the issue's schema
(``case``, ``mode``, ``fault_to_first_step_s``, ``detect_s``, ``steps_lost``, ``relaunched``,
``survivor_pids_kept``, ``equal_to_clean``, ``phase_*``) so that benchmarks/recovery_bench.py
can merge them (``rows()``).

* ``nvrx_inprocess``: nvidia-resiliency-ext 0.4.1, ``inprocess.Wrapper`` around the training
  function, 3 ranks (plain processes with RANK/WORLD_SIZE/MASTER_*, as its examples), default
  rank assignment (the world shrinks by the ranks that are gone). The state source is the
  survivors' own memory: model and optimizer live outside the wrapped function, and each
  (re)start wraps the model in DDP again, which broadcasts rank 0's weights. Faults at step 12
  on rank 1 (rank 0 hosts the Wrapper's store: NVRx needs it alive): ``killed`` (SIGKILL),
  ``hung`` (SIGSTOP), ``exception`` (a RuntimeError in the training function), ``lost_node``
  (2 simulated nodes: rank 0 | ranks 1 and 2, both SIGKILLed at once; nothing on disk to wipe).
  Phases from the ranks' own stamps: detect (fault -> the first survivor's abort begins),
  abort, membership (abort done -> the training function runs again), process_group,
  restore (the DDP broadcast), first_step (to the end of the first step after recovery).
* ``nvrx_ckpt_tiers``: the same NVRx job through ``ckpt.integrations.nvrx.run``: NVRx restarts the
  training function, our tiers are its state source (a ``CheckpointManager`` with an overlapped
  snapshot every step; each restart restores the newest step every rank can read, the dead
  ranks' shards from their memory slots on this host). ``equal_to_clean`` here: bitwise equal
  to a clean 3-rank run to the step restored, then a relaunch from it at the size the
  survivors went on at (a shrunk world is not comparable to a clean 3-rank run).
* ``torchft_2_groups``: torchft 0.2.0, a Lighthouse on 127.0.0.1 and two replica groups of
  one rank each (torchft's ``Manager`` and optimizer wrapper, ProcessGroupGloo; gradients through
  ``Manager.allreduce``: its DDP wrapper asserts on a failed all-reduce), steps padded to 0.2 s
  and a 5 s gloo timeout unless ``--torchft-step-s`` / ``--torchft-timeout-s`` say otherwise
  (``TorchftSettings``: the two decide its hung row).
  Faults at step 12 on group 1: ``killed`` (SIGKILL, and a new group 1 started at once: it
  heals from group 0 over torchft's HTTP transport, ``rejoin_s``), ``hung`` (SIGSTOP; group 0
  goes on alone). ``fault_to_first_step_s`` is group 0's first committed step after the fault.

``xid79`` rows are skipped: neither engine listens to GPU health events (an XID 79 reaches
them as a hung rank or a CUDA error: the ``hung``/``exception`` rows). Rows of an engine that
does not import in ``--python`` are skipped with the import error. ``equal_to_clean``: the
final weights' digest equals that of a run of the same engine without a fault (bitwise).
Medians of ``--repeats`` runs; progress on stderr.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.harness import run_meta, write_json  # noqa: E402
from benchmarks.harness.engines import engine_available, engine_versions, engines_python  # noqa: E402
from benchmarks.harness.procs import exit_on_sigterm, finish, spawn  # noqa: E402
from benchmarks.recovery_rows import median_row  # noqa: E402
from tests.procs import free_ports, wait_for  # noqa: E402

STEPS, FAULT_STEP = 60, 12
NVRX_CASES = {"killed": "kill", "hung": "stop", "exception": "raise", "lost_node": "kill_node"}
TORCHFT_CASES = {"killed": "kill", "hung": "stop"}


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


XID_SKIP = ("neither engine listens to GPU health events: an XID 79 reaches it as a hung rank or a CUDA "
            "error (the hung and exception rows)")
TORCHFT_NODE_SKIP = ("a replica group per node holds no per-node state (the restarted group heals from the "
                     "live peer): a lost node is the killed row")


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


# ---------------------------------------------------------------- driver

def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(events: list[dict[str, Any]]) -> int:
    return max((e["step"] + 1 for e in events if e["event"] == "step"), default=0)


def run_nvrx(python: str, case: str | None, workdir: Path, *, worker: str = "nvrx", world: int = 3,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One NVRx job (``world`` ranks of ``worker``), faulted as ``case`` (None: clean): its row's
    measurements."""
    fault = NVRX_CASES.get(case, "none")
    port, *aux = free_ports(3)
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    procs = [spawn(python, __file__, ["--worker", worker, "--events", str(workdir), "--fault", fault,
                             "--digest", str(workdir / "digest"), *extra], logs[r],
                    {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "AUX_PORTS": ",".join(map(str, aux))})
             for r in range(world)]
    victims = {"kill": [1], "stop": [1], "kill_node": [1, 2]}.get(fault, [])
    fault_t = None
    if victims:
        if not wait_for(lambda: _steps(_read(workdir / "rank0.jsonl")) >= FAULT_STEP, timeout=600, interval=0.01):
            finish(procs, 1, logs)
        fault_t = time.time()
        for v in victims:
            os.kill(procs[v].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    try:
        finish([procs[0]] + [p for i, p in enumerate(procs) if i and i not in victims], 900, logs)
    finally:
        for v in victims:  # NVRx's hard timeout SIGKILLs a stopped rank; reap it all the same
            if procs[v].poll() is None:
                os.kill(procs[v].pid, signal.SIGKILL)
            procs[v].wait()
    events = _read(workdir / "rank0.jsonl")
    survivors = [r for r in range(world) if r not in victims and (fault != "raise" or r != 1)]
    if case == "exception":
        fault_t = next(e["t"] for e in _read(workdir / "rank1.jsonl") if e["event"] == "fault")
    out: dict[str, Any] = {"digest": (workdir / "digest").read_text()}
    if fault_t is None:
        return out
    evs = {r: _read(workdir / f"rank{r}.jsonl") for r in survivors}
    abort_begin = min(e["t"] for r in survivors for e in evs[r] if e["event"] == "abort_begin" and e["t"] > fault_t)
    after = [e for e in events if e["t"] > fault_t]
    abort_end = next(e["t"] for e in after if e["event"] == "abort_end")
    fn = next(e for e in after if e["event"] == "fn_start")
    pg = next(e["t"] for e in after if e["event"] == "pg_ready")
    restored = next(e for e in after if e["event"] == "restored")
    first = next(e for e in after if e["event"] == "step" and e["t"] > restored["t"])
    # steps rank 0 finished before its abort (rank 1 may log its fault before rank 0 logs the step before)
    done_before = max((e["step"] + 1 for e in events if e["event"] == "step" and e["t"] < abort_begin), default=0)
    pids = {r: {e["pid"] for e in evs[r]} for r in survivors}
    return {**out, "fault_to_first_step_s": first["t"] - fault_t, "detect_s": abort_begin - fault_t,
            "steps_lost": done_before - restored["step"], "restored_step": restored["step"], "world_after": fn["world"],
            "survivor_pids_kept": all(len(p) == 1 for p in pids.values()),
            "phase_detect_s": abort_begin - fault_t, "phase_abort_s": abort_end - abort_begin,
            "phase_membership_s": fn["t"] - abort_end, "phase_process_group_s": pg - fn["t"],
            "phase_restore_s": restored["t"] - pg, "phase_first_step_s": first["t"] - restored["t"]}


def run_torchft(python: str, case: str | None, workdir: Path, settings: TorchftSettings = TorchftSettings()
                ) -> dict[str, Any]:
    """One torchft job (Lighthouse + 2 replica groups), faulted as ``case`` (None: clean)."""
    logs = [workdir / f"group{g}.log" for g in range(2)] + [workdir / "lighthouse.log"]
    lighthouse = spawn(python, __file__, ["--worker", "lighthouse", "--events", str(workdir)], logs[-1], {})
    ready = wait_for(lambda: _read(workdir / "lighthouse.jsonl"), timeout=300)
    if not ready:
        lighthouse.kill()
        raise SystemExit(f"the Lighthouse did not start:\n{logs[-1].read_text()[-2000:]}")
    addr, fault = ready[0]["address"], TORCHFT_CASES.get(case, "none")
    args = [["--worker", "torchft", "--events", str(workdir), "--group", str(g), "--lighthouse", addr,
             "--digest", str(workdir / "digest"), "--torchft-timeout-s", str(settings.collective_timeout_s),
             "--torchft-step-s", str(settings.step_s)] for g in range(2)]
    procs = [spawn(python, __file__, args[g], logs[g], {}) for g in range(2)]
    fault_t, replacement = None, None
    try:
        if fault != "none":
            if not wait_for(lambda: _steps(_read(workdir / "group0.jsonl")) >= FAULT_STEP, timeout=600, interval=0.01):
                finish(procs, 1, logs)
            fault_t = time.time()
            os.kill(procs[1].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            if fault == "kill":
                procs[1].wait()
                logs.append(workdir / "group1-restarted.log")  # appends to group1.jsonl
                replacement = spawn(python, __file__, args[1], logs[-1], {})
        finish([procs[0]] + ([replacement] if replacement else [procs[1]] if fault == "none" else []), 900, logs)
    finally:
        if fault == "stop":
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
        lighthouse.terminate()
        lighthouse.wait()
    out: dict[str, Any] = {"digest": (workdir / "digest").read_text()}
    if fault_t is None:
        return out
    g0 = [e for e in _read(workdir / "group0.jsonl") if e["event"] == "step"]
    after = [e for e in g0 if e["t"] > fault_t]
    failed = next((e for e in after if not e["committed"]), None)
    first = next(e for e in after if e["committed"] and e["t"] > (failed["t"] if failed else fault_t))
    done_before = max((e["step"] + 1 for e in g0 if e["committed"] and e["t"] < fault_t), default=0)
    row = {**out, "fault_to_first_step_s": first["t"] - fault_t,
           "detect_s": None if failed is None else failed["t"] - fault_t,
           "steps_lost": done_before - first["step"], "survivor_pids_kept": len({e["pid"] for e in g0}) == 1,
           "phase_detect_s": None if failed is None else failed["t"] - fault_t,
           "phase_first_step_s": first["t"] - (failed["t"] if failed else fault_t)}
    if replacement:
        g1 = [e for e in _read(workdir / "group1.jsonl") if e["t"] > fault_t]
        healed = next((e["t"] for e in g1 if e["event"] == "healed"), None)
        joined = next((e["t"] for e in g1 if e["event"] == "step" and e["committed"]), None)
        row |= {"rejoin_s": None if joined is None else joined - fault_t,
                "rejoin_heal_s": None if healed is None else healed - fault_t}
    return row


def run_nvrx_tiers(python: str, case: str | None, workdir: Path) -> dict[str, Any]:
    """NVRx with our tiers: the faulted job, then its reference (a clean 3-rank run to the step
    restored, and a relaunch from it at the size the survivors went on at): ``equal_to_clean``."""
    shm = Path(tempfile.mkdtemp(prefix="recovery-engines-", dir="/dev/shm"))
    try:
        def job(name: str, world: int, *extra: str, fault: str | None = None) -> dict[str, Any]:
            (workdir / name).mkdir()
            return run_nvrx(python, fault, workdir / name, worker="nvrx_tiers", world=world,
                            extra=("--memory-dir", str(shm / name), *extra))

        got = job("faulted", 3, "--root", str(workdir / "faulted-root"), fault=case)
        if case is None:
            return got
        root, restored = str(workdir / "ref-root"), got["restored_step"]
        job("ref", 3, "--root", root, "--steps", str(restored))
        again = job("ref-after", got["world_after"], "--root", root, "--resume-step", str(restored))
        digest = got.pop("digest")
        return {**got, "equal_to_clean": digest == again["digest"]}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# mode: (module, cases, runner, the cases where a process is started again: torchft's killed group)
ENGINES = {"nvrx_inprocess": ("nvidia_resiliency_ext.inprocess", NVRX_CASES, run_nvrx, ()),
           "nvrx_ckpt_tiers": ("nvidia_resiliency_ext.inprocess", NVRX_CASES, run_nvrx_tiers, ()),
           "torchft_2_groups": ("torchft", TORCHFT_CASES, run_torchft, ("killed",))}
CASES = ("killed", "hung", "lost_node", "xid79", "exception")


def rows(python: str | None = None, repeats: int = 1, modes: tuple[str, ...] = tuple(ENGINES),
         cases: tuple[str, ...] = CASES, torchft: TorchftSettings = TorchftSettings()) -> list[dict[str, Any]]:
    """The engines' rows (medians of ``repeats`` faulty runs, each checked against one clean run)."""
    python, out = python or engines_python(), []
    for mode in modes:
        module, engine_cases, run_one, relaunching = ENGINES[mode]
        described = {}  # the settings a row depends on
        if run_one is run_torchft:
            run_one, described = functools.partial(run_torchft, settings=torchft), {"torchft": asdict(torchft)}
        missing = engine_available(python, module)
        clean = None
        for case in cases:
            skip = (f"{module} does not import in {python}: {missing}" if missing else XID_SKIP if case == "xid79"
                    else TORCHFT_NODE_SKIP if case == "lost_node" and mode == "torchft_2_groups"
                    else None if case in engine_cases else f"{mode} has no {case} case")
            if skip:
                out.append({"case": case, "mode": mode, "skipped": skip})
                continue
            try:
                runs = []
                for i in range(repeats):
                    t0 = time.monotonic()
                    with tempfile.TemporaryDirectory(prefix="recovery-engines-") as tmp:
                        got = run_one(python, case, Path(tmp))
                    if "equal_to_clean" not in got:  # else the runner compared with a reference of its own
                        if clean is None:
                            with tempfile.TemporaryDirectory(prefix="recovery-engines-") as tmp:
                                clean = run_one(python, None, Path(tmp))["digest"]
                        got["equal_to_clean"] = got.pop("digest") == clean
                    runs.append(got)
                    print(f"{mode} {case} #{i + 1}: {got} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                          flush=True)
            except (Exception, SystemExit) as failed:  # one engine's failure leaves the other rows standing
                out.append({"case": case, "mode": mode, "failed": f"{type(failed).__name__}: {failed}"[-2000:]})
                continue
            out.append({"case": case, "mode": mode, "relaunched": case in relaunching, **median_row(runs),
                        "repeats": repeats, "survivor_pids_kept": all(r["survivor_pids_kept"] for r in runs),
                        **described})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write {meta, rows} here")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--python", default=engines_python(),
                    help="an interpreter with nvidia-resiliency-ext 0.4.1 and torchft 0.2.0 (and this repo's deps)")
    ap.add_argument("--modes", default=",".join(ENGINES))
    ap.add_argument("--cases", default=",".join(CASES))
    add_torchft_args(ap)
    ap.add_argument("--worker", choices=("nvrx", "nvrx_tiers", "torchft", "lighthouse"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--resume-step", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--memory-dir", help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    ap.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--digest", help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "nvrx":
        return nvrx_worker(args.events, args.fault, args.digest)
    if args.worker == "nvrx_tiers":
        return nvrx_tiers_worker(args.events, args.fault, args.digest, args.steps, args.resume_step, args.root,
                                 args.memory_dir)
    if args.worker == "torchft":
        return torchft_worker(args.events, args.group, args.lighthouse, args.digest, torchft_settings(args))
    if args.worker == "lighthouse":
        return lighthouse_worker(args.events)
    for name, known in (("modes", ENGINES), ("cases", CASES)):
        if bad := [x for x in getattr(args, name).split(",") if x not in known]:
            ap.error(f"unknown {name}: {', '.join(bad)} (one of {', '.join(known)})")
    exit_on_sigterm()
    start = run_meta(engines_python=args.python, versions=engine_versions(args.python))
    table = rows(args.python, args.repeats, tuple(args.modes.split(",")), tuple(args.cases.split(",")),
                 torchft_settings(args))
    write_json(args.json, start, table, echo=True)


if __name__ == "__main__":
    main()
