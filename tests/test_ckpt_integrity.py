"""Damaged and hostile checkpoints: every kind of damage is detected, named (step and
file), and skipped by restore, which falls back to the next valid candidate."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from ckpt import CheckpointError, CheckpointManager, ManifestError
from ckpt.format.manifest import Manifest, ShardManifest
from tests.ckpt_helpers import (
    SAVED_NEWEST,
    assert_same,
    ckpt_dir,
    flip_byte,
    restored,
    rewrite_json,
    step_state,
    truncate,
)

NEWEST = SAVED_NEWEST


def skip_reasons(mgr: CheckpointManager, caplog: pytest.LogCaptureFixture, step: int) -> str:
    """Why ``step`` was not restored: its damaged listing plus restore's warnings about it."""
    listed = [json.dumps(r["damaged"]) for r in mgr.list() if r["step"] == step and r["damaged"]]
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and f"step {step}" in r.getMessage()]
    return "\n".join(listed + warned)


def shard_offset(data_dir: Path, tensor: str) -> int:
    man = ShardManifest.from_bytes((data_dir / "rank-00000.json").read_bytes())
    return next(t.offset + t.nbytes // 2 for t in man.tensors if t.path == tensor)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped-data-byte": (lambda d: flip_byte(d / "rank-00000.bin", shard_offset(d, "weights")),
                          r"rank-00000\.bin.*checksum mismatch in tensor 'weights'"),
    "flipped-last-data-byte": (lambda d: flip_byte(d / "rank-00000.bin", shard_offset(d, "moments")),
                               r"rank-00000\.bin.*checksum mismatch in tensor 'moments'"),
    "truncated-data": (lambda d: truncate(d / "rank-00000.bin", 1), r"rank-00000\.bin: truncated or extended"),
    "missing-data": (lambda d: (d / "rank-00000.bin").unlink(), r"rank-00000\.bin: missing"),
    "flipped-shard-manifest": (lambda d: flip_byte(d / "rank-00000.json", 40),
                               r"rank-00000\.json: does not match the commit's checksum"),
    "missing-shard-manifest": (lambda d: (d / "rank-00000.json").unlink(), r"rank-00000\.json: missing"),
    "flipped-commit": (lambda d: flip_byte(d / "manifest.json", 30), r"manifest\.json"),
    "truncated-commit": (lambda d: truncate(d / "manifest.json", 10), r"manifest\.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_disk_checkpoint_is_named_and_skipped(saved: Path, disk_only, damage: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    do, reason = DAMAGE[damage]
    do(saved)
    with disk_only() as mgr:
        step, state = restored(mgr)
        why = skip_reasons(mgr, caplog, NEWEST)
    assert step == NEWEST - 1
    assert_same(state, step_state(step))
    assert f"step {NEWEST}" in why or '"disk"' in why
    assert re.search(reason, why), why


def test_checkpoint_without_commit_does_not_exist(saved: Path, disk_only) -> None:
    (saved / "manifest.json").unlink()
    with disk_only() as mgr:
        assert [r["step"] for r in mgr.list()] == [1, 2]
        step, state = restored(mgr)
    assert step == NEWEST - 1
    assert_same(state, step_state(step))


def test_damaged_memory_slot_falls_back_to_the_disk_copy_of_the_same_step(saved: Path, root: Path, shm_dir: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    seal = next(p for p in Path(shm_dir).rglob("slot-*.json")
                if ShardManifest.from_bytes(p.read_bytes()).step == NEWEST)
    man = ShardManifest.from_bytes(seal.read_bytes())
    assert man.has_checksums, "the drain re-seals the slot with checksums"
    flip_byte(seal.with_suffix(".bin"), next(t.offset for t in man.tensors if t.path == "counts"))
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        step, state = restored(mgr)
        why = skip_reasons(mgr, caplog, NEWEST)
    assert step == NEWEST
    assert_same(state, step_state(NEWEST))
    assert "tier memory" in why and "checksum mismatch in tensor 'counts'" in why and seal.name[:6] in why


def test_restore_of_a_named_damaged_step_fails_naming_the_file(saved: Path, disk_only) -> None:
    flip_byte(saved / "rank-00000.bin", 100)
    with disk_only() as mgr:
        with pytest.raises(CheckpointError, match=r"step 3.*rank-00000\.bin.*checksum mismatch"):
            mgr.restore({}, step=NEWEST)
        with pytest.raises(CheckpointError, match="step 9 is in no tier"):
            mgr.restore({}, step=9)


def test_every_candidate_damaged_raises_listing_each(saved: Path, root: Path, disk_only) -> None:
    for step in range(1, NEWEST + 1):
        truncate(ckpt_dir(root, step) / "rank-00000.bin", 4)
    with disk_only() as mgr:
        with pytest.raises(CheckpointError, match="every candidate is damaged") as err:
            mgr.restore({})
    assert all(f"step {s}" in str(err.value) for s in range(1, NEWEST + 1))


# -- manifests are untrusted input ----------------------------------------------------------


def _set(*keys: Any, value: Any) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        for k in keys[:-1]:
            doc = doc[k]
        doc[keys[-1]] = value
    return change


HOSTILE_COMMIT = {
    "shard-manifest-path-traversal": (_set("shards", 0, "manifest", value="../rank-00000.json"), "refusing file name"),
    "data-file-with-slash": (_set("shards", 0, "data", value="sub/rank-00000.bin"), "refusing file name"),
    "data-file-dotdot": (_set("shards", 0, "data", value=".."), "refusing file name"),
    "absolute-data-file": (_set("shards", 0, "data", value="/etc/passwd"), "refusing file name"),
    "unknown-major-version": (_set("format_version", value="2.0"), r"format 2\.0 is not readable.*upgrade"),
    "missing-version": (_set("format_version", value=None), "no valid format_version"),
    "foreign-format": (_set("format", value="pickle"), "not a ckpt-guard manifest"),
    # A commit may list a subset of the ranks (each node commits its own), never one twice.
    "a-shard-listed-twice": (lambda d: (d.update(world_size=2), d["shards"].append(dict(d["shards"][0]))),
                             "shard ranks must be distinct"),
    "negative-data-bytes": (_set("shards", 0, "data_bytes", value=-1), r"'data_bytes' must be an integer >= 0"),
}

HOSTILE_SHARD = {
    "unknown-dtype": (_set("tensors", 0, "dtype", value="object"), "unknown dtype 'object'"),
    "offset-past-the-end": (lambda d: _set("tensors", 0, "offset", value=d["data_bytes"])(d), "past the data's end"),
    "size-not-matching-shape": (lambda d: _set("tensors", 0, "nbytes", value=d["tensors"][0]["nbytes"] + 4)(d),
                                "does not match shape"),
    "negative-offset": (_set("tensors", 0, "offset", value=-8), r"'offset' must be an integer >= 0"),
    "negative-dimension": (_set("tensors", 0, "shape", value=[-1, 4]), "bad shape"),
    "foreign-data-file": (_set("data_file", value="../../etc/shadow"), "does not belong to rank 0"),
    "unknown-major-version": (_set("format_version", value="9.1"), r"format 9\.1 is not readable"),
    "unknown-checksum": (_set("checksum", value="md5"), "unsupported checksum 'md5'"),
    "duplicate-tensor-ids": (_set("tensors", 1, "id", value=0), "tensor ids are not"),
    "wrong-chunk-count": (_set("tensors", 0, "checksums", value=[1, 2, 3]), "expected 1 chunk checksums"),
    "huge-shape": (lambda d: _set("tensors", 0, "shape", value=[2**31, 2**31])(d) or
                   _set("tensors", 0, "nbytes", value=4 * 2**62)(d), "past the data's end"),
    "bad-bytes-in-tree": (_set("tree", "meta", "blob", value={"__bytes__": "!!not base64"}), "bad __bytes__ value"),
    "tensor-index-out-of-range": (_set("tree", "meta", "x", value={"__tensor__": 999}), "bad __tensor__ value"),
    "object-numpy-scalar": (_set("tree", "meta", "x", value={"__npscalar__": ["|O", 1]}), "bad __npscalar__ value"),
    "unknown-torch-dtype": (_set("tree", "meta", "x", value={"__dtype__": "object"}), "bad __dtype__ value"),
    "tree-not-a-dict": (_set("tree", value=[1, 2]), "top level is not a dict"),
}


@pytest.mark.parametrize("name", [f"commit:{k}" for k in HOSTILE_COMMIT] + [f"shard:{k}" for k in HOSTILE_SHARD])
def test_hostile_manifest_is_refused_with_a_clear_message_and_skipped(saved: Path, disk_only, name: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    kind, key = name.split(":")
    change, message = (HOSTILE_COMMIT if kind == "commit" else HOSTILE_SHARD)[key]
    target = saved / ("manifest.json" if kind == "commit" else "rank-00000.json")
    rewrite_json(target, change)
    parse = Manifest.from_bytes if kind == "commit" else ShardManifest.from_bytes
    if not key.startswith(("bad-", "tensor-index", "object-numpy", "unknown-torch", "tree-")):  # tree: checked on load
        with pytest.raises(ManifestError, match=message):
            parse(target.read_bytes())
    with disk_only() as mgr:
        step, state = restored(mgr)
        why = skip_reasons(mgr, caplog, NEWEST)
    assert step == NEWEST - 1
    assert_same(state, step_state(step))
    assert re.search(message, why), why


@pytest.mark.parametrize("garbage", [b"\x80\x81 not json", b"[1, 2]", b""], ids=["binary", "json-list", "empty"])
def test_unparseable_commit_is_listed_as_damaged(saved: Path, disk_only, garbage: bytes) -> None:
    (saved / "manifest.json").write_bytes(garbage)
    with disk_only() as mgr:
        rows = {r["step"]: r for r in mgr.list()}
        assert rows[NEWEST]["status"] == "damaged" and "manifest.json" in rows[NEWEST]["damaged"]["disk"]
        assert restored(mgr)[0] == NEWEST - 1


def test_newer_minor_format_version_is_still_read(saved: Path, disk_only) -> None:
    rewrite_json(saved / "rank-00000.json", _set("format_version", value="1.9"))
    rewrite_json(saved / "manifest.json", _set("format_version", value="1.9"))
    with disk_only() as mgr:
        step, state = restored(mgr)
    assert step == NEWEST
    assert_same(state, step_state(NEWEST))
