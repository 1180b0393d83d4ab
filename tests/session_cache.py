"""What a test session builds once and every test reads: a trained model, a trace, and the
clean runs that faulted runs must end bitwise equal to.

pytest-xdist's workers share these through the session's base directory (one lock per
thing built, so a second worker waits for the first instead of building it again): on a
2-core machine, each worker building its own copy doubled minutes of CPU.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(dir)`` once per test session, shared by the xdist workers (a lock beside it
    in the session's base directory; alone, in this process's own)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / f"once-{name}"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)  # a build that failed before
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


class CleanRuns:
    """Uninterrupted runs, each command run once a session. Many recovery tests (in-process,
    peer, hot spare, Slurm) compare a faulted job's final weights with a clean run of the same
    command, which depends only on the command."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.factory = tmp_path_factory

    def digests(self, key: list[str], run: Callable[[Path], list[str]]) -> list[str]:
        """The final-weight digests of the clean run ``key`` names (its whole command), in the
        order ``run`` gave them; ``run`` makes them in a fresh work directory the first time any
        worker asks."""
        def build(workdir: Path) -> None:
            found = run(workdir)
            assert found, f"the clean run {key} gave no digest"
            (workdir / "digests.json").write_text(json.dumps({"key": key, "digests": found}))

        name = "clean-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        return json.loads((built_once(self.factory, name, build) / "digests.json").read_text())["digests"]
