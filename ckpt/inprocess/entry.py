"""``ckpt.inprocess.run``: one training script, either launcher.

Under ``python -m ckpt.inprocess.launch`` (its workers carry ``CKPT_INPROCESS_WORKER``) a
lost rank is recovered inside the survivors (``runner.py``). Under plain ``torchrun`` (or a
single ``python train.py``) the same ``build``/``step`` run once per process: a lost rank
ends every rank, torchrun's ``--max-restarts`` starts them again and each restores the newest
step (from node memory, where the slots survived the processes). The script does not change;
only the launch line says which recovery it gets.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Mapping, TypeVar

import torch.distributed as dist

from ..integrations.risk import RiskListener
from ..manager import CheckpointManager
from ..recovery.process_group import init_process_group
from . import runner
from .runner import Context, Recovery, Result, Steps, record

log = logging.getLogger(__name__)
T = TypeVar("T")
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def run(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int,
        checkpoint: Mapping[str, Any], state_of: Callable[[T], dict] = lambda objects: objects,
        save_every: int = 1, resume_step: int | None = None, collective_timeout_s: float = 30.0,
        membership_timeout_s: float = 30.0, on_recovery: Callable[[Recovery], None] | None = None,
        warm_up: Callable[[], Any] | None = None, listener: RiskListener | None = None,
        elevated_every: int | None = None) -> Result[T]:
    """Train ``steps`` steps: in process under our launcher (``runner.run``, every argument
    documented there), by relaunch under torchrun (``membership_timeout_s`` and ``warm_up``
    then have nothing to do; the ``listener``'s alarms still make urgent saves)."""
    if runner.WORKER_ENV in os.environ:
        return runner.run(build, step, steps=steps, checkpoint=checkpoint, state_of=state_of, save_every=save_every,
                          resume_step=resume_step, collective_timeout_s=collective_timeout_s,
                          membership_timeout_s=membership_timeout_s, on_recovery=on_recovery, warm_up=warm_up,
                          listener=listener, elevated_every=elevated_every)
    return run_relaunched(build, step, steps=steps, checkpoint=checkpoint, state_of=state_of, save_every=save_every,
                          resume_step=resume_step, collective_timeout_s=collective_timeout_s,
                          on_recovery=on_recovery, listener=listener, elevated_every=elevated_every)


def run_relaunched(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int,
                   checkpoint: Mapping[str, Any], state_of: Callable[[T], dict], save_every: int,
                   resume_step: int | None, collective_timeout_s: float,
                   on_recovery: Callable[[Recovery], None] | None, listener: RiskListener | None = None,
                   elevated_every: int | None = None) -> Result[T]:
    """One process's life under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``)
    or alone (world size 1): a fault raises out of here and ends it; torchrun's restart
    (``TORCHELASTIC_RESTART_COUNT``) is reported to ``on_recovery`` at its first resumed step."""
    t_start = time.monotonic()
    restart = int(os.environ.get(RESTART_ENV, "0"))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 and restart == 0:
        log.warning("ckpt-guard inprocess: not started by `python -m ckpt.inprocess.launch`: a lost rank costs a "
                    "relaunch of every rank (restored from memory); in-process recovery needs that launcher")
    timeout = timedelta(seconds=collective_timeout_s)
    if "MASTER_ADDR" in os.environ:  # a store of each restart's own: the job's holds the last one's addresses
        init_process_group("gloo", timeout)
    else:  # a single process: a group of one, so that the same script runs with plain python
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    t_group = time.monotonic()
    objects = build(Context(rank, world, restart, rank))
    t_build = time.monotonic()
    mgr = CheckpointManager(**{"node_memory": True, **checkpoint})
    state = state_of(objects)
    restored = mgr.restore(state, step=resume_step if restart == 0 else None)
    mgr.prepare(state)  # the slots sized in the background: the first save does not allocate them
    progress = Steps(restored or 0)
    marks = (t_start, t_group, t_build, time.monotonic())
    recoveries: list[Recovery] = []
    recovered = partial(_relaunch_recovery, restart, rank, world, restored, marks) if restart else None
    progress.train(objects, step, mgr, state, steps=steps, save_every=save_every,
                   first=recovered and partial(record, recoveries, on_recovery, recovered), listener=listener,
                   elevated_every=elevated_every)
    mgr.close()
    dist.destroy_process_group()
    return Result(objects, progress.done, recoveries)


def _relaunch_recovery(restart: int, rank: int, world: int, restored: int | None,
                       marks: tuple[float, float, float, float]) -> Recovery:
    """A torchrun restart as a recovery record (phases from this process's start, which is
    all of it that this process sees)."""
    t_start, t_group, t_build, t_restore = marks
    now = time.monotonic()
    phases = {"process_group_s": t_group - t_start, "build_s": t_build - t_group, "restore_s": t_restore - t_build,
              "first_step_s": now - t_restore, "total_s": now - t_start}
    rec = Recovery(restart, f"relaunched by torchrun (restart {restart})", rank, world, restored, None, time.time(),
                   phases)
    log.warning("ckpt-guard inprocess recovery %s", rec.to_json())
    return rec
