"""The check every benchmark that runs checkpoint jobs ends with: it left no shared memory.

A job that ended frees its slots (issue 54), so a checkpoint namespace still in one of the
benchmark's memory dirs at the end of a normal run, or one in /dev/shm that this process made,
is a leak the run measured around: the run fails, naming it. Call ``leaves_no_shm`` where the
run ends normally, before the dirs are removed (a failed run just removes them).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def leaves_no_shm(*dirs: str | Path, under: Path | None = None) -> None:
    """Exit 1 naming every checkpoint namespace left under ``dirs``, made in /dev/shm by this process,
    or (``under``: the root of jobs this run started with the default memory dir) owned by a root below it."""
    from ckpt.tiers.memory.owners import left_behind  # the engine's own rule; torch-free, imported when used

    left = sorted({p for d in dirs for p in Path(d).rglob("ckpt-guard-*") if p.is_dir()}
                  | left_behind("/dev/shm", pid=os.getpid())
                  | (left_behind("/dev/shm", under=under) if under is not None else set()))
    if left:
        raise SystemExit(f"{Path(sys.argv[0]).name}: the run left {len(left)} checkpoint namespace(s) in shared "
                         f"memory (a job that ended must free its slots): {', '.join(map(str, left))}")
