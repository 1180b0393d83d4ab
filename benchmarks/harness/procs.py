"""The worker processes a benchmark driver starts. Each runs in a session of its own (a hung
job is killed by group), which a signal to the driver's group never reaches: every worker
started here is killed when the driver exits, also on SIGTERM (``timeout``) once
``exit_on_sigterm`` is called. Servers and ports: tests/procs.py."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.meta import REPO

_SPAWNED: list[subprocess.Popen] = []


def spawn(python: str, script: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``python script args`` in the repository, its output to ``log``, killed at exit."""
    proc = subprocess.Popen([python, script, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo",
                                 "PYTHONUNBUFFERED": "1", **env}, start_new_session=True)
    _SPAWNED.append(proc)
    return proc


@atexit.register
def _kill_spawned() -> None:
    for proc in _SPAWNED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def exit_on_sigterm() -> None:
    """In a driver: SIGTERM exits through ``atexit`` (which kills the workers) instead of at once."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def finish(procs: list[subprocess.Popen], timeout: float, logs: list[Path]) -> None:
    """Wait for the job; on a hang, kill it (by group) and say so with the logs' tails."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
                    q.wait()
            tails = "\n".join(f"--- {lg.name}\n{lg.read_text()[-2000:]}" for lg in logs)
            raise SystemExit(f"job did not finish in {timeout:.0f} s:\n{tails}") from None
