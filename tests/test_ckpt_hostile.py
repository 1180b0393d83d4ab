"""Hostile and careless input to the checkpoint engine (issue 15): manifests built to
exhaust the reader, states that do not match the checkpoint, shards without
checksums, and ranks with nothing to store. Every refusal is a clear error, and a
bad manifest is a damaged checkpoint that restore skips, never a crash."""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from ckpt import CheckpointError, CheckpointManager, ManifestError
from ckpt.format.checksum import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, check_chunk_bytes, chunk_checksums, crc32c_of
from ckpt.format.manifest import (
    MAX_COMMIT_BYTES,
    MAX_JSON_DEPTH,
    MAX_JSON_ITEMS,
    MAX_MANIFEST_BYTES,
    MAX_TENSORS_PER_SHARD,
    MAX_WORLD_SIZE,
    Manifest,
    ShardManifest,
    ShardRef,
    TensorEntry,
    dumps,
    loads_bounded,
)
from ckpt.format.state import flatten, tensor_targets, unflatten
from ckpt.restore.state_load import StateMismatch, check_restorable, load_into
from ckpt.tiers.memory.copier import plan_layout
from tests.ckpt_helpers import REPO, assert_same, ckpt_dir, plant_shard_manifest, restored, rewrite_json, step_state
from tests.ckpt_helpers import SAVED_NEWEST as NEWEST
from tests.test_ckpt_roundtrip import as_saved

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
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and f"step {NEWEST}" in r.getMessage()]
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
    """chunk_bytes 1 would make every byte a checksum: a 2 MB checkpoint, 2 M CRCs."""
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
    man = ShardManifest(0, 1, 0, 40, [TensorEntry(0, "t", "int32", (10,), 0, 40, tuple(sums))],
                        {"t": {"__tensor__": 0}}, MIN_CHUNK_BYTES)
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
    """A commit's cap is tighter: listing reads every one."""
    huge = b'{"tree":"' + b"a" * MAX_MANIFEST_BYTES + b'"}'
    for parse, cap in ((Manifest.from_bytes, MAX_COMMIT_BYTES), (ShardManifest.from_bytes, MAX_MANIFEST_BYTES)):
        with pytest.raises(ManifestError, match=f"{len(huge)} bytes, over the limit of {cap}"):
            parse(huge)


def test_a_commit_is_checked_against_its_own_text() -> None:
    """The self-CRC covers the bytes as written (no second serialisation of a large commit)."""
    raw = Manifest(3, 1, 1, [ShardRef(0, 5, 10)]).to_bytes()
    assert Manifest.from_bytes(raw).step == 3
    pretty = json.dumps(json.loads(raw), indent=1).encode()  # the same document, other bytes
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_bytes(pretty)


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


# -- issue 15.4: restoring into a state that does not match ------------------------------


def seq(*sizes: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


def stepped(model: torch.nn.Module) -> dict:
    """The model and an AdamW after one step (so both hold tensors to overwrite)."""
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, model[0].in_features)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


# name: (saved state, target state, differences the error must list)
MISMATCHES: dict[str, tuple[Callable[[], dict], Callable[[], dict], list[str]]] = {
    "model-of-another-shape": (
        lambda: stepped(seq(8, 8, 4)), lambda: stepped(seq(8, 8, 5, seed=1)),
        [r"model\.1\.weight: checkpoint has shape \(4, 8\), target \(5, 8\)",
         r"model\.1\.bias: checkpoint has shape \(4,\), target \(5,\)",
         r"optim\.state\.2\.exp_avg: checkpoint has shape \(4, 8\), target \(5, 8\)",
         r"optim\.state\.2\.exp_avg_sq: checkpoint has shape \(4, 8\), target \(5, 8\)",
         r"optim\.state\.3\.exp_avg: checkpoint has shape \(4,\), target \(5,\)",
         r"optim\.state\.3\.exp_avg_sq: checkpoint has shape \(4,\), target \(5,\)"]),
    "module-with-other-layers": (
        lambda: {"model": seq(8, 8)}, lambda: {"model": seq(8, 8, 4)},
        [r"model\.1\.weight: in the module but not in the checkpoint",
         r"model\.1\.bias: in the module but not in the checkpoint"]),
    "other-top-level-keys": (
        lambda: {"model": seq(8, 4), "w": torch.ones(3)}, lambda: {"net": seq(8, 4, seed=1), "w": torch.zeros(3)},
        [r"net: in the state but not in the checkpoint"]),
    "numpy-array-of-another-shape": (
        lambda: {"moments": np.arange(6.0), "w": torch.ones(3)}, lambda: {"moments": np.zeros(5), "w": torch.zeros(3)},
        [r"moments: checkpoint has shape \(6,\), target \(5,\)"]),
    "other-dtypes": (
        lambda: {"w": torch.ones(3), "a": np.ones(2)},
        lambda: {"w": torch.zeros(3, dtype=torch.bfloat16), "a": np.zeros(2, np.float32)},
        [r"w: checkpoint has dtype float32, target bfloat16", r"a: checkpoint has dtype float64, target float32"]),
    "other-parameter-groups": (
        lambda: stepped(seq(8, 8, 4)),
        lambda: {"model": (m := seq(8, 8, 4)), "optim": torch.optim.SGD([{"params": m[0].parameters()},
                                                                         {"params": m[1].parameters()}])},
        [r"optim\.param_groups: checkpoint has 1 parameter groups, target 2"]),
    "tensor-where-a-value-was-saved": (
        lambda: {"w": 3, "m": {"x": torch.ones(2)}}, lambda: {"w": torch.zeros(3), "m": torch.zeros(2)},
        [r"w: checkpoint has an int, target a tensor \(3,\) of float32",
         r"m: checkpoint has a dict, target a tensor \(2,\) of float32"]),
}


@pytest.fixture
def save_one(root: Path, shm_dir: str) -> Callable[[dict], ShardManifest]:
    """Save ``state`` as step 1 and return its (real, on-disk) shard manifest."""
    def save(state: dict) -> ShardManifest:
        with CheckpointManager(root, memory_dir=shm_dir) as mgr:
            mgr.save(1, state)
            mgr.wait()
        return ShardManifest.from_bytes((ckpt_dir(root, 1) / "rank-00000.json").read_bytes())
    return save


def frozen(state: dict) -> tuple[list, dict]:
    """What a restore must not change: the objects in the dict and all their values."""
    return list(state.items()), copy.deepcopy(as_saved(state))


def assert_unchanged(state: dict, before: tuple[list, dict]) -> None:
    objects, values = before
    assert list(state) == [k for k, _ in objects] and all(state[k] is v for k, v in objects)
    assert_same(as_saved(state), values)


@pytest.mark.parametrize("case", MISMATCHES, ids=list(MISMATCHES))
def test_check_restorable_lists_every_difference_before_anything_is_read(save_one, case: str) -> None:
    make_saved, make_target, differences = MISMATCHES[case]
    man = save_one(make_saved())
    target = make_target()
    before = frozen(target)
    with pytest.raises(StateMismatch, match="does not match the checkpoint") as err:
        check_restorable(target, man.tree, man.tensors)
    for difference in differences:
        assert re.search(difference, str(err.value)), str(err.value)
    assert f"({len(differences)} difference" in str(err.value), str(err.value)
    assert_unchanged(target, before)


@pytest.mark.parametrize("case", MISMATCHES, ids=list(MISMATCHES))
def test_restore_into_a_mismatched_state_changes_nothing(root: Path, shm_dir: str, case: str) -> None:
    make_saved, make_target, differences = MISMATCHES[case]
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, make_saved())
        mgr.wait()
    target = make_target()
    before = frozen(target)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        with pytest.raises(CheckpointError) as err:
            mgr.restore(target)
    assert all(re.search(d, str(err.value)) for d in differences), str(err.value)
    assert_unchanged(target, before)


def test_a_matching_state_or_an_empty_dict_passes(save_one) -> None:
    saved = stepped(seq(8, 8, 4))
    man = save_one({**saved, "moments": np.ones(4), "extra": {"k": (1, 2)}})
    fresh = seq(8, 8, 4, seed=3)
    for target in ({}, {"model": fresh}, {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters()),
                                           "moments": np.zeros(4), "extra": {}}, stepped(seq(8, 8, 4, seed=4))):
        check_restorable(target, man.tree, man.tensors)


def test_many_differences_show_the_first_few_and_a_count(save_one) -> None:
    man = save_one({f"t{i:02d}": torch.ones(2) for i in range(25)})
    with pytest.raises(StateMismatch, match=r"\(25 differences; nothing was loaded\)") as err:
        check_restorable({f"t{i:02d}": torch.ones(3) for i in range(25)}, man.tree, man.tensors)
    assert "t09: checkpoint has shape (2,), target (3,)" in str(err.value)
    assert "t10:" not in str(err.value) and "... and 15 more" in str(err.value)


def test_check_restorable_treats_a_hostile_tree_as_damage(save_one) -> None:
    man = save_one({"w": torch.ones(2)})
    for tree in ({"w": {"__tensor__": 7}}, {"w": {"__tensor__": -1}}, [1], {"w": {"__ndarray__": "0"}}):
        with pytest.raises(ManifestError):
            check_restorable({"w": torch.zeros(2)}, tree, man.tensors)


def test_load_into_validates_the_whole_state_before_loading_any_of_it() -> None:
    model = seq(8, 4)
    target = {"a": torch.zeros(3), "model": model, "b": np.zeros(2), "z": torch.zeros(2)}
    before = frozen(target)
    saved = {"a": torch.ones(3), "model": {k: v + 1 for k, v in model.state_dict().items()}, "b": np.ones(2),
             "z": torch.ones(5)}  # only the last key differs
    with pytest.raises(StateMismatch, match=r"z: checkpoint has shape \(5,\), target \(2,\)"):
        load_into(target, saved)
    assert_unchanged(target, before)
    saved["z"] = torch.ones(2)
    load_into(target, saved)
    assert_same(as_saved(target), {k: as_saved(v) for k, v in saved.items()})


def test_a_dtensor_is_compared_by_its_local_shard_and_kind() -> None:
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("dtensor_mismatch_child.py"))],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "(2 differences; nothing was loaded)" in out.stdout, out.stdout
    assert "w: checkpoint has shape (8, 4), target (8, 5)" in out.stdout
    assert "p: checkpoint has a tensor (3,) of float32, target a DTensor (3,) of float32" in out.stdout


# -- issue 15.6: a durable shard without checksums is damaged ------------------------------


def unchecksummed(saved: Path) -> bytes:
    doc = json.loads((saved / "rank-00000.json").read_bytes())
    for t in doc["tensors"]:
        t["checksums"] = None
    return dumps(doc)


def test_a_durable_reader_refuses_a_shard_manifest_without_checksums(saved: Path) -> None:
    raw = unchecksummed(saved)
    assert not ShardManifest.from_bytes(raw).has_checksums  # a memory slot may be sealed before its CRCs
    with pytest.raises(ManifestError, match=r"rank-00000\.json: no checksums recorded"):
        ShardManifest.from_bytes(raw, str(saved / "rank-00000.json"), require_checksums=True)
    with_sums = (saved / "rank-00000.json").read_bytes()
    assert ShardManifest.from_bytes(with_sums, require_checksums=True) == ShardManifest.from_bytes(with_sums)


def test_a_disk_shard_stripped_of_its_checksums_is_skipped_as_damaged(saved: Path, disk_only,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    plant_shard_manifest(saved / "rank-00000.json", unchecksummed(saved))
    falls_back_past_newest(disk_only, caplog, "no checksums recorded")


# -- issue 15.8: a rank with nothing to store ---------------------------------------------


@pytest.mark.parametrize("own_part", [{}, {"step": 3, "rng": {"seed": 7}}], ids=["empty", "plain-values-only"])
def test_a_shard_without_tensors_is_a_valid_zero_byte_manifest(own_part: dict) -> None:
    """Under DDP with replicated=("model", "optim") every rank but 0 stores nothing of its own."""
    flat = flatten(own_part)
    entries, data_bytes = plan_layout(flat.tensors)
    assert (flat.tensors, entries, data_bytes) == ([], [], 0)
    man = ShardManifest(1, 5, 0, data_bytes, entries, flat.tree, DEFAULT_CHUNK_BYTES, world_size=2)
    assert man.has_checksums  # nothing to checksum is fully checksummed: durable tiers accept it
    back = ShardManifest.from_bytes(man.to_bytes(), require_checksums=True)
    assert back == man and (back.data_bytes, back.tensors, back.data_file) == (0, [], "rank-00001.bin")
    assert unflatten(back.tree, lambda i: torch.zeros(0)) == own_part
    check_restorable(own_part, back.tree, back.tensors)


def test_a_state_without_tensors_saves_and_restores(root: Path, shm_dir: str, tmp_path: Path) -> None:
    state = {"step": 1, "rng": {"seed": 7}}
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert restored(mgr) == (1, state)  # from the memory slot
    with CheckpointManager(root, memory_dir=str(tmp_path)) as mgr:
        assert restored(mgr) == (1, state)  # from disk
