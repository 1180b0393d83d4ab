"""Hang detection: a rank that stops reaching step boundaries ends the job in seconds.

A rank whose GPU fell off the bus, whose kernel hangs or whose process was stopped
stays alive and silent; its peers wait in their next collective until its timeout
(minutes), and a stopped process even outlives torchrun's SIGTERM grace. So every
rank runs a ``Watchdog`` thread that talks through the job's key-value store only
(never a collective: it would block on the hung rank):

* **Progress** costs the training thread two attribute writes per step boundary
  (``boundary()``); the thread publishes ``<boundaries> <beat>`` once per
  ``interval_s``, aggregated per node (``ckpt.heartbeat``): one store write per node
  per interval, whatever the step rate and the number of ranks.
* **Deadline** (``ckpt.hang_policy``, which says why): ``factor`` × the median of the
  measured step times, at least ``floor_s`` (or ``deadline_s``, fixed); at least
  ``first_steps_s`` until ``warmup_steps`` steps are measured; longer while a blocking
  save runs on any rank (``saving()``); a frozen peer is declared before it.
* **Verdict**: a rank whose own training thread has not reached a boundary within
  the deadline declares the job hung. Only then (from four intervals before) does it
  read every rank's beat (the nodes' keys), once per interval, to name the culprit: a rank whose beat
  stopped changing is *frozen* (stopped, or wedged with its interpreter); else the
  ranks with fewest boundaries are *behind*; else no single rank is to blame (a hang
  inside a collective or a kernel). A live culprit, or every rank when none is named,
  dumps its own Python stacks.
* **Exit**: the detecting rank logs rank, node and silence, SIGKILLs every culprit
  that runs on its own host (published pid, checked against the process start time;
  a frozen one that is not stopped is asked for its stacks first with SIGUSR2, which
  faulthandler answers without the interpreter; a stopped one cannot answer), and
  ``os._exit(EXIT_HUNG)``: unwinding could block in teardown barriers. A culprit
  alone on its host is not killed here: its agent stops it after the grace it gives
  workers it stops for a restart (30 s, fixed in torch 2.13; ``--shutdown-timeout``
  applies only when the agent itself exits).
* **Restart timing** (``ckpt.restarts``): the fault and the exits go to the node's
  restart file; the next incarnation logs one line with the restart's phases.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..coordination import store_connector
from . import quarantine
from .hang_policy import FROZEN_POLLS, OBSERVE_INTERVALS, HangDetection
from .heartbeat import DONE, NodeBeats
from .leaving import flush_logs
from .process_identity import Identity, proc_stat, started, this_process
from .restarts import EVENTS_FILE, RestartRecorder, previous_records, process_marks, restart_reporter

if TYPE_CHECKING:
    from ..manager import CheckpointManager

log = logging.getLogger(__name__)

EXIT_HUNG = 86  # this rank ended the job: some rank stopped reaching step boundaries
EXIT_NODE_FAILED = 87  # this rank ended the job: a node of the job failed (the predictor said so)
_DEFAULTS = HangDetection()
_DUMP_SIGNAL = signal.SIGUSR2  # faulthandler dumps the Python stacks of a rank on it


class Watchdog:
    """One rank's hang detector; ``store`` returns the calling thread's client of the job's
    store, keys private to this incarnation (``distributed.store_connector``); ``beats``
    this rank's side of its node's beats; ``recorder`` takes the fault and exit records
    for the next incarnation's restart timing; ``on_first_boundary`` is called with the
    time of this incarnation's first step boundary."""

    def __init__(self, store: Callable[[], object], beats: NodeBeats, rank: int, world_size: int,
                 options: HangDetection = _DEFAULTS, *, exit: Callable[[int], None] = os._exit,
                 recorder: RestartRecorder | None = None,
                 on_first_boundary: Callable[[float], None] | None = None) -> None:
        self.options, self.rank, self.world_size = options, rank, world_size
        self._store, self.beats, self._exit = store, beats, exit
        self.recorder = recorder or RestartRecorder(None, "", rank, beats.node)
        self._on_first_boundary = on_first_boundary
        self.me = this_process(rank)
        self._boundaries = 0
        self._last = time.monotonic()  # the last boundary (or start) on the training thread
        self._paused = False  # something else than a step ran since the last boundary
        self._frozen_s = 0.0  # how long this process itself did not run, seen by the watchdog thread
        self._warned = 0.0  # the boundary (its time) after which a stall was last announced
        self._step_times: deque[float] = deque(maxlen=64)
        self._save_times: deque[float] = deque(maxlen=16)  # blocking saves measured (``saving``)
        self._saving_since: float | None = None  # a blocking save runs on the training thread
        self._seen: dict[int, tuple[bytes, int]] = {}  # rank -> (its last value, polls unchanged)
        self._woke = self._next_beat = time.monotonic()  # the thread's last turn, its next beat
        self._beat_count, self._unreachable = 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if signal.getsignal(_DUMP_SIGNAL) == signal.SIG_DFL:  # never take a handler the program set
            faulthandler.register(_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        self._store().set(f"who/{self.rank}", self.me.encode())
        self._last = time.monotonic()
        # Report at once, not at the thread's first turn: a rank stopped before that (fast
        # first steps) would read "never reported", which only the full deadline can judge.
        self._beat(self._beat_count)
        self._thread.start()
        atexit.register(self._ended)
        return self

    def boundary(self) -> None:
        """The training thread reached a step boundary (the interval since the previous
        one is a step time; the first, which includes start-up, is not)."""
        now = time.monotonic()
        if self._boundaries and not self._paused:
            self._step_times.append(now - self._last)
        self._boundaries += 1
        self._last, self._paused, self._frozen_s = now, False, 0.0
        if self._boundaries == 1 and self._on_first_boundary is not None:
            self._on_first_boundary(time.time())

    def progress(self) -> None:
        """Progress that is not a training step (an evaluation batch): resets the clock;
        the next step time is not measured, since it includes the evaluation."""
        self._last, self._paused = time.monotonic(), True

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A blocking save on the training thread: not a step, not a hang. Meanwhile the
        deadline grows by the save's allowance (``HangDetection.save_allowance``) and the
        beat says so, for peers that wait for this save in their next collective."""
        self._saving_since = time.monotonic()
        try:
            yield
        finally:
            self._save_times.append(time.monotonic() - self._saving_since)
            self._saving_since = None
            self.progress()

    def close(self, *, finished: bool = True) -> None:
        """Training is over on this rank (``finished``), or unwinding: stop watching, tell
        the peers. Unwinding, an uncaught exception that ends the process is recorded for
        the next incarnation's restart timing (at exit)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if finished:
            atexit.unregister(self._ended)
        self._thread.join(timeout=self.options.interval_s + 5.0)
        try:
            self.beats.done()
        except (RuntimeError, OSError) as e:  # the store may be gone at the end of a job
            log.debug("watchdog: could not say done: %s", e)

    def _ended(self) -> None:
        """The interpreter exits before training was over: an uncaught exception (a peer
        died, or the program's own error) ends this rank, which the restart timing counts
        as the fault's detection."""
        error = getattr(sys, "last_value", None)
        if error is not None:
            self.recorder.fault(f"rank {self.rank} ended by {type(error).__name__}: {str(error)[:200]}", time.time())
            self.recorder.left()

    def deadline(self) -> float:
        """This rank's own deadline now (a save's allowance added while one runs)."""
        saving = self._saving_since is not None
        return self.options.deadline(list(self._step_times)) + (self._allowance() if saving else 0.0)

    def _allowance(self) -> float:
        return self.options.save_allowance(list(self._save_times))

    def fail(self, reason: str, *, node: str | None = None, fault_t: float | None = None) -> None:
        """Stop the whole job now (``node`` failed, at ``fault_t``): every rank's watchdog
        sees it within two polls (its node's aggregator's, then its own of the relay) and
        exits with EXIT_NODE_FAILED. Any thread may call it."""
        now = time.time()
        self.beats.fail(json.dumps({"reason": reason, "node": node, "t": fault_t or now, "at": now}))

    def _run(self) -> None:
        tick = min(self.options.interval_s, self.options.poll_s)
        self._woke = self._next_beat = time.monotonic()
        while not self._stop.wait(tick):
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """One turn of the watchdog thread at monotonic time ``now``: the failed key each
        poll, a beat (and, when stalled, the verdict) each interval."""
        interval = self.options.interval_s
        if now - self._woke > 2 * interval:  # this thread did not run: the whole process was stopped
            self._frozen_s = now - self._woke
        self._woke = now
        try:
            failed = self.beats.failed()
            if failed is not None:
                self._stopped_by(failed)
                return
            if now >= self._next_beat:
                self._next_beat, self._beat_count = now + interval, self._beat_count + 1
                self._beat(self._beat_count)
            self._unreachable = False
        except (RuntimeError, OSError) as e:  # the store unreachable: the job is ending anyway
            if not self._unreachable:
                log.warning("watchdog: job store unreachable (%s); hang detection paused", e)
            self._unreachable = True

    def _stopped_by(self, failed: str) -> None:
        try:
            why = json.loads(failed)
        except ValueError:
            why = {"reason": failed}
        self.recorder.fault(why.get("reason", ""), why.get("t") or time.time(), [why["node"]] if why.get("node")
                            else [])
        log.critical("rank %d: job stopped: %s; exiting with code %d", self.rank, why.get("reason"), EXIT_NODE_FAILED)
        # Every rank leaves at the same moment, once all have seen the key: one that left at
        # once would break its peers' collectives before they could say why they stop.
        together = 2 * self.options.poll_s + 0.1
        time.sleep(min(together, max(0.0, (why.get("at") or 0.0) + together - time.time())))
        self._leave(EXIT_NODE_FAILED)

    def _beat(self, beat: int) -> None:
        saving = f" saving {self._allowance():.1f}" if self._saving_since is not None else ""
        self.beats.publish(f"{self._boundaries} {beat}{saving}")
        last = self._last
        stalled, deadline, interval = time.monotonic() - last, self.deadline(), self.options.interval_s
        if stalled >= deadline / 2 and self._warned != last:  # never wait silently
            self._warned = last
            log.warning("rank %d: no step boundary for %.1f s; declared hung at %.1f s", self.rank, stalled, deadline)
        watch = self.options.frozen_watch(list(self._step_times))
        if stalled < min(deadline - OBSERVE_INTERVALS * interval, float("inf") if watch is None else watch):
            self._seen.clear()
            return
        self._observe()
        deadline += self._peers_saving()
        frozen = watch is not None and stalled >= watch and bool(self._frozen())
        if (frozen or stalled >= deadline) and not self._stop.is_set():
            self._declare(self._store(), stalled, deadline)

    def _peers_saving(self) -> float:
        """The longest allowance of a peer whose beat says it is in a blocking save."""
        fields = [v.split() for v, _ in self._seen.values() if v and v != DONE]
        return max((float(f[3]) for f in fields if len(f) == 4 and f[2] == "saving"), default=0.0)

    def _frozen(self) -> list[int]:
        """Live ranks whose beat stayed unchanged for ``FROZEN_POLLS`` polls."""
        return [r for r, (v, n) in self._seen.items() if v and v != DONE and n >= FROZEN_POLLS]

    def _observe(self) -> None:
        """Read every rank's beat; count the polls each has stayed unchanged."""
        beats = self.beats.read_all()
        for r in range(self.world_size):
            value = beats.get(r, "")
            old, unchanged = self._seen.get(r, (None, -1))
            self._seen[r] = (value, unchanged + 1 if value == old else 0)

    def _culprits(self) -> tuple[str, list[int]]:
        live = {r: v for r, (v, _) in self._seen.items() if v != DONE}
        frozen = self._frozen()
        if frozen:
            return "frozen (its process has not run for the last polls)", frozen
        steps = {r: int(v.split()[0]) for r, v in live.items() if v}
        missing = [r for r in live if not live[r]]
        if missing:
            return "never reported", missing
        if steps and len(set(steps.values())) > 1:
            low = min(steps.values())
            return f"behind (at boundary {low}, others further)", [r for r, s in steps.items() if s == low]
        return "", []

    def _declare(self, store: object, stalled: float, deadline: float) -> None:
        why, culprits = self._culprits()
        if self._frozen_s:  # this process was stopped, then continued (by hand, or a debugger)
            why, culprits = f"this rank's own process did not run for {self._frozen_s:.1f} s", [self.rank]
        who = _identities(store, culprits)
        median = statistics.median(self._step_times) if self._step_times else float("nan")
        names = ", ".join(f"rank {r} on node {who[r].node} (pid {who[r].pid})" if r in who else f"rank {r}"
                          for r in culprits)
        seen = f"{why}: {names}" if culprits else self._no_culprit()
        log.critical("hang detected by rank %d: no step boundary for %.1f s (deadline %.1f s, median step %.3f s); "
                     "%s; exiting with code %d", self.rank, stalled, deadline, median, seen, EXIT_HUNG)
        self.recorder.fault(f"hang: {seen if culprits else seen[:300]}", time.time() - stalled,
                            [who[r].node for r in culprits if r in who])
        if self.rank in culprits or not culprits:
            log.critical("rank %d: this rank's Python stacks follow", self.rank)
            flush_logs()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for r in culprits:
            if r in who and who[r].pid != self.me.pid and who[r].host == self.me.host:
                self._kill(who[r], ask_stacks=why.startswith("frozen"))
        self._leave(EXIT_HUNG)

    def _no_culprit(self) -> str:
        """What was seen when every rank is alive at the same boundary: steps that grew
        until one passed the deadline are said to be that, not a hang."""
        times = list(self._step_times)
        last, median = times[-3:], statistics.median(times) if times else 0.0
        seen = f"every rank is alive at boundary {self._boundaries}, none frozen or behind"
        if len(last) == 3 and last[0] < last[1] < last[2] and last[2] >= 2 * median:
            return (f"{seen}; the steps were slowing down (the last three took "
                    f"{', '.join(f'{t:.2f}' for t in last)} s, median {median:.2f} s) until this one passed the "
                    "deadline: a job slowing down, not necessarily a hang")
        return f"{seen}; this step is past the deadline: a hang inside a collective or a kernel, or a step that slow"

    def _leave(self, code: int, *message: object) -> None:
        """Exit at once (unwinding could block in a collective or a teardown barrier)."""
        if message:
            log.critical(f"{message[0]}; exiting with code {code}", *message[1:])
        self.recorder.left()
        flush_logs()
        self._stop.set()
        self._exit(code)

    def _kill(self, target: Identity, *, ask_stacks: bool) -> None:
        """SIGKILL a hung rank of this host. A frozen one that is not stopped is asked for
        its stacks first (faulthandler's handler runs without the interpreter's lock); a
        live one dumps its own; a stopped one can give none without running again."""
        if not target.started or started(target.pid) != target.started:
            log.warning("watchdog: rank %d (pid %d) is gone already, or its start time is unknown: not killed",
                        target.rank, target.pid)
            return
        stopped = proc_stat(target.pid)[:1] in (["T"], ["t"])
        try:
            if stopped:
                log.critical("watchdog: rank %d (pid %d) is stopped (SIGSTOP or a debugger): no stack dump",
                             target.rank, target.pid)
            else:
                if ask_stacks:
                    os.kill(target.pid, _DUMP_SIGNAL)
                deadline = time.monotonic() + self.options.kill_grace_s
                while time.monotonic() < deadline and started(target.pid) == target.started:
                    time.sleep(0.05)
            if started(target.pid) == target.started:
                os.kill(target.pid, signal.SIGKILL)
                self.recorder.left(target.rank)
                log.critical("watchdog: SIGKILLed hung rank %d (pid %d on node %s)", target.rank, target.pid,
                             target.node)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log.error("watchdog: cannot kill hung rank %d (pid %d): %s", target.rank, target.pid, e)


def start_watchdog(mgr: CheckpointManager, options: HangDetection | None) -> Watchdog | None:
    """Every rank's watchdog for ``mgr``'s job (call at the same point on every rank, after
    the restore: one all-gather agrees on a namespace for this incarnation and brings the
    last restart's records to rank 0, which logs its timing); None when alone or disabled."""
    options = options or HangDetection()
    if mgr.world_size == 1:
        return None
    me, ns = this_process(mgr.rank), Path(mgr._ns)  # the job's node-local shared-memory directory
    events = ns / EVENTS_FILE
    strikes = quarantine.record_path(mgr.disk.root if mgr.disk is not None else ns, mgr.run)
    gathered = mgr.coord.gather((uuid.uuid4().hex, me.node, previous_records(events), process_marks(),
                                 quarantine.read(strikes)))
    incarnation, nodes = gathered[0][0], [g[1] for g in gathered]
    records = list({json.dumps(r, sort_keys=True): r for g in gathered for r in g[2]}.values())
    quarantine.enforce(strikes, [g[4] for g in gathered], records, nodes, me.node,
                       limit=options.quarantine_strikes, window_s=options.quarantine_window_s,
                       barrier=mgr.coord.barrier)
    report = None
    if mgr.rank == 0 and (records or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))):
        report = restart_reporter(records, [g[3] for g in gathered])
    for old in ns.glob("beats-*"):
        if old.name != f"beats-{incarnation}":
            shutil.rmtree(old, ignore_errors=True)
    if not options.enabled:
        if report is not None:
            report(None)
        return None
    store = store_connector(f"{mgr.run}/{incarnation}/watchdog", timeout_s=30.0)
    beats = NodeBeats(store, ns / f"beats-{incarnation}", mgr.rank, me.node, nodes, options.interval_s)
    recorder = RestartRecorder(events, incarnation, mgr.rank, me.node)
    return Watchdog(store, beats, mgr.rank, mgr.world_size, options, recorder=recorder,
                    on_first_boundary=report).start()


def on_node_failed(watchdog: Watchdog | None) -> Callable[[dict], None]:
    """What a "node_failed" event from the predictor does: stop every rank of the job
    (through the watchdogs' store key), or this lone process at once."""
    def stop(event: dict) -> None:
        reason = f"the predictor reports node {event.get('node')} failed ({event.get('reason')})"
        if watchdog is not None:  # the agent's sample time: the fault, for the restart timing
            sampled = event.get("sampled_at_ms")
            watchdog.fail(reason, node=event.get("node"),
                          fault_t=sampled / 1000 if isinstance(sampled, (int, float)) else None)
        else:
            log.critical("%s; exiting with code %d", reason, EXIT_NODE_FAILED)
            flush_logs()
            os._exit(EXIT_NODE_FAILED)
    return stop


def _identities(store: object, ranks: list[int]) -> dict[int, Identity]:
    keys = [f"who/{r}" for r in ranks]
    present = [k for k in keys if store.check([k])]
    return {i.rank: i for i in (Identity.decode(v.decode()) for v in store.multi_get(present))} if present else {}
