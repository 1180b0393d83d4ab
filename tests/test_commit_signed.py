"""The commit protocol's announcements and verdicts on the job's store (``ckpt/save/commit.py``)
are signed when the job has a secret (issue 48): an outsider on the store who forges a rank's
shard announcement or the leader's verdict changes nothing; the forged value is ignored and
counted. Without a secret they are plain, as before. A real TCPStore on 127.0.0.1, a real disk
tier, one thread per rank; the short commit timeouts only end the waits that must not succeed."""
from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckpt.control import Control
from ckpt.errors import CheckpointError
from ckpt.format.manifest import ShardRef
from ckpt.save.commit import Committer
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.local import LocalDiskTier

KEY, OTHER = b"k" * 32, b"o" * 32  # the job's commit key; one an outsider made up
STEP = CheckpointId(0, 7)
PREFIX = "disk/0.7"


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield server
    del server


def client(server) -> dist.Store:
    return dist.PrefixStore("ckpt-guard/run", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                            timeout=timedelta(seconds=60)))


def disk(tmp_path: Path) -> LocalDiskTier:
    (tmp_path / "disk").mkdir()
    return LocalDiskTier(tmp_path / "disk")


def committer(server, rank: int, tier: LocalDiskTier, key: bytes | None, timeout_s: float = 60) -> Committer:
    mine = client(server)  # each committer is used by one thread
    c = Committer(rank, 2, store=lambda: mine, keep_last={}, default_keep=3, timeout_s=timeout_s, key=key)
    c.register(tier, ["one", "one"])  # one volume: rank 0 commits for both
    return c


def forge(server, name: str, value: object, key: bytes | None = OTHER) -> None:
    """What an outsider writes: well-formed, signed under a key that is not the job's (or plain)."""
    raw = client(server)
    if key is None:
        raw.set(f"{PREFIX}/{name}", json.dumps(value))
    else:
        Control(raw, key, 0).put(f"{PREFIX}/{name}", json.dumps(value))


FORGED_SHARD = [1, 12345, 666, None]
FORGED_VERDICT = {"state": "verified", "reason": "forged", "culprits": []}


def test_both_ranks_commit_what_they_announced_whatever_was_forged_before(store, tmp_path: Path) -> None:
    tier = disk(tmp_path)
    forge(store, "shard/1", FORGED_SHARD)
    forge(store, "commit/1", FORGED_VERDICT)  # the key rank 1 waits on for its leader's verdict
    ranks = [committer(store, r, tier, KEY) for r in (0, 1)]
    health: dict[int, object] = {}

    def run(r: int) -> None:
        health[r] = ranks[r].commit(tier, STEP, ShardRef(r, 100 + r, 1000 + r))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a hang guard
    assert health[0] == health[1] and health[0].get("reason") != "forged", health
    assert tier.read_manifest(STEP).shards == [ShardRef(0, 100, 1000), ShardRef(1, 101, 1001)]


def test_a_forged_announcement_is_ignored_and_counted(store, tmp_path: Path) -> None:
    """Rank 1 never announces; only a forgery stands in its place: the leader does not commit
    on it (it times out, saying why), and counts it once, however often it polled."""
    tier = disk(tmp_path)
    forge(store, "shard/1", FORGED_SHARD)
    leader = committer(store, 0, tier, KEY, timeout_s=3)
    with pytest.raises(CheckpointError, match="1 values failed their check: does every rank hold the same job secret"):
        leader.commit(tier, STEP, ShardRef(0, 100, 1000))
    assert leader.rejected == 1 and not [i for i in tier.list() if i.id == STEP]


def test_a_forged_verdict_is_ignored_and_counted(store, tmp_path: Path) -> None:
    tier = disk(tmp_path)
    forge(store, "commit/1", FORGED_VERDICT)  # the key rank 1 waits on for its leader's verdict
    follower = committer(store, 1, tier, KEY, timeout_s=3)
    with pytest.raises(CheckpointError, match="timed out after 3 s waiting for rank 0 to commit"):
        follower.commit(tier, STEP, ShardRef(1, 101, 1001))
    assert follower.rejected == 1


def test_without_a_secret_the_values_are_plain_as_before(store, tmp_path: Path) -> None:
    """No job secret: nothing is signed, so a plain forged announcement is taken (what a
    secret closes)."""
    tier = disk(tmp_path)
    forge(store, "shard/1", FORGED_SHARD, key=None)
    leader = committer(store, 0, tier, None, timeout_s=3)  # rank 1 never counts itself: the leader's last look
    leader.commit(tier, STEP, ShardRef(0, 100, 1000))
    assert tier.read_manifest(STEP).shards[1] == ShardRef(1, 12345, 666) and leader.rejected == 0
