"""The ``ckpt`` command line, run as a real subprocess (``python -m ckpt.cli``).

Exit codes: 0 ok, 1 failure (damage found, nothing to restore), 2 usage.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ckpt import CheckpointManager
from tests.ckpt_helpers import (
    PYTHON,
    REPO,
    assert_same,
    ckpt_dir,
    disk_steps,
    flip_byte,
    restored,
    step_state,
    truncate,
)


def ckpt(*args: str | Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([PYTHON, "-m", "ckpt.cli", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def saved(root: Path, shm_dir: str) -> Path:
    """Steps 1..3 on disk; 2 and 3 also in the memory slots (kept as after a crash)."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5, keep_memory=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, step_state(step))
        mgr.wait()
    return root


@pytest.fixture
def no_slots(tmp_path: Path) -> Path:
    """A --memory-dir without slots: the CLI sees the disk tier only."""
    path = tmp_path / "no-slots"
    path.mkdir()
    return path


def test_ls_json_lists_steps_tiers_and_status(saved: Path, shm_dir: str) -> None:
    r = ckpt("ls", saved, "--memory-dir", shm_dir, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["step"], sorted(row["tiers"]), row["status"]) for row in rows] == [
        (1, ["disk"], "complete"), (2, ["disk", "memory"], "complete"), (3, ["disk", "memory"], "complete")]
    assert all(row["bytes"] > 2 << 20 and row["created"] > 0 for row in rows)


def test_verify_of_intact_checkpoints_exits_0(saved: Path, shm_dir: str) -> None:
    r = ckpt("verify", saved, "--memory-dir", shm_dir, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["damaged"] == 0 and len(out["checkpoints"]) == 5  # 3 on disk + 2 in memory


def test_verify_names_each_damaged_file_and_exits_1(root: Path, shm_dir: str, no_slots: Path) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5, keep_memory=True) as mgr:
        for step in range(1, 6):
            mgr.save(step, step_state(step))
        mgr.wait()
    damage = {1: ("flipped byte", "rank-00000.bin", lambda d: flip_byte(d / "rank-00000.bin", 12345)),
              2: ("truncated file", "rank-00000.bin", lambda d: truncate(d / "rank-00000.bin", 100)),
              3: ("missing shard manifest", "rank-00000.json", lambda d: (d / "rank-00000.json").unlink()),
              4: ("flipped commit", "manifest.json", lambda d: flip_byte(d / "manifest.json", 25))}
    for step, (_, _, do) in damage.items():
        do(ckpt_dir(root, step))
    r = ckpt("verify", root, "--memory-dir", shm_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    damaged = {int(line.split()[1]): line for line in r.stdout.splitlines() if "damaged" in line}
    assert sorted(damaged) == [1, 2, 3, 4], r.stdout  # step 5, and the memory copies of 4 and 5, are fine
    for step, (what, name, _) in damage.items():
        assert (str(ckpt_dir(root, step) / name) in damaged[step]
                or (what == "flipped commit" and name in damaged[step])), f"{what}: {damaged[step]}"
    # --step looks at that step only: the intact newest one passes.
    r = ckpt("verify", root, "--step", "5", "--memory-dir", no_slots, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(c["step"], c["status"]) for c in json.loads(r.stdout)["checkpoints"]] == [(5, "ok")]


def test_verify_manifests_only_finds_damage_to_manifests_and_sizes_not_to_bytes(root: Path, shm_dir: str,
                                                                                  no_slots: Path) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5) as mgr:
        for step in range(1, 5):
            mgr.save(step, step_state(step))
        mgr.wait()
    flip_byte(ckpt_dir(root, 1) / "rank-00000.bin", 12345)  # only a full verify reads the bytes
    truncate(ckpt_dir(root, 2) / "rank-00000.bin", 100)
    flip_byte(ckpt_dir(root, 3) / "rank-00000.json", 30)
    r = ckpt("verify", root, "--manifests-only", "--memory-dir", no_slots, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    status = {c["step"]: c["status"] for c in json.loads(r.stdout)["checkpoints"]}
    assert status == {1: "manifests ok", 2: "damaged", 3: "damaged", 4: "manifests ok"}, r.stdout
    listed = {row["step"]: row["status"] for row in json.loads(ckpt("ls", root, "--memory-dir", no_slots,
                                                                    "--json").stdout)}
    assert listed[4] == "complete" and listed[2] == "damaged", listed  # a look at manifests is not "checked"


def test_verify_of_a_step_without_commit_exits_1(saved: Path, no_slots: Path) -> None:
    (ckpt_dir(saved, 3) / "manifest.json").unlink()
    r = ckpt("verify", saved, "--step", "3", "--memory-dir", no_slots)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "step 3" in r.stdout + r.stderr


@pytest.mark.parametrize("args", [[], ["verify", "ROOT", "--step", "three"]], ids=["no-command", "bad-step"])
def test_usage_errors_exit_2(args: list[str], saved: Path) -> None:
    r = ckpt(*[saved if a == "ROOT" else a for a in args])
    assert r.returncode == 2, r.stdout + r.stderr


def test_restore_materialises_a_checkpoint_a_manager_can_load(saved: Path, shm_dir: str, tmp_path: Path,
                                                               no_slots: Path) -> None:
    dest = tmp_path / "restored"
    r = ckpt("restore", saved, "--to", dest, "--memory-dir", shm_dir, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["step"] == 3
    with CheckpointManager(dest, memory_dir=str(no_slots)) as mgr:
        step, state = restored(mgr)
    assert step == 3
    assert_same(state, step_state(3))


def test_restore_skips_a_damaged_newest_checkpoint(saved: Path, tmp_path: Path, no_slots: Path) -> None:
    flip_byte(ckpt_dir(saved, 3) / "rank-00000.bin", 999)
    dest = tmp_path / "restored"
    r = ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["step"] == 2 and "rank-00000.bin" in r.stderr
    assert "skipping step 3: " in r.stderr and [s["step"] for s in out["skipped"]] == [3]  # never silent
    assert "checksum mismatch" in out["skipped"][0]["reason"]
    assert not ckpt_dir(dest, 3).exists()  # the damaged copy was checked before its commit, and removed
    with CheckpointManager(dest, memory_dir=str(no_slots)) as mgr:
        step, state = restored(mgr)
    assert step == 2
    assert_same(state, step_state(2))


def test_restore_with_nothing_valid_exits_1(tmp_path: Path, no_slots: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = ckpt("restore", tmp_path / "empty", "--to", tmp_path / "out", "--memory-dir", no_slots)
    assert r.returncode == 1, r.stdout + r.stderr


def test_gc_keeps_the_newest_and_removes_stale_leftovers(saved: Path, shm_dir: str) -> None:
    stale = ckpt_dir(saved, 4)  # an interrupted save from an hour ago
    stale.mkdir()
    (stale / "rank-00000.bin.tmp77").write_bytes(b"\0" * 64)
    hour_ago = time.time() - 3600
    for p in (stale / "rank-00000.bin.tmp77", stale):
        os.utime(p, (hour_ago, hour_ago))
    r = ckpt("gc", saved, "--keep", "1", "--memory-dir", shm_dir, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert disk_steps(saved) == [(0, 3)] and not stale.exists()
    with CheckpointManager(saved, memory_dir=shm_dir) as mgr:
        step, state = restored(mgr)
    assert step == 3
    assert_same(state, step_state(3))


def test_listing_and_verifying_a_local_root_never_import_torch(saved: Path, shm_dir: str) -> None:
    """torch (with torch.distributed.tensor) costs seconds to import; `ckpt --help`, `ls` and
    `verify` need none of it (timings: benchmarks/cli_startup.py)."""
    code = ("import sys; from ckpt.cli import cli\n"
            "for argv in (['--help'], ['ls', sys.argv[1], '--memory-dir', sys.argv[2]],"
            " ['verify', sys.argv[1], '--memory-dir', sys.argv[2]]):\n"
            "    try:\n        cli(argv)\n    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print('heavy:', sorted(m for m in ('torch', 'numpy', 's3fs', 'fsspec') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([PYTHON, "-c", code, str(saved), shm_dir], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "step 3 (memory): ok" in done.stdout and "heavy: []" in done.stdout, done.stdout


def test_gc_orphans_reclaims_the_memory_of_jobs_that_are_gone(tmp_path: Path, shm_dir: str) -> None:
    """Without knowing any root: a job whose root was deleted, and one whose steps are on
    disk, are swept; one holding steps found nowhere else stays unless --force; a live
    job is never touched."""
    def job(name: str, *, drain: bool = True) -> Path:
        root = tmp_path / name
        mgr = CheckpointManager(root, memory_dir=shm_dir, keep_memory=True, sweep=False)  # sweeps nothing else
        mgr.save(1, step_state(1)).wait()
        if not drain:  # the step stays in memory only: its disk copy is lost
            shutil.rmtree(root / "step-000000000001.g0")
        mgr.close()
        return root

    live = CheckpointManager(tmp_path / "live", memory_dir=shm_dir)  # first: a job's start reclaims dead ones
    try:
        shutil.rmtree(job("deleted"))
        job("durable")
        job("memory-only", drain=False)
        live.save(1, step_state(1)).wait()
        done = ckpt("gc", "--orphans", "--memory-dir", shm_dir, "--json")
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert sorted(Path(r["root"]).name for r in out["removed"]) == ["deleted", "durable"]
        assert [Path(r["root"]).name for r in out["kept"]] == ["memory-only"]
        assert "--force" in out["kept"][0]["why"]
        forced = json.loads(ckpt("gc", "--orphans", "--force", "--memory-dir", shm_dir, "--json").stdout)
        assert [Path(r["root"]).name for r in forced["removed"]] == ["memory-only"]
        assert [r["step"] for r in json.loads(ckpt("ls", tmp_path / "live", "--memory-dir", shm_dir,
                                                   "--json").stdout)] == [1]
        assert len(list(Path(shm_dir).glob("ckpt-guard-*"))) == 1  # the live job's
    finally:
        live.close()


def test_a_root_that_does_not_exist_is_an_error_not_an_empty_list(tmp_path: Path, no_slots: Path) -> None:
    for cmd in ("ls", "verify", "gc"):
        r = ckpt(cmd, tmp_path / "typo", "--memory-dir", no_slots)
        assert r.returncode == 2 and "no such directory" in r.stderr, (cmd, r.stdout + r.stderr)
    a_file = tmp_path / "manifest.json"
    a_file.write_text("{}")
    r = ckpt("ls", a_file, "--memory-dir", no_slots)
    assert r.returncode == 2 and "not a directory (ROOT is the directory a run checkpoints into)" in r.stderr, r.stderr


def test_with_json_an_error_is_json_with_its_exit_code(tmp_path: Path, saved: Path, no_slots: Path) -> None:
    """A script that asked for --json parses the failure too: usage errors (2) and failures (1)."""
    for args, code, says in ((("ls", tmp_path / "typo"), 2, "no such directory"),
                             (("ls",), 2, "Missing argument 'ROOT'"),
                             (("restore", saved, "--to", tmp_path / "dest", "--step", "99"), 1, "99")):
        r = ckpt(*args, "--memory-dir", no_slots, "--json")
        assert r.returncode == code, (args, r.stdout, r.stderr)
        out = json.loads(r.stdout)
        assert out["exit_code"] == code and says in out["error"], (args, out)


def test_restore_into_a_directory_holding_checkpoints_needs_force(saved: Path, tmp_path: Path,
                                                                   no_slots: Path) -> None:
    dest = tmp_path / "dest"
    assert ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots, "--step", "2").returncode == 0
    r = ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots)
    assert r.returncode == 2 and "--force" in r.stderr, r.stdout + r.stderr
    assert [row["step"] for row in json.loads(ckpt("ls", dest, "--memory-dir", no_slots, "--json").stdout)] == [2]
    assert ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots, "--force").returncode == 0
    assert [row["step"] for row in json.loads(ckpt("ls", dest, "--memory-dir", no_slots, "--json").stdout)] == [2, 3]


def test_restore_force_never_writes_through_a_symlinked_step_directory(saved: Path, tmp_path: Path,
                                                                       no_slots: Path) -> None:
    dest, elsewhere = tmp_path / "dest", tmp_path / "elsewhere"
    assert ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots, "--step", "2").returncode == 0
    elsewhere.mkdir()
    ckpt_dir(dest, 3).symlink_to(elsewhere)
    r = ckpt("restore", saved, "--to", dest, "--memory-dir", no_slots, "--force")
    assert r.returncode == 1 and "symlink" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert list(elsewhere.iterdir()) == []


def test_the_disk_tier_never_writes_or_deletes_through_a_symlinked_step_directory(saved: Path,
                                                                                   tmp_path: Path) -> None:
    from ckpt import CheckpointError
    from ckpt.restore.execute import open_shard
    from ckpt.tiers.local import LocalDiskTier

    source, target, elsewhere = LocalDiskTier(saved), LocalDiskTier(tmp_path / "dest"), tmp_path / "elsewhere"
    ckpt_id = source.list()[-1].id
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not the tier's")
    target.root.mkdir()
    (target.root / ckpt_id.name).symlink_to(elsewhere)
    reader = open_shard(source, ckpt_id, 0)
    try:
        with pytest.raises(CheckpointError, match="symlink"):
            target.write_shard(ckpt_id, reader)
    finally:
        reader.close()
    target.delete(ckpt_id)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep"]
