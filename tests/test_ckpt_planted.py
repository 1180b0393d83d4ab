"""Hostile neighbours on one machine: /dev/shm and a checkpoint root are places other
users (or careless scripts) can write to. Nothing planted there is listed, restored
or allowed to crash a job (issue: security and hostile input, points 1 and 2).

"Another user" is simulated as root does it: files made by this process, then handed
to ``nobody`` with chown, exactly as that user would have left them."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager
from ckpt.tiers.memory import memory_namespace
from tests.ckpt_helpers import assert_same, restored, step_state
from tests.test_ckpt_cli import ckpt as ckpt_cli

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="handing files to another user needs root")


def chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for p in path.rglob("*"):
        os.chown(p, uid, uid, follow_symlinks=False)


def plant_namespace(victim_root: Path, shm: str, tmp_path: Path, step: int, name: str = "deadbeefdeadbeef") -> Path:
    """A namespace another user made: a valid sealed slot of a newer ``step`` whose owner
    record names the victim's root."""
    other = tmp_path / "attacker-root"
    with CheckpointManager(other, memory_dir=shm, run="evil", keep_memory=True) as mgr:
        mgr.save(step, {"w": torch.full((4,), 666.0)}).wait()
    src = memory_namespace(other, "evil", shm)
    planted = Path(shm) / f"ckpt-guard-{os.getuid()}-{name}"
    shutil.copytree(src, planted, symlinks=True)
    for owner in planted.glob("rank-*/owner.json"):
        doc = json.loads(owner.read_text())
        owner.write_text(json.dumps({**doc, "root": str(victim_root.resolve()), "pid": 1}))
    (planted / "rank-00000" / "lock").unlink(missing_ok=True)
    chown_tree(planted, NOBODY)
    return planted


def test_a_namespace_planted_by_another_user_is_never_listed_or_restored(root: Path, shm_dir: str,
                                                                         tmp_path: Path) -> None:
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
    plant_namespace(root, shm_dir, tmp_path, step=99)

    listed = json.loads(ckpt_cli("ls", root, "--memory-dir", shm_dir, "--json").stdout)
    assert [r["step"] for r in listed] == [1]
    assert torch.equal(ckpt.load(str(root))["w"], torch.ones(4))
    assert ckpt_cli("restore", root, "--memory-dir", shm_dir, "--to", tmp_path / "out", "--json").returncode == 0
    assert json.loads(ckpt_cli("ls", tmp_path / "out", "--memory-dir", shm_dir, "--json").stdout)[0]["step"] == 1
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        state = {"w": torch.zeros(4)}
        assert mgr.restore(state) == 1 and torch.equal(state["w"], torch.ones(4))


def test_a_namespace_of_this_user_but_readable_by_others_is_ignored(root: Path, shm_dir: str, tmp_path: Path) -> None:
    root.mkdir(parents=True)
    planted = plant_namespace(root, shm_dir, tmp_path, step=99)
    chown_tree(planted, os.getuid())
    planted.chmod(0o755)  # not private: someone else could have swapped its files
    assert json.loads(ckpt_cli("ls", root, "--memory-dir", shm_dir, "--json").stdout) == []


def test_a_deeply_nested_owner_record_breaks_nothing(root: Path, shm_dir: str, tmp_path: Path) -> None:
    root.mkdir(parents=True)
    planted = plant_namespace(root, shm_dir, tmp_path, step=99)
    chown_tree(planted, os.getuid())
    (planted / "rank-00000" / "owner.json").write_text("[" * 100_000 + "]" * 100_000)
    with CheckpointManager(tmp_path / "any-root", memory_dir=shm_dir) as mgr:
        mgr.save(1, {"w": torch.ones(1)}).wait()
    done = ckpt_cli("ls", root, "--memory-dir", shm_dir)
    assert done.returncode == 0 and "RecursionError" not in done.stderr, done.stderr


def test_a_symlinked_shard_on_disk_is_damage_not_a_way_to_read_other_files(root: Path, shm_dir: str,
                                                                           tmp_path: Path) -> None:
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5) as mgr:
        mgr.save(1, step_state(1)).wait()
        mgr.save(2, step_state(2)).wait()
    shutil.rmtree(shm_dir)
    os.mkdir(shm_dir)
    secret = tmp_path / "secret.bin"
    data = next(root.glob("step-000000000002.g0/rank-00000.bin"))
    secret.write_bytes(data.read_bytes())  # same bytes, so only the link itself can give it away
    data.unlink()
    data.symlink_to(secret)

    done = ckpt_cli("verify", root, "--memory-dir", shm_dir, "--step", "2")
    assert done.returncode == 1 and "symlink" in done.stdout, done.stdout + done.stderr
    out = tmp_path / "out"
    assert ckpt_cli("restore", root, "--memory-dir", shm_dir, "--to", out).returncode == 0
    assert not any(p.is_symlink() for p in out.rglob("*"))
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        step, got = restored(mgr)
    assert step == 1
    assert_same(got, step_state(1))


def test_a_namespace_taken_under_the_jobs_exact_name_makes_the_job_choose_another(root: Path, shm_dir: str,
                                                                                   tmp_path: Path) -> None:
    """Another user pre-creates the job's predictable namespace: the job uses a private one
    of its own beside it, and finds it again after a restart (its slots are still there)."""
    taken = memory_namespace(root, "default", shm_dir)
    taken.mkdir(mode=0o777)
    chown_tree(taken, NOBODY)
    with CheckpointManager(root, memory_dir=shm_dir, keep_memory=True) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        ns = mgr._ns
    assert ns != taken and ns.name.startswith(taken.name + "-") and (ns / "rank-00000").is_dir()
    assert memory_namespace(root, "default", shm_dir) == ns  # what the CLI and a restarted job look up
    with CheckpointManager(root, memory_dir=shm_dir) as again:
        assert again._ns == ns
        state = {"w": torch.zeros(4)}
        assert again.restore(state) == 1 and torch.equal(state["w"], torch.ones(4))
    assert os.lstat(taken).st_uid == NOBODY and not any(taken.iterdir())  # the other user's is left alone
