"""``ckpt verify --manifests-only --jobs N`` (``ckpt/tiers/manifest_jobs.py``): worker processes
check the shard manifests and refuse what one process refuses, naming the damaged file, on disk
and in the S3 test server (where the data objects' sizes come from one listing)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.scale_listing import _s3, put_checkpoint, write_checkpoint
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.local import LocalDiskTier
from ckpt.tiers.manifest_jobs import MIN_SHARDS_PER_JOB
from ckpt.tiers.object_store import ObjectStoreTier
from tests.ckpt_helpers import ckpt_dir
from tests.test_ckpt_cli import ckpt

WORLD = 3 * MIN_SHARDS_PER_JOB  # enough for two workers


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 70B model's shard manifests over WORLD ranks (``scale_listing``), data files empty."""
    root = tmp_path_factory.mktemp("sharded")
    write_checkpoint(LocalDiskTier(root), WORLD)
    return root


def _verify(root: Path | str, *args: str) -> tuple[int, dict]:
    r = ckpt("verify", root, "--manifests-only", "--memory-dir", "/nonexistent-no-slots", "--json", *args)
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sound_manifests_pass_with_one_process_or_several(sharded: Path, jobs: str) -> None:
    code, out = _verify(sharded, "--jobs", jobs)
    assert code == 0 and [c["status"] for c in out["checkpoints"]] == ["manifests ok"], out


@pytest.mark.parametrize("damage", ["flipped manifest", "extended data"])
def test_workers_name_the_damaged_file(sharded: Path, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "copy"
    shutil.copytree(sharded, root)
    step_dir = ckpt_dir(root, 1)
    if damage == "flipped manifest":
        target = step_dir / f"rank-{WORLD - 5:05d}.json"
        raw = bytearray(target.read_bytes())
        raw[1000] ^= 1
        target.write_bytes(bytes(raw))
    else:
        target = step_dir / f"rank-{WORLD - 5:05d}.bin"
        target.write_bytes(b"x")
    for jobs in ("1", "2"):
        code, out = _verify(root, "--jobs", jobs)
        (row,) = out["checkpoints"]
        assert code == 1 and row["status"] == "damaged" and row["file"] == str(target), (jobs, out)


@pytest.mark.parametrize("damage", ["sound", "flipped manifest", "extended data", "missing data"])
def test_in_s3_every_shard_is_checked_and_damage_named(s3_server, damage: str) -> None:
    with _s3(s3_server) as (url, options):
        tier = ObjectStoreTier(url, options)
        try:
            put_checkpoint(tier, WORLD)
            rank = WORLD - 5
            name = f"rank-{rank:05d}.json" if damage == "flipped manifest" else f"rank-{rank:05d}.bin"
            key = tier._key(CheckpointId(0, 1), name)
            if damage == "flipped manifest":
                raw = bytearray(tier.fs.cat_file(key))
                raw[1000] ^= 1
                tier.fs.pipe_file(key, bytes(raw))
            elif damage == "extended data":
                tier.fs.pipe_file(key, b"x")
            elif damage == "missing data":
                tier.fs.rm_file(key)
            for jobs in ("1", "2"):
                code, out = _verify(url, "--jobs", jobs)
                (row,) = out["checkpoints"]
                if damage == "sound":
                    assert code == 0 and row["status"] == "manifests ok", (jobs, out)
                else:
                    assert code == 1 and row["status"] == "damaged" and row["file"].endswith(name), (jobs, out)
        finally:
            tier.close()
