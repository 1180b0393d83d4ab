"""In-process recovery (ckpt.inprocess) with real processes: ``python -m ckpt.inprocess.launch``
starts gloo ranks on loopback (tests/inprocess_child.py); a rank SIGKILLs itself mid-training.
The survivors must keep their processes and finish bitwise equal to the run they stand for:
with a warm spare, an uninterrupted run; shrinking, a relaunch from the same step at the new size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ckpt_helpers import REPO

CHILD = REPO / "tests" / "inprocess_child.py"
STEPS, KILL_AT = 10, 4
ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def launch(root: Path, events: Path, *launcher: str, child: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", *launcher, str(CHILD), "--root", str(root),
           "--events", str(events), *child]
    proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def finals(evs: list[dict]) -> dict[int, dict]:
    return {e["worker"]: e for e in evs if e["event"] == "done"}


def check_survivors_kept(evs: list[dict], dead: int) -> list[dict]:
    """Every worker that finished is the process that started (pid unchanged); the recoveries seen."""
    started = {e["worker"]: e["pid"] for e in evs if e["event"] == "start"}
    done = finals(evs)
    assert dead not in done and done, done
    assert all(e["pid"] == started[w] for w, e in done.items()), (started, done)
    recs = [e for e in evs if e["event"] == "recovery"]
    assert {r["worker"] for r in recs} == set(done), recs
    return recs


@pytest.mark.timeout(600)
def test_killed_rank_spare_takes_its_place(tmp_path):
    """2 ranks + 1 warm spare: rank 1 dies at step 4; the spare takes rank 1 and the job ends
    bitwise equal to an uninterrupted 2-rank run, at most the step in flight lost."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2", "--spares", "1",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "spare 2 takes rank 1" in log, log[-3000:]
    assert all(r["world_size"] == 2 for r in recs), recs
    assert all(r["failed_at_step"] - r["restored_step"] <= 1 for r in recs if r["worker"] == 0), recs
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 2: STEPS}
    launch(tmp_path / "clean", tmp_path / "clean.jsonl", "--nproc", "2", child=("--steps", str(STEPS)))
    clean = {e["digest"] for e in finals(events(tmp_path / "clean.jsonl")).values()}
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean


@pytest.mark.timeout(600)
def test_killed_rank_without_spare_shrinks(tmp_path):
    """3 ranks, no spare: rank 1 dies at step 4; ranks 0 and 2 go on at world size 2 and end
    bitwise equal to a relaunch at 2 ranks from the step they restored (itself taken from a
    clean 3-rank run)."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "3",
                 child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    evs = events(tmp_path / "a.jsonl")
    recs = check_survivors_kept(evs, dead=1)
    assert "attempt 1" not in log and "continuing at world size 2" in log, log[-3000:]
    restored = {r["restored_step"] for r in recs}
    assert {r["failed_at_step"] for r in recs} == {KILL_AT}, recs
    assert len(restored) == 1 and KILL_AT - 1 <= min(restored) <= KILL_AT, recs
    assert all(e["world"] == 2 for e in finals(evs).values())
    ref = tmp_path / "ref"
    launch(ref, tmp_path / "ref3.jsonl", "--nproc", "3", child=("--steps", str(min(restored))))
    launch(ref, tmp_path / "ref2.jsonl", "--nproc", "2",
           child=("--steps", str(STEPS), "--resume-step", str(min(restored))))
    expected = {e["digest"] for e in finals(events(tmp_path / "ref2.jsonl")).values()}
    assert len(expected) == 1 and {e["digest"] for e in finals(evs).values()} == expected
