"""A shard manifest's entries checked column by column (``ckpt/format/entry_columns.py``) are
accepted only where the per-entry checks accept them, and read as the same entries: every
damage below is refused by both with the same message."""
from __future__ import annotations

import copy
import json

import pytest

from ckpt import ManifestError
from ckpt.format.checksum import MIN_CHUNK_BYTES
from ckpt.format.entry_columns import entries_ok
from ckpt.format.layout import Layout
from ckpt.format.manifest import ITEMSIZE, ShardManifest, TensorEntry

BAD = [None, -1, True, 1.5, "x", [], {}, [1, 2, 3], ["a"], [[0, 1]], [[-1, 1]], [[0, 0]], 1 << 70]


def _manifest() -> bytes:
    """Four tensors: a Shard(0) DTensor over a mesh of 4 (rank 1), one split in two runs, a
    plain tensor, an empty shard; checksums one per chunk."""
    chunk = MIN_CHUNK_BYTES
    rows = [("a", (8, 4), Layout((32, 4), (4,), ("dp",), ("Shard(0)",), (1,), (((8, 8),), ((0, 4),)))),
            ("b", (6,), Layout((12,), (2, 2), ("dp", "tp"), ("_StridedShard(0,2)", "Replicate()"), (1, 0),
                                (((3, 3), (9, 3)),), 0)),
            ("c", (chunk, 3), None), ("d", (0, 4), Layout((3, 4), (4,), ("dp",), ("Shard(0)",), (1,), ((), ((0, 4),))))]
    tensors, offset = [], 0
    for i, (name, shape, layout) in enumerate(rows):
        nbytes = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        sums = [7] * max(1, -(-nbytes // chunk))
        tensors.append(TensorEntry(i, name, "float32", shape, offset, nbytes, tuple(sums), layout))
        offset += nbytes
    return ShardManifest(1, 3, 0, offset, tensors, {}, chunk, 4).to_bytes()


def _both(doc: dict) -> tuple[object, object]:
    """(what the per-entry checks give, what ``from_bytes`` gives): entries or the error's text."""
    raw = doc["tensors"]
    try:
        one = [TensorEntry.from_json(t, doc["data_bytes"], doc["chunk_bytes"]) for t in raw]
        if sorted(t.id for t in one) != list(range(len(one))):
            raise ManifestError("ids")
        slow: object = sorted(one, key=lambda t: t.id)
    except (ManifestError, TypeError) as e:
        slow = ("refused", type(e))
    try:
        fast: object = ShardManifest.from_bytes(json.dumps(doc).encode()).tensors
    except (ManifestError, TypeError) as e:
        fast = ("refused", type(e))
    return slow, fast


def _damaged() -> list[tuple[str, dict]]:
    base = json.loads(_manifest())
    out = []
    for i in range(len(base["tensors"])):
        entry = base["tensors"][i]
        fields = [(k, None) for k in entry] + [(k, "layout") for k in entry.get("layout") or {}]
        for key, inside in fields:
            for bad in BAD:
                doc = copy.deepcopy(base)
                (doc["tensors"][i]["layout"] if inside else doc["tensors"][i])[key] = bad
                out.append((f"tensor {i} {inside or ''} {key}={bad!r}", doc))
            doc = copy.deepcopy(base)
            del (doc["tensors"][i]["layout"] if inside else doc["tensors"][i])[key]
            out.append((f"tensor {i} {inside or ''} without {key}", doc))
    return out


def test_a_sound_manifest_reads_as_the_same_entries_both_ways() -> None:
    doc = json.loads(_manifest())
    assert entries_ok(doc["tensors"], doc["data_bytes"], doc["chunk_bytes"], ITEMSIZE)
    slow, fast = _both(doc)
    assert slow == fast and len(fast) == 4


@pytest.mark.parametrize("what,doc", _damaged(), ids=[w for w, _ in _damaged()])
def test_a_damaged_entry_is_judged_as_the_per_entry_checks_judge_it(what: str, doc: dict) -> None:
    slow, fast = _both(doc)
    if isinstance(slow, tuple):  # refused: the column checks must not let it through
        assert not entries_ok(doc["tensors"], doc["data_bytes"], doc["chunk_bytes"], ITEMSIZE), what
    assert slow == fast, what


def test_the_same_message_names_the_entry_at_fault() -> None:
    doc = json.loads(_manifest())
    doc["tensors"][2]["nbytes"] += 4
    with pytest.raises(ManifestError, match="tensor 'c': .* does not match shape"):
        ShardManifest.from_bytes(json.dumps(doc).encode())
