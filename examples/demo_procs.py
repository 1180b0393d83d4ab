"""The demo's processes, files and clock (``examples/demo.py``): one ``Run`` per story, its
processes started in sessions of their own and stopped at its end, its logs read back."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One story's processes, files and timeline (``events``: wall-clock times and figures)."""

    name: str
    dir: Path
    events: dict[str, float] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, what: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.dir / f"{what}.log", "ab") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 env={**os.environ, **ENV, **(env or {})}, start_new_session=True)
        self.procs.append(p)
        return p

    def log(self, what: str) -> str:
        path = self.dir / f"{what}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Every log of the run (each process's lines in order; across files, by their stamps)."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("*.log")))

    def timeline(self) -> list[dict]:
        """Rank 0's steps, one JSON line each (``examples/demo_train.py --timeline``)."""
        return steps_done(self.dir / "timeline.jsonl")

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: a lost node (torchrun starts each worker
    in a session of its own, so killing torchrun's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def lose_node(run: Run, proc: subprocess.Popen, memory: Path, root: Path) -> list[dict]:
    """The GPU fails: the node's processes (``proc`` and all below it) die with it, then its
    memory and local disk are gone. Records the failure's time and rank 0's last step; returns
    rank 0's steps until then."""
    run.events["failure"] = time.time()  # the SIGKILL: what the figures count from
    kill_tree(proc.pid)
    proc.wait()
    done = run.timeline()
    run.events["last_step"] = done[-1]["step"] if done else 0
    shutil.rmtree(memory, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return done


def steps_done(timeline: Path) -> list[dict]:
    if not timeline.exists():
        return []
    return [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]


# the stamp of a line of the training job's log: "2026-11-23 10:01:10,700 node1 w1 message"
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \S+ w\d+ "


def log_time(stamp: str) -> float:
    """A log line's stamp (local time, ms) as a wall-clock time."""
    return time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp.split(",")[1]) / 1000


def leaves_no_shm(args) -> None:
    """Exit 1 naming what the demo left in /dev/shm: a node's memory dir, or a checkpoint namespace
    of one of its roots (``ckpt restore`` and the resumed jobs use the default memory dir's rules)."""
    from ckpt.tiers.memory.owners import left_behind  # torch-free: the engine's own rule

    left = sorted({str(d) for d in args.memory_dirs if d.exists()}
                  | {str(p) for p in left_behind("/dev/shm", under=Path(args.workdir))})
    if left:
        raise SystemExit(f"the demo left {len(left)} shared-memory dir(s) in /dev/shm: {', '.join(left)}")
    say("shared memory: nothing of the demo's left in /dev/shm")
