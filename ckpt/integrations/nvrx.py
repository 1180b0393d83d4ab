"""In-process restarts by NVIDIA's nvidia-resiliency-ext, with our tiers as the state source.

NVRx's ``inprocess.Wrapper`` detects a failed or hung rank (an exception, its monitor
process, progress timeouts), aborts the process groups and calls the training function
again in the surviving processes, the world shrunk (or filled from its reserve ranks). What
it leaves to the function is the state: the function starts over and must find its
weights, optimizer and data position. ``run`` is that function: each call builds the
objects on a new gloo group, restores the newest step every rank can read through a
``CheckpointManager`` (``node_memory``: a dead rank's sealed memory slots on this node are
read too; its peer replica or the durable tiers otherwise; resharded at a new size) and
trains on, saving every ``save_every`` steps.

It takes the ``build``/``step`` callables of ``ckpt.inprocess.run``, so a job moves between
the two engines by one call; our own launcher (``python -m ckpt.inprocess.launch``) adds warm
spares, node loss, evictions on XID 79 and relaunch fallbacks, measured side by side in
``benchmarks/recovery_bench.py`` (docs/research/recovery-engines.md). NVRx is an extra, not
a dependency: ``pip install nvidia-resiliency-ext==0.4.1`` (it pulls a ``pynvml`` shim over
the ``nvidia-ml-py`` the agents use, so keep it out of the agents' environment).

NVRx restarts a call by raising an exception in the main thread, asynchronously and again and
again until the call has returned (``MonitorThread``: after a hang, the survivors are stopped
anywhere). A manager made or let go of there could be cut off holding its memory slots' lock,
and every later call would find its own rank's slots in use; so each call's manager is made,
closed and abandoned on a helper thread, in order (``_Managers``), which those exceptions
never reach.

Start every rank as NVRx expects (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``:
torchrun, or a plain process per rank); the process groups' and commits' store serves
``MASTER_PORT``, and NVRx's own a port the first rank found free and told the others through
it (unless ``store_kwargs`` names one), both on the first rank. Not ``MASTER_PORT + 1``: that
port may be anyone's (a client's ephemeral port made NVRx's store fail with EADDRINUSE).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Mapping, TypeVar

import torch.distributed as dist

from ..inprocess.runner import Context, Recovery, Result, Steps, record
from ..manager import CheckpointManager

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int,
        checkpoint: Mapping[str, Any], state_of: Callable[[T], dict] = lambda objects: objects,
        save_every: int = 1, resume_step: int | None = None, collective_timeout_s: float = 30.0,
        on_recovery: Callable[[Recovery], None] | None = None, **wrapper: Any) -> Result[T]:
    """Train ``steps`` steps under NVRx's ``inprocess.Wrapper(**wrapper)``, each restart
    restoring from ``CheckpointManager(**checkpoint)``. Arguments as ``ckpt.inprocess.run``;
    ``ctx.round`` is NVRx's iteration, ``ctx.worker`` the rank this process started as. A
    recovery's ``phases`` count from the failed call's exception (NVRx's detection before
    it is its own).

    With gloo, keep ``collective_timeout_s`` between NVRx's ``soft_timeout`` and its
    ``hard_timeout``: NVRx's abort cannot end a gloo collective blocked on a hung rank, so
    the survivors leave it by this timeout and wait at NVRx's barrier; past the hard timeout
    they would race the hung rank to it, and NVRx kills whichever rank's turn comes (a
    survivor, in 1 of 4 runs of the test with 20 s)."""
    from nvidia_resiliency_ext import inprocess  # the extra: imported only when used

    initial = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    # ours on MASTER_PORT (the checkpoint commits find it there too); NVRx's on a port of its own:
    # with the commits' keys in NVRx's store, its termination barrier failed on a value it misread
    groups = dist.TCPStore(os.environ["MASTER_ADDR"], port, int(os.environ["WORLD_SIZE"]), is_master=initial == 0,
                           multi_tenant=True, wait_for_workers=True, use_libuv=True)
    store_kwargs = wrapper.get("store_kwargs", {})
    if "port" not in store_kwargs:
        wrapper = {**wrapper, "store_kwargs": {**store_kwargs, "port": _agreed_port(groups, initial)}}
    managers = _Managers(checkpoint)
    recoveries: list[Recovery] = []
    failed: dict[str, Any] = {}  # the last failed call: when it raised, at which step, what

    def train(call_wrapper: Any = None) -> Result[T]:  # NVRx binds the call first, then fills it in
        iteration, t_start = call_wrapper.iteration, time.monotonic()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ckpt-guard/nvrx/{iteration}", groups),
                                rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout_s))
        t_group = time.monotonic()
        objects = build(Context(rank, world, iteration, initial))
        t_build = time.monotonic()
        progress = Steps()
        try:
            mgr = managers.make(sweep=iteration == 0)
            state = state_of(objects)
            first = resume_step if iteration == 0 else None
            restored = mgr.restore(state, step=first)
            progress.done = restored or 0
            marks = (t_start, t_group, t_build, time.monotonic())
            recovered = partial(_recovery, failed, iteration, rank, world, restored, marks) if failed else None
            progress.train(objects, step, mgr, state, steps=steps, save_every=save_every,
                           first=recovered and partial(record, recoveries, on_recovery, recovered))
            managers.close()
        except BaseException as e:
            failed.update(t=time.monotonic(), step=progress.done, reason=f"{type(e).__name__}: {e}"[:300])
            managers.abandon()  # never waits on a dead rank; NVRx's abort then tears the groups down
            raise
        dist.destroy_process_group()
        return Result(objects, progress.done, recoveries)

    train.__annotations__["call_wrapper"] = inprocess.CallWrapper  # NVRx finds the argument by its class
    return inprocess.Wrapper(**wrapper)(train)()


def _agreed_port(store: dist.Store, rank: int) -> int:
    """A port free on the first rank's host (where NVRx's store listens), picked there and
    read by the others from ``store``."""
    key = "ckpt-guard/nvrx/store-port"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            store.set(key, str(s.getsockname()[1]))
    return int(store.get(key))


class _Managers:
    """Each call's ``CheckpointManager``, made and let go of on one helper thread, in order:
    NVRx's asynchronous exceptions land in the main thread only, which just waits."""

    def __init__(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoint = {"node_memory": True, **checkpoint}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-nvrx")
        self._made: Future | None = None

    def make(self, *, sweep: bool) -> CheckpointManager:
        """A new manager, after the last call's is let go of (if that call was cut off first)."""
        self.abandon()
        self._made = self._thread.submit(CheckpointManager, **self._checkpoint, sweep=sweep)
        return self._made.result()

    def abandon(self) -> None:
        """Let go of the current manager once it is made, waiting for no rank (queued: returns at once)."""
        if self._made is not None:
            self._thread.submit(_let_go, self._made, CheckpointManager.abandon)

    def close(self) -> None:
        """The end of training: close the manager (with the other ranks) and the helper."""
        self._thread.submit(_let_go, self._made, CheckpointManager.close).result()
        self._thread.shutdown()


def _let_go(made: Future, how: Callable[[CheckpointManager], None]) -> None:
    if made.exception() is not None:
        return  # never made: nothing holds its slots
    try:
        how(made.result())
    except Exception:
        log.exception("letting go of the checkpoint manager failed")
        raise


def _recovery(failed: dict[str, Any], iteration: int, rank: int, world: int, restored: int | None,
              marks: tuple[float, float, float, float]) -> Recovery:
    """The recovery record at the first step after a restart (and ``failed`` cleared): phases
    between ``marks`` (call start, group, build, restore) and now, the wait before the call as NVRx's."""
    t_start, t_group, t_build, t_restore = marks
    t_step = time.monotonic()
    phases = {"nvrx_s": t_start - failed["t"], "process_group_s": t_group - t_start, "build_s": t_build - t_group,
              "restore_s": t_restore - t_build, "first_step_s": t_step - t_restore, "total_s": t_step - failed["t"]}
    rec = Recovery(iteration, failed["reason"], rank, world, restored, failed["step"], time.time(), phases)
    failed.clear()
    return rec
