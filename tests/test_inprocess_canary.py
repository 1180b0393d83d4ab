"""Going back in process from unsound state (issue 49, docs/sound-state.md) under
``python -m ckpt.inprocess.launch`` with real gloo ranks (tests/inprocess_child.py): a canary
that fails after a restore makes every rank go back, in its process, to the previous verified
step; a second failure stops the job with the reason (no loop, no relaunch); and a launch that
keeps finding unsound snapshots goes back in process at most ``MAX_REWINDS`` times, then is
relaunched."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.inprocess.launch import MAX_REWINDS
from ckpt.tiers.memory import memory_namespace
from tests.ckpt_helpers import REPO
from tests.session_cache import built_once
from tests.test_inprocess import CHILD, ENV, STEPS, clean_digests, events, finals, launch

RESUME = 3  # the step the second launch restores by name: the save of step 4 holds its canary reference


@pytest.fixture
def trained(tmp_path_factory, tmp_path) -> Path:
    """A root holding steps 1..6 of a clean 2-rank run that recorded its losses (the canary's
    references), built once a session; each test gets its own copy (its canary record)."""
    built = built_once(tmp_path_factory, "inprocess-canary-6", lambda d: launch(
        d / "root", d / "events.jsonl", "--nproc", "2", child=("--steps", "6", "--canary")))
    shutil.copytree(built / "root", tmp_path / "root")
    return tmp_path / "root"


def resume_with(root: Path, events_path: Path, fault: str) -> subprocess.CompletedProcess:
    """A second launch on ``root`` that restores step ``RESUME`` by name and perturbs every rank's
    parameters in the first step after a restore (``fault``: once, or after every restore)."""
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", "--nproc", "2", str(CHILD), "--root", str(root),
           "--events", str(events_path), "--steps", str(STEPS), "--resume-step", str(RESUME),
           "--canary-fault", fault, "--log-info"]
    return subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=400, cwd=REPO)


@pytest.mark.timeout(600)
def test_a_failed_canary_goes_back_in_process_to_the_previous_verified_step(trained, tmp_path, clean_runs):
    """The canary after restoring step 3 fails on every rank (their parameters are not what was
    saved): the launcher starts a round with the same members, both ranks restore step 2 (the
    newest verified step before the failed one) in their processes, its canary passes, and the
    job ends bitwise equal to an uninterrupted run."""
    proc = resume_with(trained, tmp_path / "b.jsonl", "once")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"round 1: CANARY FAILED after restoring step {RESUME} (generation 0)" in log, log[-4000:]
    assert "every rank goes back to the newest sound step" in log and "attempt 1" not in log, log[-4000:]
    assert log.count("canary after restoring step 2: passed") == 2, log[-4000:]
    evs = events(tmp_path / "b.jsonl")
    started = {e["worker"]: e["pid"] for e in evs if e["event"] == "start"}
    done = finals(evs)
    assert {w: (e["pid"], e["steps"]) for w, e in done.items()} == {w: (p, STEPS) for w, p in started.items()}
    recs = [e for e in evs if e["event"] == "recovery"]
    assert sorted((r["worker"], r["failed_at_step"], r["restored_step"]) for r in recs) == \
        [(0, RESUME, 2), (1, RESUME, 2)], recs
    assert all("CANARY FAILED" in r["reason"] for r in recs), recs
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in done.values()} == clean


@pytest.mark.timeout(600)
def test_a_second_canary_failure_stops_the_job_with_the_reason(trained, tmp_path):
    """The canary fails after every restore: the first failure goes back in process to step 2,
    the second (from step 2) stops the job at once with the reason: no third restore, no
    relaunch, no wait for a round that never comes."""
    proc = resume_with(trained, tmp_path / "b.jsonl", "always")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-4000:]
    assert f"round 1: CANARY FAILED after restoring step {RESUME}" in log, log[-4000:]
    assert "the job failed: worker" in log and "stopped the job: CANARY FAILED after restoring step 2" in log
    assert "stopping the job rather than going back again" in log, log[-4000:]
    assert "falling back to a relaunch" not in log and "attempt 1" not in log, log[-4000:]
    evs = events(tmp_path / "b.jsonl")
    assert sorted(e["worker"] for e in evs if e["event"] == "start") == [0, 1]  # one process each, never again
    assert not finals(evs)
    assert log.count("restored step") == 4, log[-4000:]  # steps 3 then 2, on each rank: nothing more
    # a stopped job keeps its memory slots, as a failed one does (a relaunch after the fix restores from them)
    shutil.rmtree(memory_namespace(trained, None))


@pytest.mark.timeout(900)
def test_a_launch_goes_back_in_process_at_most_max_rewinds_times(tmp_path, clean_runs):
    """A rank whose forward gives NaN at step 4 in every round (a device that keeps going wrong):
    the non-finite snapshot is gone back from in process ``MAX_REWINDS`` times; the next one
    ends the launch in a relaunch (new processes), which trains clean to the end, bitwise equal
    to an uninterrupted run."""
    log = launch(tmp_path / "a", tmp_path / "a.jsonl", "--nproc", "2",
                 child=("--steps", str(STEPS), "--sdc", "nan_forward", "--kill-at", "4",
                        "--sdc-rounds", str(MAX_REWINDS + 1)))
    for r in range(1, MAX_REWINDS + 1):
        assert re.search(rf"round {r}: step \d+ \(generation \d+\) is unhealthy", log), log[-4000:]
    assert f"round {MAX_REWINDS + 1}:" not in log, log[-4000:]
    assert f"(unsound {MAX_REWINDS + 1} times in this launch)" in log, log[-4000:]
    assert "falling back to a relaunch (attempt 1 of 1)" in log, log[-4000:]
    evs = events(tmp_path / "a.jsonl")
    faults = [e for e in evs if e["event"] == "fault"]
    assert len(faults) == MAX_REWINDS + 1, faults
    starts = sorted(e["worker"] for e in evs if e["event"] == "start")
    assert starts == [0, 0, 1, 1], starts  # the relaunch, once
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert len(clean) == 1 and {e["digest"] for e in finals(evs).values()} == clean
