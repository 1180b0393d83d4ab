"""The uninterrupted runs that faulted runs must end bitwise equal to, each run once a test session.

Many recovery tests (in-process, peer, hot spare, Slurm) compare a faulted job's final weights
with a clean run of the same command. A clean run depends only on its command, so the session
runs each command once and every test that needs it reads its digests: pytest-xdist's workers
share the results through files in the session's temporary directory, one lock per command, so
a second worker waits for the first instead of running it again.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable


class CleanRuns:
    """Results of clean runs under ``base`` (shared by every worker of one test session)."""

    def __init__(self, base: Path) -> None:
        self.base = base / "clean-runs"
        self.base.mkdir(parents=True, exist_ok=True)

    def digests(self, key: list[str], run: Callable[[Path], list[str]]) -> list[str]:
        """The final-weight digests of the clean run ``key`` names (its whole command), in the
        order ``run`` gave them; ``run`` makes them in a fresh work directory the first time any
        worker asks."""
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        result = self.base / f"{name}.json"
        with open(self.base / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker, running this command now, finishes first
            if not result.exists():
                workdir = self.base / name
                shutil.rmtree(workdir, ignore_errors=True)  # a run that failed before
                workdir.mkdir()
                found = run(workdir)
                assert len(found) >= 1, f"the clean run {key} gave no digest"
                result.write_text(json.dumps({"key": key, "digests": found}))
            return json.loads(result.read_text())["digests"]
