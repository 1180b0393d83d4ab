"""Hostile and careless input to the checkpoint engine (issue 15): manifests built to
exhaust the reader, states that do not match the checkpoint, shards without
checksums, and ranks with nothing to store. Every refusal is a clear error, and a
bad manifest is a damaged checkpoint that restore skips, never a crash."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch

from ckpt import CheckpointError, CheckpointManager, ManifestError
from ckpt.checksum import MIN_CHUNK_BYTES, check_chunk_bytes, chunk_checksums, crc32c_of
from ckpt.manifest import (
    MAX_JSON_DEPTH, MAX_JSON_ITEMS, MAX_MANIFEST_BYTES, MAX_TENSORS_PER_SHARD, MAX_WORLD_SIZE, Manifest,
    ShardManifest, TensorEntry, dumps, loads_bounded,
)
from ckpt.state import tensor_targets, unflatten
from tests.ckpt_helpers import (  # noqa: F401  (fixtures)
    assert_same, plant_shard_manifest, restored, rewrite_json, root, shm_dir, step_state,
)
from tests.test_ckpt_integrity import NEWEST, disk_only, saved  # noqa: F401  (fixtures: steps 1..3 on disk)

DEEP = 100_000


def deep(n: int = DEEP) -> bytes:
    return b"[" * n + b"]" * n


def shard_with(saved: Path, **fields: bytes) -> bytes:
    """The newest step's shard manifest with some fields replaced by raw JSON text."""
    doc = json.loads((saved / "rank-00000.json").read_bytes())
    doc.update({k: f"@{k}@" for k in fields})
    raw = dumps(doc)
    for k, text in fields.items():
        raw = raw.replace(f'"@{k}@"'.encode(), text)
    return raw


def falls_back_past_newest(disk_only: Callable[[], CheckpointManager], caplog: pytest.LogCaptureFixture,
                           reason: str) -> None:
    """The constructor, list() and restore() all survive; the newest step is damaged (listed so, or
    skipped by restore with a warning saying why), the one before restores."""
    with disk_only() as mgr:
        listed = [json.dumps(r["damaged"]) for r in mgr.list() if r["step"] == NEWEST and r["damaged"]]
        step, state = restored(mgr)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and f"step {NEWEST}" in r.getMessage()]
    assert any(reason in why for why in listed + warned), listed + warned
    assert step == NEWEST - 1
    assert_same(state, step_state(step))


# -- issue 15.5: manifests built to exhaust the reader ----------------------------------


@pytest.mark.parametrize("parse", [Manifest.from_bytes, ShardManifest.from_bytes,
                                   lambda raw: loads_bounded(raw, "owner.json", 4, 1 << 20)],
                         ids=["commit", "shard", "owner.json"])
def test_deep_json_is_refused_before_it_is_parsed(parse: Callable[[bytes], object]) -> None:
    for raw in (deep(), b'{"tree":' + deep() + b"}", b'{"a":' * DEEP + b"1" + b"}" * DEEP):
        with pytest.raises(ManifestError, match="nested deeper than"):
            parse(raw)


def test_deep_commit_is_a_damaged_checkpoint(saved: Path, disk_only, caplog: pytest.LogCaptureFixture) -> None:
    (saved / "manifest.json").write_bytes(b'{"format":"ckpt-guard","shards":' + deep() + b"}")
    falls_back_past_newest(disk_only, caplog, "nested deeper than")


def test_deep_shard_manifest_is_a_damaged_checkpoint(saved: Path, disk_only, caplog: pytest.LogCaptureFixture) -> None:
    plant_shard_manifest(saved / "rank-00000.json", shard_with(saved, tree=b'{"meta":' + deep() + b"}"))
    falls_back_past_newest(disk_only, caplog, "nested deeper than")


@pytest.mark.parametrize("text, depth", [
    (b'["[[[", "]]]]", {"k[": "{"}]', 2),
    (rb'["\\", "[", "\"[[", "\\\\\"{{"]', 1),
    (rb'[[["\\\\"], [[]]], "\\\"]"]', 4),
    ('["é[[", {"ü": [["€"]]}]'.encode(), 4),
    (b"7", 0),
])
def test_nesting_is_measured_outside_strings(text: bytes, depth: int) -> None:
    assert loads_bounded(text, "t", depth, 1 << 10) == json.loads(text)
    if depth:
        with pytest.raises(ManifestError, match="nested deeper"):
            loads_bounded(text, "t", depth - 1, 1 << 10)


def test_moderately_nested_state_round_trips_and_a_deeper_one_is_refused_at_save(root: Path, shm_dir: str) -> None:
    def nested(n: int) -> dict:
        value: object = torch.arange(3)
        for i in range(n):
            value = {"k": value} if i % 2 else [value]
        return {"x": value}

    state = nested(MAX_JSON_DEPTH - 6)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, state)
        mgr.wait()
        for too_deep in (MAX_JSON_DEPTH, 5000):  # 5000: deeper than Python's recursion limit
            with pytest.raises(CheckpointError, match="nested too deeply"):
                mgr.save(2, nested(too_deep))
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert_same(restored(mgr), (1, state))


def test_tree_decoding_is_bounded_on_a_tree_that_never_went_through_json() -> None:
    tree: object = 1
    for _ in range(DEEP):
        tree = [tree]
    with pytest.raises(ManifestError, match="nested deeper than"):
        unflatten({"x": tree}, lambda i: torch.zeros(1))
    loop: list = []
    loop.append(loop)  # a target as deep as the tree: tensor_targets walks both
    with pytest.raises(ManifestError, match="nested deeper than"):
        tensor_targets({"x": loop}, {"x": tree})


def test_tiny_chunks_are_refused_on_read_and_on_write(saved: Path, disk_only, caplog: pytest.LogCaptureFixture) -> None:
    """chunk_bytes 1 would make every byte a checksum: a 3 MB checkpoint, 3 M CRCs."""
    def tiny(doc: dict) -> None:
        doc["chunk_bytes"] = 1
        for t in doc["tensors"]:
            t["checksums"] = [0] * max(1, t["nbytes"])
    rewrite_json(saved / "rank-00000.json", tiny)
    with pytest.raises(ManifestError, match=f"'chunk_bytes' must be an integer >= {MIN_CHUNK_BYTES}"):
        ShardManifest.from_bytes((saved / "rank-00000.json").read_bytes())
    falls_back_past_newest(disk_only, caplog, "chunk_bytes")

    with pytest.raises(ValueError, match="chunk_bytes must be an integer >= 65536"):
        check_chunk_bytes(1)
    assert check_chunk_bytes(MIN_CHUNK_BYTES) == MIN_CHUNK_BYTES
    with pytest.raises(CheckpointError, match="chunk_bytes 1 is under"):
        ShardManifest(0, 1, 0, 0, [], {}, 1).to_bytes()


def test_a_tensor_smaller_than_a_chunk_has_one_checksum() -> None:
    t = torch.arange(10, dtype=torch.int32)
    sums = chunk_checksums(memoryview(t.numpy()).cast("B"), MIN_CHUNK_BYTES)
    man = ShardManifest(0, 1, 0, 40, [TensorEntry(0, "t", "int32", (10,), 0, 40, tuple(sums))], {"t": {"__tensor__": 0}},
                        MIN_CHUNK_BYTES)
    assert ShardManifest.from_bytes(man.to_bytes()) == man and len(sums) == 1


def test_oversize_entry_counts_are_refused(saved: Path) -> None:
    too_many_tensors = shard_with(saved, tensors=b"[" + b",".join([b"{}"] * (MAX_TENSORS_PER_SHARD + 1)) + b"]")
    with pytest.raises(ManifestError, match=f"{MAX_TENSORS_PER_SHARD + 1} tensors is over the limit"):
        ShardManifest.from_bytes(too_many_tensors)
    too_many_items = shard_with(saved, tree=b"[" + b",".join([b"0"] * MAX_JSON_ITEMS) + b"]")
    with pytest.raises(ManifestError, match=f"more than {MAX_JSON_ITEMS} JSON items"):
        ShardManifest.from_bytes(too_many_items)
    with pytest.raises(ManifestError, match="world size .* over the limit"):
        ShardManifest.from_bytes(shard_with(saved, world_size=str(MAX_WORLD_SIZE + 1).encode()))

    commit = json.loads(Manifest(NEWEST, 0, 1, []).to_bytes())
    commit.pop("self_crc32c")
    commit["world_size"] = MAX_WORLD_SIZE + 1
    commit["self_crc32c"] = crc32c_of(dumps(commit))
    with pytest.raises(ManifestError, match="world size .* over the limit"):
        Manifest.from_bytes(dumps(commit))


def test_a_manifest_over_the_byte_cap_is_refused_unread() -> None:
    huge = b'{"tree":"' + b"a" * MAX_MANIFEST_BYTES + b'"}'
    for parse in (Manifest.from_bytes, ShardManifest.from_bytes):
        with pytest.raises(ManifestError, match=f"over the limit of {MAX_MANIFEST_BYTES}"):
            parse(huge)


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe[\x001\x00]\x00", "not valid JSON"),  # UTF-16 is not what the engine writes
    (b'{"a": 1', "not valid JSON"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),  # an int too long to convert
    (b"[" + b"1," * 99 + b"1]", "more than 64 JSON items"),
    (b" " * 70_000, "70000 bytes, over the limit of 65536"),
])
def test_bounded_loading_refuses_garbage_with_a_clear_error(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        loads_bounded(raw, "owner.json", 4, 1 << 16, max_items=64)


def test_writer_refuses_a_manifest_that_readers_would_refuse() -> None:
    man = ShardManifest(0, 1, 0, 0, [], {"many": [0] * MAX_JSON_ITEMS}, MIN_CHUNK_BYTES)
    with pytest.raises(CheckpointError, match="more than 8388608 JSON items, which readers refuse"):
        man.to_bytes()
