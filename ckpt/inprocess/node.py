"""One node's part of an in-process-recovering job: run this node's workers, watch them, report.

The job launcher (``launch.Job``) decides membership for every node through the store; a node
launcher runs the workers the rounds assign to it (its node's part of each round,
``membership.NodeRound``: the first round's, then each spare that tops up the pool), reports
each exit (``membership.exit_key``) instead of acting on it, holds a lifeline and beats
(``lifeline.py``: its end, or silence for ``--hang-s`` on ``membership.node_key``, loses the
node, all its members at once) and SIGKILLs those of its members that are evicted, frozen or
left behind: the frozen check reads /proc, which is local. It reads and writes every key signed
(``control.py``).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..control import Control, control_key
from ..recovery.hang_policy import HangDetection
from . import lifeline, membership, progress
from .preload import WORKER_DEFAULTS, Forked, Starter
from .protocol import BEAT_S, LAUNCHER_ENV, WORKER_ENV

log = logging.getLogger("ckpt.inprocess.node")
POLL_S = 0.01  # a launcher tick


def _cpu_ticks(pid: int) -> int:
    """User + system clock ticks a process has used (Linux /proc); -1 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class NodeLauncher:
    """The workers of node ``node``; ``poll()`` once per launcher tick."""

    def __init__(self, store: Control, node: int, *, master: tuple[str, int], command: list[str],
                 attempt: int, hang_s: float, progress_s: float | None, start: Starter | None = None) -> None:
        self.store, self.node, self.command, self.hang_s = store, node, command, hang_s
        self.start = start or Starter([], {})  # forks workers from a preloaded template, or Popen
        first = membership.wait_round(store, 0, 300.0, node)
        if first is None:
            raise RuntimeError(f"node {node}: the job launcher published no first round")
        self.current = first
        self.env = {**WORKER_DEFAULTS, **os.environ, "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
                    "WORLD_SIZE": str(first.world), membership.ATTEMPT_ENV: str(attempt),
                    LAUNCHER_ENV: str(os.getpid())}
        self.procs: dict[int, subprocess.Popen | Forked] = {}
        self.reported: set[int] = set()  # workers whose exit is in the store
        self.finished: set[int] = set()
        self.causes: dict[int, str] = {}  # workers this node launcher killed, and why
        # worker -> ((beat count, CPU ticks), when either last changed): a process starved of the
        # interpreter lock on a busy machine still uses CPU; a stopped one does not
        self.beats: dict[int, tuple[tuple[int, int], float]] = {}
        # the watchdog's progress deadline (hang_policy), judged here on this node's members' steps
        # against the job's lowest and highest (``progress.py``)
        self.progress_policy = HangDetection(deadline_s=progress_s, interval_s=BEAT_S)
        self.progress = progress.Steps()
        self.split_at: float | None = None  # since when the members' steps differ
        self.beat_at = self.watched_at = 0.0
        self._start_assigned()
        log.info("node %d: workers %s (pids %s)", node, sorted(self.procs), {w: p.pid for w, p in self.procs.items()})

    def _start_assigned(self) -> None:
        """Start this node's members of the current round (in rank order), then its spares, those
        not started yet. Its part of the round names these alone: a node reads a few ids a round,
        not every member of the job (N/8 nodes x N)."""
        ranks = dict(self.current.members)
        for w in (w for w in [*ranks, *self.current.spares] if w not in self.procs):
            rank = ranks.get(w)
            self.procs[w] = self.start(self.command, {
                **self.env, WORKER_ENV: str(w), "RANK": str(-1 if rank is None else rank),
                "LOCAL_RANK": str(len(self.procs))})
        self.here = list(ranks)

    def poll(self) -> bool:
        """Beat, follow the rounds, report exits, kill the members to kill; False once the job is over."""
        now = time.monotonic()
        newer = membership.latest_after(self.store, self.current.round, self.node)
        if newer is not None:
            self.current = newer
            self.progress.new_round()
            self._start_assigned()
        exited = False
        for w, p in self.procs.items():
            code = p.poll()
            if code is None or w in self.reported:
                continue
            self.reported.add(w)
            exited = True
            if code == 0:
                self.finished.add(w)
            self.store.put(membership.exit_key(w), json.dumps({"code": code,
                                                               "cause": self.causes.get(w, _exit_text(code))}),
                           round=self.current.round)
        if exited or now - self.beat_at >= BEAT_S:  # the beat lists the exits reported: the job launcher reads them
            self.store.put(membership.node_key(self.node), json.dumps(sorted(self.reported)), round=self.current.round)
            self.beat_at = now
        if exited:
            self.store.store.set(membership.EXITS_KEY, b"1")  # the job launcher reads the beats now, not in a BEAT_S
        if now - self.watched_at >= BEAT_S:  # beats and steps change once a BEAT_S: read them as often
            self.watched_at = now
            self._kill_frozen_and_evicted(now)
        elif len(self.progress.times) < self.progress_policy.warmup_steps:
            # until the deadline has its warm-up's step times, its members' steps every tick: the first
            # steps may be faster than a BEAT_S, and with none timed the deadline stays at its warm-up
            self.progress.read(self.store, self._live(), self.current.round, now)
        return not self.store.has(membership.DONE_KEY)

    def _mine(self) -> list[int]:
        """This node's members of the current round, alive and not killed."""
        return [w for w in self.here if w not in self.causes and self.procs[w].poll() is None]

    def _live(self) -> list[int]:
        """This node's members of the current round not killed here nor finished."""
        return [w for w in self.here if w not in self.causes and w not in self.finished]

    def _kill_frozen_and_evicted(self, now: float) -> None:
        """A member whose beat stopped for ``hang_s`` (a blocked gloo collective cannot be
        aborted: it is killed, never waited out), or one evicted through the store, is
        SIGKILLed; its exit then starts the next round like any other death."""
        mine = self._mine()
        evicts = self.store.many([membership.evict_key(w) for w in mine])
        beats = self.store.many_signed([membership.beat_key(w) for w in mine])
        for w, why, beat in zip(mine, evicts, beats):
            if why is not None:
                self._kill(w, f"evicted: {why.decode(errors='replace')[:200]}")
                continue
            progress = (0 if beat is None else beat.seq, _cpu_ticks(self.procs[w].pid))
            last, since = self.beats.get(w, ((-1, -1), now))
            if progress != last:
                self.beats[w] = (progress, now)
            elif progress[0] > 0 and now - since > self.hang_s:
                self._kill(w, f"frozen: no beat and no CPU time for {now - since:.1f} s")
        self._kill_behind(now)

    def _kill_behind(self, now: float) -> None:
        """The watchdog's progress deadline with its "behind" culprit rule: a member of this node,
        alive and beating, whose step stayed at the job's lowest while others (on any node) are
        further, for ``factor`` × the median step (at least ``--progress-s`` when given), is
        SIGKILLed. The job's lowest and highest step come from the job launcher (``progress.py``).
        Only steps taken in this round count (a survivor still joining the round's group is not
        behind). Ranks all at one step (a hang inside a collective) name no culprit: the
        collective timeout, then a relaunch, handles them."""
        reached = self.progress.read(self.store, self._live(), self.current.round, now)
        span = progress.job_range(self.store, self.current.round)
        if span is None or span[0] == span[1]:
            self.split_at = None
            return
        self.split_at = self.split_at or now  # a member is behind only as long as the others are ahead
        times = list(self.progress.times)
        deadline = self.progress_policy.deadline(times)
        for w, (s, since) in reached.items():
            if s <= span[0] and now - max(since, self.split_at) > deadline and w in self._mine():
                median = statistics.median(times) if times else float("nan")
                self._kill(w, f"behind: at step {s} for {now - since:.1f} s while others are further "
                              f"(deadline {deadline:.1f} s, median step {median:.3f} s)")

    def _kill(self, worker: int, cause: str) -> None:
        self.causes[worker] = cause
        self.procs[worker].kill()
        log.warning("worker %d: %s; killed", worker, cause)

    def stop(self) -> None:
        """The job is over (or this node launcher leaves it): end what is left of its workers."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()


def run_node(node: int, master: tuple[str, int], command: list[str], hang_s: float,
             progress_s: float | None, start: Starter | None = None) -> int:
    """A node launcher on a node other than the job launcher's, until the job is over: 0 when
    it ended well. When the job launcher launches the job again, this node takes part in the
    new attempt (its keys on the same store). A job launcher gone (its store unreachable) ends
    this node's workers too."""
    base = dist.TCPStore(master[0], master[1], is_master=False, timeout=timedelta(seconds=60))
    key, attempt = control_key(), 0
    while True:
        store = membership.of_attempt(base, attempt, key)
        try:
            line = lifeline.hold(store, master[0], node)  # open while this process lives: its end is news
            launcher = NodeLauncher(store, node, master=master, command=command, attempt=attempt, hang_s=hang_s,
                                    progress_s=progress_s, start=start)
        except RuntimeError as e:
            log.error("node %d: attempt %d never started (%s)", node, attempt, e)
            return 1
        try:
            while launcher.poll():
                time.sleep(POLL_S)
            ok = store.get(membership.DONE_KEY) == b"done"
            again = store.has(membership.RELAUNCH_KEY)
        except RuntimeError as e:  # torch's store errors (DistStoreError) are RuntimeErrors
            log.error("node %d: the job launcher's store is gone (%s): ending this node's workers", node, e)
            return 1
        finally:
            launcher.stop()
        store.put(membership.left_key(node), "1")
        line.close()
        if not again:
            return 0 if ok else 1
        attempt += 1
        log.warning("node %d: the job is launched again (attempt %d)", node, attempt)
