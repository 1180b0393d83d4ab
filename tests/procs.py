"""Stopping the servers tests start: politely first, for certain after a grace period."""
from __future__ import annotations

import subprocess


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
