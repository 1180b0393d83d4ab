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

Not for hung ranks yet: NVRx restarts the survivors of a hang by an asynchronous exception in
their main threads, which can land while a call makes or lets go of its manager, leaving the
rank's memory slots locked in its own process (docs/research/recovery-engines.md).

Start every rank as NVRx expects (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``:
torchrun, or a plain process per rank); the process groups' and commits' store serves
``MASTER_PORT`` and NVRx's own ``MASTER_PORT + 1`` (unless ``store_kwargs`` says otherwise),
both on the first rank.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch.distributed as dist

from ..inprocess.runner import Context, Recovery, Result
from ..manager import CheckpointManager

T = TypeVar("T")


def run(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int,
        checkpoint: Mapping[str, Any], state_of: Callable[[T], dict] = lambda objects: objects,
        save_every: int = 1, resume_step: int | None = None, collective_timeout_s: float = 30.0,
        on_recovery: Callable[[Recovery], None] | None = None, **wrapper: Any) -> Result[T]:
    """Train ``steps`` steps under NVRx's ``inprocess.Wrapper(**wrapper)``, each restart
    restoring from ``CheckpointManager(**checkpoint)``. Arguments as ``ckpt.inprocess.run``;
    ``ctx.round`` is NVRx's iteration, ``ctx.worker`` the rank this process started as. A
    recovery's ``phases`` count from the failed call's exception (NVRx's detection before
    it is its own)."""
    from nvidia_resiliency_ext import inprocess  # the extra: imported only when used

    initial = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    # ours on MASTER_PORT (the checkpoint commits find it there too); NVRx's on a port of its own:
    # with the commits' keys in NVRx's store, its termination barrier failed on a value it misread
    groups = dist.TCPStore(os.environ["MASTER_ADDR"], port, int(os.environ["WORLD_SIZE"]), is_master=initial == 0,
                           multi_tenant=True, wait_for_workers=True, use_libuv=True)
    wrapper = {"store_kwargs": {"port": port + 1}, **wrapper}
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
        mgr = CheckpointManager(**{"node_memory": True, **checkpoint, "sweep": iteration == 0})
        done = 0
        try:
            state = state_of(objects)
            first = resume_step if iteration == 0 else None
            restored = mgr.restore(state, step=first)
            done = restored or 0
            t_restore = time.monotonic()
            while done < steps:
                step(objects, done)
                done += 1
                if failed:
                    recoveries.append(_recovery(failed, iteration, rank, world, restored,
                                                [t_start, t_group, t_build, t_restore, time.monotonic()]))
                    failed.clear()
                    if on_recovery is not None:
                        on_recovery(recoveries[-1])
                if done % save_every == 0 or done == steps:
                    mgr.save(done, state)
            mgr.finished = True
            mgr.close()
        except BaseException as e:
            failed.update(t=time.monotonic(), step=done, reason=f"{type(e).__name__}: {e}"[:300])
            mgr.abandon()  # never waits on a dead rank; NVRx's abort then tears the groups down
            raise
        dist.destroy_process_group()
        return Result(objects, done, recoveries)

    train.__annotations__["call_wrapper"] = inprocess.CallWrapper  # NVRx finds the argument by its class
    return inprocess.Wrapper(**wrapper)(train)()


def _recovery(failed: dict[str, Any], iteration: int, rank: int, world: int, restored: int | None,
              marks: list[float]) -> Recovery:
    """The recovery record of the first step after a restart: phases between ``marks`` (call
    start, group, build, restore, first step), the wait before the call as NVRx's."""
    t_start, t_group, t_build, t_restore, t_step = marks
    phases = {"nvrx_s": t_start - failed["t"], "process_group_s": t_group - t_start, "build_s": t_build - t_group,
              "restore_s": t_restore - t_build, "first_step_s": t_step - t_restore, "total_s": t_step - failed["t"]}
    return Recovery(iteration, failed["reason"], rank, world, restored, failed["step"], time.time(), phases)
