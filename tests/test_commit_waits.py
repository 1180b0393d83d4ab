"""The commit's waits block in the store, one key a rank (``ckpt/save/commit.py``): ``abandon()``
ends one at once, and the verdict every rank reads carries no canary references: each volume's
commit record keeps its own ranks'. A real TCPStore on 127.0.0.1, real disk tiers, a thread a rank."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckpt.errors import Abandoned
from ckpt.format.manifest import ShardRef
from ckpt.save.commit import Committer
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.local import LocalDiskTier

STEP = CheckpointId(0, 7)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield server
    del server


def committer(server, rank: int, world: int, tier: LocalDiskTier, volumes: list[str]) -> Committer:
    """A rank's committer, each calling thread with a client of its own (as ``store_connector``
    gives: a blocking wait holds its connection)."""
    local = threading.local()

    def mine() -> dist.Store:
        if not hasattr(local, "store"):
            local.store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
        return local.store

    c = Committer(rank, world, store=mine, keep_last={}, default_keep=3, timeout_s=600, key=b"k" * 32)
    c.register(tier, volumes)
    return c


def disk(path: Path) -> LocalDiskTier:
    path.mkdir()
    return LocalDiskTier(path)


def test_abandon_ends_a_blocking_wait_at_once(store, tmp_path: Path) -> None:
    """Rank 0 never commits: rank 1 waits in the store for its commit key (600 s) until abandoned."""
    tier = disk(tmp_path / "d")
    follower = committer(store, 1, 2, tier, ["one", "one"])
    got: list[BaseException] = []

    def run() -> None:
        try:
            follower.commit(tier, STEP, ShardRef(1, 101, 1001))
        except BaseException as e:  # noqa: BLE001 - looked at below
            got.append(e)

    t = threading.Thread(target=run)
    t.start()
    while not follower._waits:  # in its blocking wait
        time.sleep(0.01)
    follower.abandon()
    t.join(60)  # a hang guard, not a timing
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Abandoned), got


def test_each_volume_keeps_its_own_ranks_canary_references_and_no_rank_reads_them(store, tmp_path: Path) -> None:
    tiers = {"a": disk(tmp_path / "a"), "b": disk(tmp_path / "b")}
    volumes = ["a", "a", "b", "b"]  # two nodes' local disks: ranks 0 and 2 lead
    ranks = [committer(store, r, 4, tiers[volumes[r]], volumes) for r in range(4)]
    health: dict[int, dict] = {}

    def run(r: int) -> None:
        report = {"node": volumes[r], "gpu": "cpu", "canary": {"after": 6, "loss": 1.0 + r}}
        health[r] = ranks[r].commit(tiers[volumes[r]], STEP, ShardRef(r, 100 + r, 1000 + r), report)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a hang guard
    assert len(health) == 4 and all(h == health[0] and "canary" not in h for h in health.values()), health
    for name, mine in (("a", ["0", "1"]), ("b", ["2", "3"])):
        record = tiers[name].read_manifest(STEP).health
        assert sorted(record["canary"]["by_rank"]) == mine and record["state"] == health[0]["state"]
    # what ``canary.reference`` reads for rank 3 after a restore of step 6: its own node's record
    assert tiers["b"].read_manifest(STEP).health["canary"] == {"after": 6, "by_rank": {
        "2": {"after": 6, "loss": 3.0}, "3": {"after": 6, "loss": 4.0}}}
