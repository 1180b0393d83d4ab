"""``python -m ckpt.inprocess.launch``: the one command that starts an in-process-recovering job.

    python -m ckpt.inprocess.launch --nproc 3 --spares 1 train.py [args]

torchrun's agent stops every local worker when one fails; this launcher keeps the healthy
ones. It hosts the job's store (MASTER_ADDR/MASTER_PORT for the workers), starts ``--nproc``
workers and ``--spares`` warm spares (started with the job: torch imported, no shard, waiting),
and decides membership (``membership.py``): when a member exits with an error, a spare takes
its rank, else the world shrinks (down to ``--min-world``). A member whose beat and CPU time
stopped (``--hang-s``: SIGSTOP, a process wedged in the kernel) or that is evicted through the store
(``membership.evict``: a predicted node failure, an XID 79) or that is left behind by the
others past the watchdog's progress deadline (``--progress-s``) is SIGKILLed first. A spare
called in is replaced by a new one, so the pool stays at ``--spares``. A worker that asks for it
(``EXIT_FALLBACK``), or a job that cannot shrink further, is relaunched whole, today's path,
at most ``--relaunches`` times; every decision is logged with its reason.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..recovery.hang_policy import HangDetection
from . import membership
from .runner import BEAT_S, EXIT_FALLBACK, LAUNCHER_ENV, WORKER_ENV

log = logging.getLogger("ckpt.inprocess.launch")
_POLL_S = 0.01


def _cpu_ticks(pid: int) -> int:
    """User + system clock ticks a process has used (Linux /proc); -1 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Job:
    """One launch of the workers (a relaunch is a new Job on a new store)."""

    def __init__(self, args: argparse.Namespace, attempt: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        n = args.nproc
        self.members, self.spares = list(range(n)), list(range(n, n + args.spares))
        self.min_world, self.round = args.min_world, 0
        self.finished: set[int] = set()
        self.hang_s = args.hang_s
        # worker -> ((beat count, CPU ticks), when either last changed): a process starved of the
        # interpreter lock on a busy machine still uses CPU; a stopped one does not
        self.beats: dict[int, tuple[tuple[int, int], float]] = {}
        self.causes: dict[int, str] = {}  # workers the launcher killed, and why
        # the watchdog's progress deadline (hang_policy), judged here: worker -> (step, when it last changed)
        self.progress_policy = HangDetection(deadline_s=args.progress_s, interval_s=BEAT_S)
        self.steps: dict[int, tuple[int, float]] = {}
        self.step_times: deque[float] = deque(maxlen=64)
        self.command = args.command
        self.env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "WORLD_SIZE": str(n), "CKPT_INPROCESS_ATTEMPT": str(attempt), LAUNCHER_ENV: str(os.getpid())}
        membership.publish(self.store, membership.Membership(0, tuple(self.members), tuple(self.spares),
                                                             "start", 0.0))
        self.procs: dict[int, subprocess.Popen] = {}
        for w in [*self.members, *self.spares]:
            self._start(w)
        log.info("attempt %d: workers %s, spares %s (pids %s)", attempt, self.members, self.spares,
                 {w: p.pid for w, p in self.procs.items()})

    def _start(self, worker: int) -> None:
        rank = self.members.index(worker) if worker in self.members else -1
        self.procs[worker] = subprocess.Popen([sys.executable, *self.command],
                                              env={**self.env, WORKER_ENV: str(worker), "RANK": str(rank),
                                                   "LOCAL_RANK": str(worker)})

    def watch(self) -> tuple[bool, str]:
        """Until the members have finished (True) or the job must be relaunched (False, why)."""
        seen: set[int] = set()
        while True:
            for w, p in list(self.procs.items()):
                code = p.poll()
                if code is None or w in seen:
                    continue
                seen.add(w)
                if w in self.spares:
                    self.spares.remove(w)
                    log.warning("spare %d left (%s)", w, _exit_text(code))
                elif code == 0:
                    self.finished.add(w)
                elif code == EXIT_FALLBACK:
                    return False, f"worker {w} asked for a relaunch"
                else:
                    cause = self.causes.pop(w, _exit_text(code))
                    why = self._replace(w, f"worker {w} (rank {self.members.index(w)}) {cause}")
                    if why:
                        return False, why
            if self.finished and self.finished >= set(self.members):
                return True, "done"
            self._kill_frozen_and_evicted()
            time.sleep(_POLL_S)

    def _kill_frozen_and_evicted(self) -> None:
        """A member whose beat stopped for ``hang_s`` (a blocked gloo collective cannot be
        aborted: it is killed, never waited out), or one evicted through the store, is
        SIGKILLed; its exit then starts the next round like any other death."""
        now = time.monotonic()
        for w in self.members:
            if w in self.causes or w in self.finished or self.procs[w].poll() is not None:
                continue
            if self.store.check([membership.evict_key(w)]):
                self._kill(w, f"evicted: {self.store.get(membership.evict_key(w)).decode()[:200]}")
                continue
            progress = (self.store.add(membership.beat_key(w), 0), _cpu_ticks(self.procs[w].pid))
            last, since = self.beats.get(w, ((-1, -1), now))
            if progress != last:
                self.beats[w] = (progress, now)
            elif progress[0] > 0 and now - since > self.hang_s:
                self._kill(w, f"frozen: no beat and no CPU time for {now - since:.1f} s")
        self._kill_behind(now)

    def _kill_behind(self, now: float) -> None:
        """The watchdog's progress deadline with its "behind" culprit rule: a member alive and
        beating whose step stayed below the others' for ``factor`` × the median step (at least
        ``--progress-s`` when given) is SIGKILLed. Ranks all at one step (a hang inside a
        collective) name no culprit: the collective timeout, then a relaunch, handles them."""
        live = [w for w in self.members if w not in self.causes and w not in self.finished]
        keys = [w for w in live if self.store.check([membership.step_key(w)])]
        for w, v in zip(keys, self.store.multi_get([membership.step_key(w) for w in keys]) if keys else []):
            step, since = self.steps.get(w, (-1, now))
            if int(v) != step:
                if int(v) == step + 1:
                    self.step_times.append(now - since)
                self.steps[w] = (int(v), now)
        reached = {w: self.steps[w] for w in keys}
        if len({s for s, _ in reached.values()}) < 2:
            return
        deadline = self.progress_policy.deadline(list(self.step_times))
        low = min(s for s, _ in reached.values())
        for w, (s, since) in reached.items():
            if s == low and now - since > deadline:
                median = statistics.median(self.step_times) if self.step_times else float("nan")
                self._kill(w, f"behind: at step {s} for {now - since:.1f} s while others are further "
                              f"(deadline {deadline:.1f} s, median step {median:.3f} s)")

    def _kill(self, worker: int, cause: str) -> None:
        self.causes[worker] = cause
        self.procs[worker].kill()
        log.warning("worker %d: %s; killed", worker, cause)

    def _replace(self, worker: int, cause: str) -> str | None:
        """Publish the next round without ``worker``; the reason to relaunch instead, if any."""
        fault_time = time.time()
        members = list(self.members)
        ready = [w for w in self.spares if self.store.check([membership.ready_key(w)])]
        if ready:
            spare = ready[0]
            self.spares.remove(spare)
            members[members.index(worker)] = spare
            reason = f"{cause}: spare {spare} takes rank {members.index(spare)}"
            self.spares.append(max(self.procs) + 1)  # the pool is topped up: a new spare warms up
            self._start(self.spares[-1])
        else:
            members.remove(worker)
            reason = f"{cause}: continuing at world size {len(members)}"
        if len(members) < self.min_world:
            return f"{cause}: {len(members)} ranks left, fewer than --min-world {self.min_world}"
        self.members, self.round = members, self.round + 1
        self.steps.clear()  # survivors restore an earlier step: progress is judged afresh each round
        membership.publish(self.store, membership.Membership(self.round, tuple(members), tuple(self.spares),
                                                             reason, fault_time))
        log.warning("round %d: %s", self.round, reason)
        return None

    def stop(self) -> None:
        """The job is over or relaunched: release the spares and end what is left."""
        self.store.set(membership.DONE_KEY, "1")
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckpt.inprocess.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True, help="training ranks")
    ap.add_argument("--spares", type=int, default=0, help="warm spare processes started with the job")
    ap.add_argument("--min-world", type=int, default=1, help="relaunch rather than shrink below this")
    ap.add_argument("--hang-s", type=float, default=10.0,
                    help="kill a member whose beat (every 0.2 s) and CPU time stopped this long (a frozen process)")
    ap.add_argument("--progress-s", type=float, default=None,
                    help="evict a member left behind by the others (alive, not stepping) after this long "
                         "(default: the watchdog's policy, 5 x the median step, at least 10 s)")
    ap.add_argument("--relaunches", type=int, default=1, help="whole-job relaunches when in-process fails")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = ap.parse_args(argv)
    if not args.command or args.nproc < 1 or args.spares < 0:
        ap.error("give --nproc >= 1 and a training script")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for attempt in range(args.relaunches + 1):
        job = Job(args, attempt)
        try:
            ok, why = job.watch()
        finally:
            job.stop()
        if ok:
            return 0
        log.error("falling back to a relaunch (attempt %d of %d): %s", attempt + 1, args.relaunches, why)
    return 1


if __name__ == "__main__":
    sys.exit(main())
