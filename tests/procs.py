"""The servers tests and benchmarks start: a free loopback port for one, its CPU time,
and stopping it, politely first, for certain after a grace period."""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A loopback port free right now (servers bind 127.0.0.1 only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, wait ``grace_s``, then SIGKILL; always reaps the process."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
