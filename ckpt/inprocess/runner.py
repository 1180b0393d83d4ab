"""Training that survives a lost rank inside the surviving processes (``ckpt.inprocess.run``).

``ckpt.resumable`` is a generator: a failed collective is raised in the caller's loop body,
where the wrapped model, the optimizer and the data iterator bound to the dead group live,
so it can only end the process. Here the caller hands over two functions, as with NVRx's
``inprocess.Wrapper``: ``build(ctx)`` makes the training objects on the current group and
``step(objects, i)`` runs step ``i``. When a step fails (a peer's collective broke) or the
launcher publishes a new membership round (``membership.py``), the survivor abandons the
checkpoint manager and the process group without waiting on them, joins the next round's
group (a spare takes the lost rank's place, else the world shrinks), builds again, restores
the newest step complete everywhere (resharded at a new size) and goes on.

Global batch policy when shrinking: ``build`` gets the new ``ctx.world_size``; the example and
tests keep the global batch and split it over the ranks left.
"""
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generic, Mapping, TypeVar

from ..control import Control
from ..errors import CheckpointError, UnsoundState
from ..integrations.loop import save_at_boundary
from ..integrations.risk import RiskListener
from ..manager import CheckpointManager
from ..peers.placement import node_name
from ..recovery.leaving import flush_logs
from ..save.canary import CanaryFailed, figures
from . import evictions, group, membership
from .protocol import BEAT_S, EXIT_FALLBACK, EXIT_LEAVE, EXIT_STOP, LAUNCHER_ENV, WORKER_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")



class FallBack(RuntimeError):
    """In-process recovery is not possible here; the launcher relaunches the job (logged reason)."""


class _MembershipChanged(Exception):
    """The launcher published a new round while this one was still training (a predicted failure)."""


@dataclass(frozen=True)
class Context:
    """What ``build`` needs: this round's rank and world size (and which worker this is)."""

    rank: int
    world_size: int
    round: int
    worker: int


@dataclass
class Recovery:
    """One recovery as the survivor saw it: cause and phases (seconds), for the log and benchmarks."""

    round: int
    reason: str
    rank: int
    world_size: int
    restored_step: int | None
    failed_at_step: int | None  # None for a spare called in
    resumed_at: float  # wall clock at the end of the first resumed step
    phases: dict[str, float]

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass
class Result(Generic[T]):
    objects: T
    steps_done: int
    recoveries: list[Recovery]


@dataclass
class Steps:
    """One round's (or NVRx call's) training loop, shared by both engines: ``done`` is the step
    reached, still there when a step raises and ends the round."""

    done: int = 0

    def train(self, objects: T, step: Callable[[T, int], Any], mgr: CheckpointManager, state: dict, *, steps: int,
              save_every: int, before: Callable[[], None] = lambda: None,
              after: Callable[[int], None] = lambda done: None, first: Callable[[], None] | None = None,
              listener: RiskListener | None = None, elevated_every: int | None = None) -> None:
        """Steps ``done`` .. ``steps``: ``before()``, the step, ``after(done)``, ``first()`` once
        (a recovery ends with the first step it resumes), then a save every ``save_every`` steps
        (a step that returns its loss, or ``(loss, grad_norm)``, feeds ``mgr.record``: the canary)
        and at the last (the caller's normal ``close()`` then frees the memory slots once durable).
        With the predictor's ``listener`` (on every rank), its alarms and ``elevated_every`` are
        decided at each boundary as ``ckpt.resumable`` does (``save_at_boundary``: one agreement
        a step, so an alarm heard on any rank makes every rank save that step urgently)."""
        while self.done < steps:
            before()
            if (loss := figures(step(objects, self.done))) is not None:  # a step returning its loss: the canary
                mgr.record(*loss)
            self.done += 1
            after(self.done)
            if first is not None:
                first()
                first = None
            if listener is not None:
                saved = save_at_boundary(mgr, listener.requests, self.done, lambda: state, save_every,
                                         listener=listener, elevated_every=elevated_every)
                if not saved and self.done == steps:
                    mgr.save(self.done, state)
            elif self.done % save_every == 0 or self.done == steps:
                mgr.save(self.done, state)


def record(recoveries: list[Recovery], on_recovery: Callable[[Recovery], None] | None,
           recovery: Callable[[], Recovery]) -> None:
    """Log-and-keep a recovery at its first resumed step (``recovery()`` times it)."""
    recoveries.append(recovery())
    if on_recovery is not None:
        on_recovery(recoveries[-1])


def run(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int,
        checkpoint: Mapping[str, Any], state_of: Callable[[T], dict] = lambda objects: objects,
        save_every: int = 1, resume_step: int | None = None, collective_timeout_s: float = 30.0,
        membership_timeout_s: float = 30.0, on_recovery: Callable[[Recovery], None] | None = None,
        warm_up: Callable[[], Any] | None = None, listener: RiskListener | None = None,
        elevated_every: int | None = None) -> Result[T]:
    """Train ``steps`` steps under ``python -m ckpt.inprocess.launch``, recovering in process.

    ``checkpoint``: ``CheckpointManager`` keyword arguments (its ``root`` first); a step is saved
    every ``save_every`` steps. ``resume_step``: restore that step at the first start instead of
    the newest. ``collective_timeout_s`` bounds the gloo group's collectives;
    ``membership_timeout_s`` how long a survivor waits for the launcher's next round before it
    falls back to a relaunch: the reason is logged and the process exits with ``EXIT_FALLBACK``,
    on which the launcher relaunches the job. ``warm_up`` runs in a warm spare while it waits
    (no process group yet): build a model and take a local step, so the first step after it is
    called in pays no lazy import or first-use cost. ``listener``: the predictor's
    ``RiskListener`` (started by the caller, one on every rank, or on none); its "checkpoint"
    alarms make the next step save urgently on every rank (and ``elevated_every`` the interval
    while a node is at risk), its "node_failed" events evict the workers on the lost GPU
    (``evictions.on_node_failed``) instead of ending the job."""
    try:
        return _run(build, step, steps=steps, checkpoint=checkpoint, state_of=state_of, save_every=save_every,
                    resume_step=resume_step, collective_timeout_s=collective_timeout_s,
                    membership_timeout_s=membership_timeout_s, on_recovery=on_recovery, warm_up=warm_up,
                    listener=listener, elevated_every=elevated_every)
    except FallBack as e:
        log.error("ckpt-guard inprocess: falling back to a relaunch: %s", e)
        _tell_launcher(str(e))
        flush_logs()
        os._exit(EXIT_FALLBACK)
    except CanaryFailed as e:  # a second failed canary (``_stops``): a relaunch would go back again
        log.error("ckpt-guard inprocess: the job stops: %s", e)
        _tell_launcher(str(e))
        flush_logs()
        os._exit(EXIT_STOP)


def _run(build: Callable[[Context], T], step: Callable[[T, int], Any], *, steps: int, checkpoint: Mapping[str, Any],
         state_of: Callable[[T], dict], save_every: int, resume_step: int | None, collective_timeout_s: float,
         membership_timeout_s: float, on_recovery: Callable[[Recovery], None] | None,
         warm_up: Callable[[], Any] | None, listener: RiskListener | None,
         elevated_every: int | None) -> Result[T]:
    # What exists now (torch and the user's imports) is never garbage: frozen, it is left out of
    # the full collection each recovery runs, which took 0.15 s of a 0.35 s recovery here
    gc.freeze()
    store = membership.worker_store(membership_timeout_s)
    worker = int(os.environ[WORKER_ENV])
    die_with_launcher()
    gpu = int(os.environ.get("LOCAL_RANK", worker))
    evictions.announce_place(store, worker, node_name(checkpoint.get("node")), gpu)
    if listener is not None:
        listener.on_node_failed = evictions.on_node_failed(store)
    watched = _Watched()
    _start_beating(worker, membership_timeout_s, watched)
    current = _first_round(store, worker, membership_timeout_s, warm_up)
    recoveries: list[Recovery] = []
    pending: tuple[float, str, int | None, dict[str, float]] | None = None  # a recovery in progress
    if current.round:  # a warm spare called in: its recovery starts when it learns of the round
        pending = (time.monotonic(), current.reason, None, {"fault_time": current.fault_time})
    while True:
        rank = current.rank_of(worker)
        t_join = time.monotonic()
        ctx = Context(rank, len(current.members), current.round, worker)
        mgr: CheckpointManager | None = None
        progress = Steps()
        restoring = False
        recovered_before = len(recoveries)
        try:
            # a live member may be held up to a collective timeout in an older round's set-up
            # before it learns of this one (a second fault during a recovery): it is waited for
            group.join(store.store, current.round, rank, len(current.members), collective_timeout_s,
                       arrival_s=collective_timeout_s + membership_timeout_s,
                       check=partial(_raise_if_changed, store, current.round))
            t_group = time.monotonic()
            objects = build(ctx)
            t_build = time.monotonic()
            with group.holding(current.round):  # the job's start-up swept the leftovers: a recovery does not
                mgr = CheckpointManager(**{"node_memory": True, "control_timeout_s": collective_timeout_s,
                                           **checkpoint, "sweep": current.round == 0})
            watched.round, watched.mgr = current.round, mgr
            state = state_of(objects)
            first = resume_step if current.round == 0 else None
            restoring = True
            restored = mgr.restore(state, step=first)
            restoring = False
            mgr.prepare(state)  # the slots sized in the background: the first save does not allocate them
            progress.done = restored or 0
            marks = (t_join, t_group, t_build, time.monotonic())
            recovered = None if pending is None else partial(_finish, pending, current, ctx, restored, marks)
            progress.train(objects, step, mgr, state, steps=steps, save_every=save_every,
                           before=partial(_raise_if_changed, store, current.round),
                           after=lambda done, r=current.round: store.put(membership.step_key(worker), str(done),
                                                                      round=r),
                           first=recovered and partial(record, recoveries, on_recovery, recovered),
                           listener=listener, elevated_every=elevated_every)
            mgr.close()  # finished: this rank's memory slots go once every save is durable
            return Result(objects, progress.done, recoveries)
        except Exception as e:
            t_fault = time.monotonic()
            watched.mgr = None
            if _must_leave(e):  # its exit is a death like any other: a spare takes its rank, or the world shrinks
                log.error("ckpt-guard inprocess: rank %d leaves its process: a sticky device error (%s)", rank,
                          _short(e))
                flush_logs()
                os._exit(EXIT_LEAVE)
            if _stops(e):
                raise
            if _goes_back(e):  # every rank goes back together, in a round of its own
                membership.rewind(store, _short(e), current.round)
            # a restore refused by the checkpoints (no copy of a shard: not a peer's death) gets
            # no new round: wait only briefly for one (a peer lost meanwhile) before saying why
            wait_s = min(membership_timeout_s, 2.0) if restoring and isinstance(e, CheckpointError) else \
                membership_timeout_s
            nxt = membership.latest_after(store, current.round) or membership.wait_round(
                store, current.round + 1, wait_s)
            if nxt is None and restoring:
                raise FallBack(f"rank {rank} cannot restore: {_short(e, 2)}") from e
            if nxt is None:
                raise FallBack(f"rank {rank} failed at step {progress.done} ({e}) and no new membership came "
                               f"within {membership_timeout_s:.0f} s") from e
            t_round = time.monotonic()
            if mgr is not None:
                mgr.abandon()  # waits for a drain in flight (checksum, disk write) to end: the slots it reads
            t_abandoned = time.monotonic()
            group.leave()
            t_group_left = time.monotonic()
            del mgr
            gc.collect()  # the abandoned manager's cycles hold a store connection each: free them now
            t_left = time.monotonic()
            # the cause is the launcher's line and the recovery's (the reason); a broken collective's text is detail
            log.info("rank %d: step %d failed (%s); round %d: %s", rank, progress.done, _short(e), nxt.round,
                     nxt.reason)
            if nxt.rank_of(worker) is None:
                raise FallBack(f"worker {worker} is not in round {nxt.round}") from e
            phases = {"fault_time": nxt.fault_time, "membership_s": t_round - t_fault, "abort_s": t_left - t_round,
                      "abort_abandon_s": t_abandoned - t_round, "abort_leave_s": t_group_left - t_abandoned}
            if pending is not None and len(recoveries) == recovered_before:
                # a fault during the recovery itself: one recovery, from the first fault and its step
                pending = (pending[0], nxt.reason, pending[2], {**phases, "fault_time": pending[3]["fault_time"]})
            else:
                pending = (t_fault, nxt.reason, progress.done, phases)
            current = nxt


def _tell_launcher(reason: str) -> None:
    """Leave the reason of a fallback or a stop where the launcher reads it (its last line names
    the real cause, not only that a worker asked for a relaunch); best effort, the exit code says the rest."""
    try:
        store = membership.worker_store(5.0)
        store.put(membership.fallback_key(int(os.environ[WORKER_ENV])), reason[:500])
    except Exception as e:  # the launcher or its store is gone: nobody to tell
        log.debug("could not leave the fallback's reason: %s", e)


def die_with_launcher() -> None:
    """SIGKILL this worker when the launcher dies (Linux prctl PR_SET_PDEATHSIG), so a killed
    launcher leaves no training process behind; elsewhere the store going away ends it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ.get(LAUNCHER_ENV, os.getppid())):  # it died before the prctl
        os._exit(EXIT_FALLBACK)


@dataclass
class _Watched:
    """The round training runs in and its manager, for the beat thread."""

    round: int = 0
    mgr: CheckpointManager | None = None


def _start_beating(worker: int, timeout_s: float, watched: _Watched) -> None:
    """The launcher's frozen-rank detector: a daemon thread beats (its own store connection)
    every ``BEAT_S``; a stopped or wedged process stops. Each beat is a signed value with a
    higher sequence number (``control.py``): one replayed or forged by someone else keeps no
    frozen rank alive. It also ends the manager's commit waits once a newer round is
    published: a save blocked on a full memory slot whose drain waits for a lost rank's commit
    would otherwise never return to the step loop that notices the new round; and it breaks the round's group, so that a
    collective blocked on a rank whose host vanished (stopped, its sockets open) fails now."""
    def beat() -> None:
        store = None
        while True:
            try:
                if store is None:
                    store = membership.worker_store(timeout_s)
                store.put(membership.beat_key(worker), b"", round=watched.round)
                mgr = watched.mgr
                if mgr is not None and membership.changed(store, watched.round):
                    mgr.committer.abandon()
                    group.interrupt(watched.round)
            except Exception as e:  # a slow or restarting store: try again (a silent beat gets this rank killed)
                log.debug("beat: %s", e)
                store = None
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="ckpt-inprocess-beat", daemon=True).start()


def _first_round(store: Control, worker: int, timeout_s: float,
                 warm_up: Callable[[], Any] | None) -> membership.Membership:
    """Round 0, or for a warm spare the first round that names it (it waits, warmed up)."""
    m = membership.wait_round(store, 0, timeout_s)
    if m is not None and m.rank_of(worker) is None:
        if warm_up is not None:
            warm_up()
        store.put(membership.ready_key(worker), "1")
    while m is not None and m.rank_of(worker) is None:
        m = membership.wait_round(store, m.round + 1, float("inf"))
    if m is None:
        raise FallBack(f"worker {worker}: no membership round names it (the job ended or the launcher is gone)")
    return m


def _finish(pending: tuple, current: membership.Membership, ctx: Context, restored: int | None,
            marks: tuple[float, float, float, float]) -> Recovery:
    """The recovery record, at its first resumed step: ``marks`` are when the round began and
    its group, build and restore ended."""
    t_fault, reason, failed_at, phases = pending
    t_join, t_group, t_build, t_restore = marks
    now = time.monotonic()
    phases = {**phases, "process_group_s": t_group - t_join, "build_s": t_build - t_group,
              "restore_s": t_restore - t_build, "first_step_s": now - t_restore, "total_s": now - t_fault}
    rec = Recovery(current.round, reason, ctx.rank, ctx.world_size, restored, failed_at, time.time(), phases)
    # one line per recovery, the new rank 0's, with cause and phases (every rank's is kept, at INFO)
    log.log(logging.WARNING if ctx.rank == 0 else logging.INFO, "ckpt-guard inprocess recovery %s", rec.to_json())
    return rec


def _raise_if_changed(store: Control, round_id: int) -> None:
    """Before each step: a newer round (a predicted failure, an eviction) ends this one."""
    if membership.changed(store, round_id):
        raise _MembershipChanged()


# CUDA's sticky errors: after one, every call on that context fails, so the process must go
# (cudaErrorIllegalAddress, LaunchFailure, Assert, HardwareStackError, IllegalInstruction,
# MisalignedAddress, InvalidAddressSpace, InvalidPc, ECCUncorrectable; a lost GPU)
_STICKY = ("illegal memory access", "illegal instruction", "unspecified launch failure", "device-side assert",
           "hardware stack error", "misaligned address", "invalid address space", "invalid program counter",
           "uncorrectable ECC error", "fallen off the bus")


def _goes_back(e: BaseException) -> bool:
    """A suspect or unhealthy snapshot, or a failed canary (the first time: a second one stops
    the job): the state is not sound, no rank died, and every rank must go back to the newest
    sound step."""
    return isinstance(e, UnsoundState) or (isinstance(e, CanaryFailed) and not e.stop)


def _stops(e: BaseException) -> bool:
    """A canary failed a second time in this run: going back again, in process or by a relaunch,
    would only loop (Megatron-LM #5281), so every rank ends the job with the reason."""
    return isinstance(e, CanaryFailed) and e.stop


def _must_leave(e: BaseException) -> bool:
    """A sticky CUDA error (the context is unusable; XID 79 leaves one) is never resumed in place."""
    text = str(e)
    return "CUDA error" in text and any(s in text for s in _STICKY)


def _short(e: BaseException, lines: int = 1) -> str:
    """The first ``lines`` of an error's text (a restore's refusal says why on its second)."""
    return " / ".join(line.strip() for line in str(e).splitlines()[:lines])[:100 + 200 * lines] if str(e) else \
        type(e).__name__
