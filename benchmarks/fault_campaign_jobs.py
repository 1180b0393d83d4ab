"""The fault campaign's job (benchmarks/fault_campaign.py): tests/inprocess_child.py (the recovery
benchmark's tiny GPT, benchmarks/recovery_model.py; gloo; an overlapped snapshot every step)
under ``python -m ckpt.inprocess.launch``, run to its end or with its launcher SIGKILLed at a
step, and what its events and log say.

Every job of the campaign has the same shape: ``STEPS`` steps at a world of 2 ranks (a warm
spare takes a lost rank's place), the fault at ``FAULT_AT``. The batch of a step depends only
on the step, the rank and the world size, so a job that restores any step and trains on at 2
ranks must end bitwise equal to the uninterrupted 2-rank run: the one reference every row
compares with (``clean``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.procs import stop_process, wait_for

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "inprocess_child.py"
MODEL = ["--model", "gpt", "--overlap"]
STEPS, FAULT_AT = 8, 4
SPARE = ["--nproc", "2", "--spares", "1"]
ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
# what a check that saw silent corruption would log (the sound-state work, issue 49 points 1-4):
# a suspect snapshot, an unhealthy (non-finite) one, replicas that differ, a failed canary
SDC_SEEN = re.compile(r"suspect|unhealthy|non-?finite|not finite|replicas? (?:differ|disagree)"
                      r"|canary (?:failed|mismatch)", re.I)
DAMAGE_SEEN = re.compile(r"is damaged|skipping step")  # a restore that met damaged bytes (ckpt/restore)


@dataclass
class Job:
    """One finished job: every worker's events, the launcher's output (workers' logs in it)."""

    events: list[dict]
    log: str
    returncode: int
    killed_at: int | None = None  # the step worker 0 had reached when the launcher was SIGKILLed
    extra: dict = field(default_factory=dict)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def restarted(self) -> bool:
        """A worker process was started again (a relaunch)."""
        return len(self.of("start")) > len({e["worker"] for e in self.of("start")})

    def digests(self) -> set[str]:
        return {e["digest"] for e in self.of("done")}


def launch(workdir: Path, name: str, launcher: list[str], child: list[str], *, memory_dir: Path,
           kill_at: int | None = None, env: dict | None = None, timeout: float = 600,
           beside: Callable[[Path], None] | None = None) -> Job:
    """Run one job (its disk root ``workdir/name``, memory tier ``memory_dir``); with ``kill_at``
    SIGKILL its launcher once worker 0 has done that many steps (its workers die with it);
    ``beside(events)`` runs on a thread while the job runs (a fault outside it)."""
    events, out = workdir / f"{name}.jsonl", workdir / f"{name}.log"
    memory_dir.mkdir(mode=0o700, exist_ok=True)
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", *launcher, str(CHILD), "--root", str(workdir / name),
           "--events", str(events), "--memory-dir", str(memory_dir), *MODEL, *child]
    with open(out, "ab") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENV, **(env or {})}, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)
    thread = threading.Thread(target=beside, args=(events,), daemon=True) if beside else None
    try:
        if thread:
            thread.start()
        if kill_at is not None:
            if not wait_for(lambda: reached(events, kill_at) or proc.poll() is not None, timeout=timeout,
                            interval=0.02):
                raise SystemExit(f"{name}: worker 0 never reached step {kill_at}")
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=timeout)
        if thread:
            thread.join(timeout=60)
    finally:
        stop_process(proc)
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()] if events.exists() else []
    job = Job(evs, out.read_text(errors="replace"), proc.returncode, kill_at)
    if kill_at is None and proc.returncode != 0:
        raise SystemExit(f"{name}: the launcher failed ({proc.returncode}):\n{job.log[-3000:]}")
    return job


def reached(events: Path, step: int) -> bool:
    """Worker 0 has logged step ``step`` done."""
    if not events.exists():
        return False
    return any(e.get("event") == "step" and e["worker"] == 0 and e["step"] >= step
               for e in (json.loads(line) for line in events.read_text().splitlines() if line.strip()))


def restored_steps(log: str) -> list[int]:
    """Every step rank 0 restored, in order (``rank 0 restored step N``)."""
    return [int(s) for s in re.findall(r"rank 0 restored step (\d+)", log)]


def sdc_lines(log: str) -> list[str]:
    """The lines of a check that saw silent corruption."""
    return [line for line in log.splitlines() if SDC_SEEN.search(line)]


def names_rank(lines: list[str], rank: int) -> bool:
    """A line names rank (or worker or GPU) ``rank``."""
    return any(re.search(rf"\b(?:rank|worker|gpu|ranks?)\s*\[?{rank}\b", line, re.I) for line in lines)


def step_times(job: Job) -> list[float]:
    """Worker 0's step durations (from its step events' wall clocks)."""
    ts = sorted(e["t"] for e in job.of("step") if e["worker"] == 0)
    return [b - a for a, b in zip(ts, ts[1:])]
