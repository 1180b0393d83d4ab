"""Hang detection (ckpt/recovery/watchdog.py) with real processes: torchrun (gloo, CPU, 2 ranks)
trains the example GPT; the fault injector SIGSTOPs rank 1 (alive and silent, as a rank
on a dead GPU is); the watchdog names it, kills it, ends the job with EXIT_HUNG,
torchrun restarts, and the final weights are bitwise equal to an uninterrupted run's.
A slow first step never trips it. Timings: benchmarks/recovery_bench.py."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt import CheckpointManager
from ckpt.errors import Preempted
from ckpt.integrations.loop import save_at_boundary
from ckpt.integrations.urgency import SaveRequests
from ckpt.recovery.heartbeat import NodeBeats
from ckpt.recovery.watchdog import EXIT_HUNG, HangDetection, Watchdog
from tests.integration_helpers import REPO, torchrun
from tests.procs import wait_for

STEPS, EVERY = 30, 5
DEADLINE = ["--hang-deadline", "3"]  # raised to 4 s: 4 beats of 1 s tell a frozen rank


def train(base: Path, name: str, memory_dir: str, *extra: str, restarts: int = 0) -> str:
    log = torchrun(REPO / "examples" / "train_torchrun.py", "--root", str(base / name), "--steps", str(STEPS),
                   "--every", str(EVERY), "--memory-dir", memory_dir, "--out", str(base / f"{name}.json"), *extra,
                   restarts=restarts)
    (base / f"{name}.log").write_text(log)
    return log


@pytest.fixture(scope="module")
def slow_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """An uninterrupted run whose rank 1 spends 8 s in its first step (deadline 3 s): its
    directory, its memory dir (kept for the module) and its log."""
    base, memory_dir = tmp_path_factory.mktemp("hang"), tempfile.mkdtemp(prefix="ckpt-test-", dir="/dev/shm")
    try:
        yield base, memory_dir, train(base, "slow", memory_dir, "--slow-first-step", "8", *DEADLINE)
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)


def test_slow_first_step_does_not_trip_the_detector(slow_start: tuple[Path, str, str]) -> None:
    base, _, log = slow_start
    assert "hang detected" not in log, log[-3000:]
    assert json.loads((base / "slow.json").read_text())["incarnation"] == 0


def test_stopped_rank_is_named_killed_and_the_job_resumes_exactly(slow_start: tuple[Path, str, str]) -> None:
    base, memory_dir, _ = slow_start
    log = train(base, "hung", memory_dir, "--faults", "12:stop", *DEADLINE, restarts=1)
    assert "fault injector: SIGSTOP rank 1 at step 12" in log, log[-3000:]
    # the frozen rank is named however long the deadline is: on a loaded machine a peer's save
    # allowance can stretch it to minutes, yet a stopped rank is told from its beats within seconds
    verdict = re.search(r"rank0 hang detected by rank 0: no step boundary for ([\d.]+) s \(deadline [\d.]+ s.*"
                        r"frozen .*rank 1 on node \S+ \(pid \d+\); exiting with code 86", log)
    assert verdict, log[-4000:]
    assert float(verdict.group(1)) < 120, "the stopped rank waited out a deadline instead of being seen frozen"
    # torchrun reports the first worker it saw end: the detector (86), or the hung rank it SIGKILLed (-9)
    assert re.search(rf"exitcode: ({EXIT_HUNG}|-9)\b", log), log[-4000:]
    assert "watchdog: rank 1 (pid" in log and "is stopped (SIGSTOP or a debugger): no stack dump" in log, log[-4000:]
    assert "watchdog: SIGKILLed hung rank 1" in log, log[-4000:]
    timing = json.loads(re.search(r"rank0 restart timing: (\{.*\})", log).group(1))  # ckpt.recovery.restarts
    assert timing["cause"].startswith("hang: frozen") and timing["total_s"] > 0, timing
    assert re.search(r"rank0 incarnation 1: first step 10\b", log), log[-3000:]
    assert json.loads((base / "hung.json").read_text())["digest"] == \
        json.loads((base / "slow.json").read_text())["digest"], "the resumed run diverged from the uninterrupted one"


def test_deadline_follows_the_measured_steps() -> None:
    opts = HangDetection()  # the defaults: floor 10 s, 5x the median, 600 s for the first 3 steps
    assert opts.deadline([]) == opts.deadline([20.0, 20.0]) == 600.0  # warming up: compile, data loading
    assert opts.deadline([1.0, 1.0, 1.0]) == 10.0  # the floor
    assert opts.deadline([10.0, 12.0, 500.0]) == 60.0  # 5x the median: one slow step moves it little
    assert HangDetection(deadline_s=4.0).deadline([1.0] * 5) == 4.0
    assert HangDetection(deadline_s=1.0, interval_s=1.0).deadline([1.0] * 5) == 4.0  # 4 beats tell a frozen rank
    with pytest.raises(ValueError, match="deadline_s"):
        HangDetection(deadline_s=0)


def watchdogs(tmp_path: Path, opts: HangDetection, exits: list[int], world: int = 2) -> list[Watchdog]:
    """``world`` watchdogs of one node on a real TCPStore, one connection per thread (as
    distributed.store_connector gives); each exit is appended to ``exits`` (a stub)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    local = threading.local()

    def client() -> dist.Store:
        if not hasattr(local, "store"):
            local.store = dist.PrefixStore("t", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                              timeout=timedelta(seconds=10)))
        return local.store

    client.server = server  # lives as long as the watchdogs
    return [Watchdog(client, NodeBeats(client, tmp_path, rank, "n", ["n"], opts.interval_s), rank, world, opts,
                     exit=exits.append) for rank in range(world)]


def test_rank_behind_is_named_through_a_real_store(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Two watchdogs on one TCPStore, both alive; rank 1 stopped two boundaries earlier:
    rank 0 names it as behind and exits with EXIT_HUNG (exit is a stub here)."""
    exits: list[int] = []
    opts = HangDetection(deadline_s=2.0, warmup_steps=0, interval_s=0.5, poll_s=0.1)
    dogs = watchdogs(tmp_path, opts, exits)
    dogs[1]._exit = lambda code: None  # rank 1 is the culprit; only rank 0's verdict is checked
    for dog in dogs:
        dog.start()
    try:
        for _ in range(3):
            dogs[0].boundary()
        dogs[1].boundary()
        with caplog.at_level("WARNING", logger="ckpt.recovery.watchdog"):
            assert wait_for(lambda: exits, timeout=60), "rank 0 never declared the hang"
        assert exits == [EXIT_HUNG]
        assert any("rank 0: no step boundary for" in r.message for r in caplog.records), "a silent wait"
        assert any("behind (at boundary 1, others further): rank 1 on node" in r.message for r in caplog.records)
    finally:
        for dog in dogs:
            dog.close()


def test_steps_slowing_past_the_floor_are_reported_as_that(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Both ranks alive and in step, each step slower than the last until one passes the
    10 s-style floor (2 s here): the verdict says the steps slowed, not "a hang inside a
    collective"."""
    exits: list[int] = []
    opts = HangDetection(floor_s=2.0, factor=2.0, warmup_steps=3, interval_s=0.1, poll_s=0.05)
    dogs = watchdogs(tmp_path, opts, exits)
    for dog in dogs:
        dog.start()
    try:
        with caplog.at_level("WARNING", logger="ckpt.recovery.watchdog"):
            for gap in (0.0, 0.1, 0.1, 0.1, 0.3, 0.6, 1.2):
                time.sleep(gap)
                for dog in dogs:
                    dog.boundary()
            assert wait_for(lambda: exits, timeout=20), "the slow step was never declared"
        verdicts = [r.message for r in caplog.records if "hang detected" in r.message]
        assert verdicts and all("slowing down" in v and "the last three took" in v for v in verdicts), verdicts
        assert not any("inside a collective" in v for v in verdicts)
    finally:
        for dog in dogs:
            dog.close()


FAST = HangDetection(deadline_s=0.5, warmup_steps=0, interval_s=0.1, poll_s=0.05)  # 4 beats: 0.4 s


def test_a_save_longer_than_the_deadline_is_not_a_hang(tmp_path: Path, shm_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's blocking save (the copy into shared memory) outlasts the deadline several
    times, and rank 1, whose own save was quick, waits for it in its next collective:
    neither is a hang (both were declared before saves reported themselves in the beat)."""
    exits: list[int] = []
    dogs = watchdogs(tmp_path / "beats", FAST, exits)
    for dog in dogs:
        dog.start()
    try:
        with CheckpointManager(tmp_path / "root", memory_dir=shm_dir) as mgr:
            real_save = mgr.save
            monkeypatch.setattr(mgr, "save", lambda *a, **k: (time.sleep(2.0), real_save(*a, **k))[1])
            for _ in range(3):
                for dog in dogs:
                    dog.boundary()
            with dogs[1].saving():  # rank 1's own save, quick; it then waits for rank 0's
                pass
            assert save_at_boundary(mgr, SaveRequests(), 5, lambda: {"w": torch.zeros(4)}, every=5, watchdog=dogs[0])
            for dog in dogs:
                dog.boundary()
        assert exits == [], "a long save was declared a hang"
        with dogs[1].saving():  # rank 1's saves took ~0 s: a save that never returns is a hang
            assert wait_for(lambda: exits, timeout=60), "a hang inside a save was never declared"
    finally:
        for dog in dogs:
            dog.close()


def test_a_frozen_peer_is_declared_before_the_deadline_and_a_slow_live_one_is_not(tmp_path: Path) -> None:
    """Deadline 60 s. Rank 1 alive but slow for longer than the frozen watch: nothing
    declared. Rank 1's watchdog thread stops (its process no longer runs): rank 0 names
    it frozen within a few beats."""
    exits: list[int] = []
    opts = HangDetection(deadline_s=60.0, warmup_steps=1, interval_s=0.1, poll_s=0.05)
    dogs = watchdogs(tmp_path, opts, exits)
    dogs[1]._exit = lambda code: None
    for dog in dogs:
        dog.start()
    try:
        for _ in range(3):
            for dog in dogs:
                dog.boundary()
        time.sleep(1.5)  # a slow step, both alive: 15 beats, well past the frozen watch (0.1 s)
        assert exits == [], "a slow step of live ranks was declared a hang"
        dogs[1]._stop.set()  # rank 1's thread stops beating, as a stopped process's does
        dogs[1]._thread.join()
        assert wait_for(lambda: exits, timeout=45), "a frozen rank was not declared before the deadline"
        assert exits == [EXIT_HUNG] and dogs[0]._frozen() == [1]
    finally:
        for dog in dogs:
            dog.close()


def test_a_rank_frozen_before_its_first_beat_is_declared_frozen(tmp_path: Path) -> None:
    """Rank 1's process stops before its watchdog thread ever ran (fast first steps; seen
    in CI): it reported at start, so rank 0 names it frozen, not "never reported" at the
    deadline (60 s here)."""
    exits: list[int] = []
    opts = HangDetection(deadline_s=60.0, warmup_steps=1, interval_s=0.5, poll_s=0.5)
    dogs = watchdogs(tmp_path, opts, exits)
    dogs[1]._exit = lambda code: None
    dogs[1].start()
    dogs[1]._stop.set()  # its thread never takes a turn, as in a process stopped at once
    dogs[1]._thread.join()
    dogs[0].start()
    try:
        for _ in range(3):
            dogs[0].boundary()
        assert wait_for(lambda: exits, timeout=45), "a rank stopped before its first beat waited for the deadline"
        assert exits == [EXIT_HUNG] and dogs[0]._frozen() == [1]
    finally:
        for dog in dogs:
            dog.close()


def test_rank_asleep_in_a_call_dumps_its_stacks(slow_start: tuple[Path, str, str]) -> None:
    """Rank 1 alive but stuck (as in a kernel): it is named as behind (or, had its peer
    not got further, nobody is), and it dumps its own stacks, which show where it sleeps."""
    base, memory_dir, _ = slow_start
    log = train(base, "asleep", memory_dir, "--faults", "12:hang", *DEADLINE, restarts=1)
    assert re.search(r"rank1 hang detected by rank 1: .*(behind .*: rank 1 on node|every rank is alive)", log), \
        log[-4000:]
    assert "rank1 rank 1: this rank's Python stacks follow" in log, log[-4000:]
    assert re.search(r'File ".*train_torchrun\.py", line \d+ in main', log), "no stack dump"
    assert f"exitcode: {EXIT_HUNG}" in log and re.search(r"rank0 incarnation 1: first step 10\b", log), log[-4000:]


def test_a_preempted_rank_saving_longer_than_the_deadline_is_not_hung(tmp_path: Path, shm_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM: the rank saves, waits until durable and flushes, however long that takes;
    its watchdog must not call that a hang (it did: the flush outlived the deadline, exit 86)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("p", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                timeout=timedelta(seconds=10)))
    exits: list[int] = []
    opts = HangDetection(deadline_s=0.4, warmup_steps=0, interval_s=0.1, poll_s=0.05)
    dog = Watchdog(lambda: store, NodeBeats(lambda: store, tmp_path / "beats", 0, "n", ["n"], opts.interval_s), 0,
                   2, opts, exit=exits.append).start()
    state = {"w": torch.zeros(4)}
    with CheckpointManager(tmp_path / "root", memory_dir=shm_dir) as mgr:
        real_flush = mgr.flush
        monkeypatch.setattr(mgr, "flush", lambda: (time.sleep(1.5), real_flush()))  # a slow upload
        requests = SaveRequests()
        requests.on_sigterm(15, None)  # what SIGTERM does
        dog.boundary()
        with pytest.raises(Preempted):
            save_at_boundary(mgr, requests, 1, lambda: state, every=None, watchdog=dog)
    dog.close()
    assert exits == [], "a preempted rank's durable save was declared a hang"
