"""Shared memory that outlives the job (issue 54): a job that ended frees its slots; a dead
job's slots go once their newest step is durable, whoever comes next; the rest is kept for
the grace time, then reported; every namespace is visible (``ckpt ls --memory``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager, Preempted, SaveRequests
from ckpt.integrations.loop import save_at_boundary
from ckpt.recovery.restarts import EVENTS_FILE
from ckpt.tiers.memory import memory_namespace
from ckpt.tiers.memory.namespace import owner_gone
from ckpt.tiers.memory.owners import reclaim, survey
from tests.ckpt_helpers import PYTHON, REPO, assert_same, ckpt_dir, restored, step_state
from tests.test_ckpt_planted import plant_namespace


def namespaces(shm_dir: str) -> list[Path]:
    return sorted(Path(shm_dir).glob("ckpt-guard-*"))


def ckpt(*args: str | Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([PYTHON, "-m", "ckpt.cli", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def dead_job(root: Path, shm_dir: str, steps: int = 2) -> Path:
    """A job that saved ``steps`` steps (durable on disk) and is gone, its slots left behind
    (its own start sweeps nothing: the other dead jobs stay for the test)."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_memory=True, sweep=False) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, step_state(step))
        mgr.wait()
    return memory_namespace(root, None, shm_dir)


@pytest.mark.parametrize("kw", [{}, {"overlap": True}, {"overlap": True, "drain_interval_s": 0.2}],
                         ids=["default", "overlap", "drain_interval"])
def test_a_plain_loop_that_ends_normally_leaves_nothing(tmp_path: Path, shm_dir: str, kw: dict) -> None:
    """The README's loop: save every step, wait, close. Nothing stays in shared memory."""
    mgr = CheckpointManager(tmp_path / "ckpt", memory_dir=shm_dir, **kw)
    for step in range(1, 6):
        mgr.save(step, {"w": torch.full((1000,), float(step))})
    mgr.wait()
    mgr.close()
    assert namespaces(shm_dir) == []


def hang_detector_files(ns: Path) -> None:
    """What ``ckpt.resumable``'s hang detector leaves in a job's namespace under torchrun: its
    beats dir and the node's restart records (kept across incarnations)."""
    (ns / "beats-0123abcd" / "node0").mkdir(parents=True)
    (ns / "beats-0123abcd" / "node0" / "rank-0").write_text("7")
    (ns / EVENTS_FILE).write_text('{"ev": "exit"}\n')


def test_a_finished_job_leaves_no_namespace_for_its_hang_detectors_files(tmp_path: Path, shm_dir: str) -> None:
    """The relaunch benchmark's job (torchrun, a rank killed once, then a normal end) left its
    namespace with only the detector's files in it: the last rank's close removes them too, and
    a dead job's are reclaimed with its slots."""
    with CheckpointManager(tmp_path / "ended", memory_dir=shm_dir) as mgr:
        mgr.save(1, step_state(1))
        hang_detector_files(Path(mgr._ns))
    assert namespaces(shm_dir) == []
    dead = dead_job(tmp_path / "dead", shm_dir)
    hang_detector_files(dead)
    removed, _ = reclaim(shm_dir)
    assert [h.path for h in removed] == [dead] and namespaces(shm_dir) == []


def test_slots_stay_when_a_restart_is_expected_or_asked_for(tmp_path: Path, shm_dir: str) -> None:
    """keep_memory, an exception (inside ``with``, or a close() while one is raised) and a
    preemption keep the slots, and the restart restores from memory."""
    def run(name: str, how: str) -> Path:
        root = tmp_path / name
        mgr = CheckpointManager(root, memory_dir=shm_dir, keep_memory=how == "keep")
        mgr.save(1, step_state(1)).wait()
        if how == "with":
            with pytest.raises(ValueError), mgr:
                raise ValueError("the training step failed")
        elif how == "finally":
            with pytest.raises(ValueError):
                try:
                    raise ValueError("the training step failed")
                finally:
                    mgr.close()
        elif how == "preempted":
            requests = SaveRequests()
            requests.on_sigterm(15, None)
            with pytest.raises(Preempted):
                save_at_boundary(mgr, requests, 2, lambda: step_state(2), every=None)
            mgr.close()
        else:
            mgr.close()
        return root

    for how in ("keep", "with", "finally", "preempted"):
        root = run(how, how)
        assert memory_namespace(root, None, shm_dir).is_dir(), how
        with CheckpointManager(root, memory_dir=shm_dir) as mgr:
            assert mgr.tiers[0].list(), how  # the slots are there to restore from
        assert not memory_namespace(root, None, shm_dir).exists(), how  # that restart ended normally


def test_a_step_restored_from_memory_and_never_saved_again_is_kept(tmp_path: Path, shm_dir: str) -> None:
    """close() frees only slots whose steps are durable: one restored from memory whose disk
    copy is gone may be the only copy."""
    root = tmp_path / "ckpt"
    dead_job(root, shm_dir, steps=2)
    shutil.rmtree(ckpt_dir(root, 2))
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        step, state = restored(mgr)
    assert step == 2 and memory_namespace(root, None, shm_dir).is_dir()
    assert_same(state, step_state(2))
    shutil.rmtree(memory_namespace(root, None, shm_dir))


def test_the_owner_record_says_what_is_durable(tmp_path: Path, shm_dir: str) -> None:
    with CheckpointManager(tmp_path / "ckpt", memory_dir=shm_dir) as mgr:
        mgr.save(3, step_state(3)).wait()
        owner = json.loads((memory_namespace(tmp_path / "ckpt", None, shm_dir) / "rank-00000" / "owner.json")
                           .read_text())
        assert owner["durable"] == {"disk": [0, 3]} and owner["pid"] == os.getpid()


def test_any_job_start_reclaims_dead_jobs_whose_steps_are_durable(tmp_path: Path, shm_dir: str) -> None:
    """Another root's start removes a dead job's durable slots; it keeps a dead job's slots
    holding a step durable nowhere else, and never touches a live job's."""
    durable = dead_job(tmp_path / "durable", shm_dir)
    only_copy = dead_job(tmp_path / "only-copy", shm_dir)
    shutil.rmtree(ckpt_dir(tmp_path / "only-copy", 2))  # its newest step's disk copy is lost
    with CheckpointManager(tmp_path / "live", memory_dir=shm_dir, keep_memory=True) as live:
        live.save(1, step_state(1)).wait()
        with CheckpointManager(tmp_path / "next", memory_dir=shm_dir):
            assert not durable.exists()
            assert only_copy.is_dir() and memory_namespace(tmp_path / "live", None, shm_dir).is_dir()
        states = {Path(h.owner()["root"]).name: h.state(3600) for h in survey(shm_dir)}
        assert states == {"only-copy": "grace", "live": "live"}
        assert {Path(h.owner()["root"]).name: h.state(0) for h in survey(shm_dir)}["only-copy"] == "stale"
        removed, stale = reclaim(shm_dir, grace=0)
        assert removed == [] and [h.path for h in stale] == [only_copy]  # reported, not deleted
    shutil.rmtree(only_copy)
    shutil.rmtree(memory_namespace(tmp_path / "live", None, shm_dir))


def test_ls_memory_shows_each_namespace(tmp_path: Path, shm_dir: str) -> None:
    with CheckpointManager(tmp_path / "live", memory_dir=shm_dir, run="r7") as mgr:
        dead = dead_job(tmp_path / "gone", shm_dir)
        mgr.save(1, step_state(1)).wait()
        out = ckpt("ls", "--memory", "--memory-dir", shm_dir, "--json")
        assert out.returncode == 0, out.stderr
        rows = {Path(r["root"]).name: r for r in json.loads(out.stdout)}
        text = ckpt("ls", "--memory", "--memory-dir", shm_dir).stdout
    assert rows["live"]["owner_alive"] and rows["live"]["run"] == "r7" and rows["live"]["pid"] == os.getpid()
    assert rows["live"]["state"] == "live" and rows["live"]["newest_step"] == 1 and rows["live"]["bytes"] > 0
    assert not rows["gone"]["owner_alive"] and rows["gone"]["durable_elsewhere"]
    assert rows["gone"]["state"] == "reclaimable" and rows["gone"]["namespace"] == str(dead)
    assert rows["gone"]["user"] and rows["gone"]["uid"] == os.getuid()
    assert "reclaimable" in text and "held by jobs that are gone" in text
    assert ckpt("ls", "--memory-dir", shm_dir).returncode == 2  # neither ROOT nor --memory
    shutil.rmtree(dead)


def test_a_job_starting_while_a_sweeper_removes_its_predecessor_waits_and_starts_afresh(tmp_path: Path,
                                                                                        shm_dir: str) -> None:
    """A sweeper holds a dead rank's lock while it removes the directory: a job taking that
    rank at that moment waits for it, then makes the directory again (never a refusal, never
    a lock on a removed file)."""
    root = tmp_path / "ckpt"
    rdir = dead_job(root, shm_dir) / "rank-00000"
    taken, done = threading.Event(), threading.Event()

    def sweeper() -> None:
        with owner_gone(rdir) as gone:
            assert gone
            taken.set()
            time.sleep(0.5)
            shutil.rmtree(rdir)
        done.set()

    thread = threading.Thread(target=sweeper)
    thread.start()
    taken.wait(10)
    with CheckpointManager(root, memory_dir=shm_dir, sweep=False) as mgr:
        assert done.is_set() and (rdir / "lock").exists()
        mgr.save(3, step_state(3)).wait()
        assert [i.id.step for i in mgr.tiers[0].list()] == [3]
    thread.join()


def test_a_namespace_planted_by_another_user_is_neither_listed_nor_removed(root: Path, shm_dir: str,
                                                                          tmp_path: Path) -> None:
    planted = plant_namespace(root, shm_dir, tmp_path, step=99)
    assert planted not in [h.path for h in survey(shm_dir)]
    reclaim(shm_dir, grace=0)
    assert planted.is_dir()
    assert str(planted) not in ckpt("ls", "--memory", "--memory-dir", shm_dir).stdout


def test_a_damaged_owner_record_is_a_namespace_of_nobody_known(tmp_path: Path, shm_dir: str) -> None:
    """Owner records are written by their user: values of the wrong type are shown as unknown,
    a durable record that does not parse vouches for nothing, and nothing breaks."""
    ns = dead_job(tmp_path / "ckpt", shm_dir)
    (ns / "rank-00000" / "owner.json").write_text(json.dumps({"root": {"a": 1}, "run": ["x"], "pid": "1", "host": 7,
                                                              "replica_of": 0, "durable": {"object": "x"}}))
    out = ckpt("ls", "--memory", "--memory-dir", shm_dir, "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    assert (row["root"], row["run"], row["pid"], row["host"]) == (None, None, None, None)
    assert row["state"] == "grace" and not row["durable_elsewhere"]
    assert ckpt("ls", "--memory", "--memory-dir", shm_dir).returncode == 0
    shutil.rmtree(ns)
