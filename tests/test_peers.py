"""Peer replicas, one process: placement, the authenticated transfer into replica slots
(real sockets on loopback, real shared-memory slots), reading replicas back, and
damage (in transit or in a held replica) detected and never restored."""
from __future__ import annotations

import gc
import os
import socket
import stat
import time
import weakref
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointError, CheckpointManager
from ckpt.peers.placement import node_name, ring_targets
from ckpt.peers.remote import Held, RemoteTier
from ckpt.peers.replicas import ReplicaSlots
from ckpt.peers.replicator import ReplicaJob, Replicator
from ckpt.peers.server import PeerServer
from ckpt.restore.execute import LOCAL, load_plan, open_shard, restore_agreed
from ckpt.restore.plan import Inventory, ShardNeed
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.memory import MemoryTier, namespace_dir, sweep_orphans
from ckpt.tiers.peer import PeerTier

SECRET = b"s" * 32


def test_ring_placement_spreads_and_never_stays_on_the_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert [ring_targets(nodes, r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert ring_targets(nodes, 0, 2) == [2, 4]
    assert ring_targets(nodes, 0, 5) == [2, 4]  # capped at the other nodes
    assert ring_targets(["a", "a"], 1, 1) == []  # one node: nobody to hold a replica
    assert ring_targets(["x", "y", "x", "y"], 2, 1) == [3]  # nodes interleaved by rank
    assert ring_targets(["a", "a", "b"], 1, 1) == [2]  # fewer ranks on the next node: wrap


def test_node_identity_argument_then_environment_then_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_GUARD_NODE", "env-node")
    assert node_name("arg-node") == "arg-node" and node_name() == "env-node"
    monkeypatch.delenv("CKPT_GUARD_NODE")
    assert node_name() == socket.gethostname()


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 700, generator=g), "b": torch.randn(17, generator=g), "step_note": f"s{seed}"}


@pytest.fixture
def saved(tmp_path: Path, shm_dir: str):
    """A one-rank job's sealed, checksummed slot of step 7 (chunks of 64 KiB)."""
    mgr = CheckpointManager(tmp_path / "src", memory_dir=shm_dir, chunk_bytes=64 << 10)
    mgr.save(7, state_of(7)).wait()
    src = MemoryTier(namespace_dir(str((tmp_path / "src").resolve()), "default", shm_dir), 0)
    yield mgr, src
    mgr.close()


@pytest.fixture
def holder(shm_dir: str):
    """A peer server with its replica slots in their own namespace."""
    ns = Path(shm_dir) / "ckpt-guard-holder"
    replicas = ReplicaSlots(ns, {"root": "/nowhere", "run": "t"})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=20)
    server.start(SECRET)
    yield server, PeerTier(ns)
    server.close()
    replicas.close()


def replicate(src: MemoryTier, addr: str, secret: bytes = SECRET, **kw) -> tuple[Replicator, list[bool]]:
    ckpt_id = src.list()[-1].id
    results: list[bool] = []
    rep = Replicator([addr], secret, bytes_per_s=kw.get("bytes_per_s"), timeout_s=kw.get("timeout_s", 20),
                     count=kw.get("count", lambda outcome: None))
    rep.submit(ReplicaJob(ckpt_id.step, lambda: open_shard(src, ckpt_id, 0), results.append))
    rep.join()
    rep.close()
    return rep, results


def test_a_replica_is_sealed_private_and_restores_bitwise(saved, holder) -> None:
    _, src = saved
    server, held = holder
    rep, results = replicate(src, server.addr)
    assert results == [True] and rep.sent == 1 and rep.failed == 0
    [info] = held.list()
    assert info.id.step == 7 and info.ranks == {0} and info.checksummed
    rdir = held.ns / "rank-00000"
    for p in [held.ns, rdir, *rdir.iterdir()]:
        assert not p.is_symlink() and not os.lstat(p).st_mode & 0o077 and os.lstat(p).st_uid == os.getuid(), p
    assert stat.S_IMODE(os.lstat(rdir / "slot-0.bin").st_mode) == 0o600
    found = restore_agreed(LOCAL, Inventory([held]), lambda w: [ShardNeed(0)], lambda plan: load_plan(plan, None))
    assert found is not None
    values = found[1]
    expected = state_of(7)
    assert values["step_note"] == "s7" and all(torch.equal(values[k], expected[k]) for k in ("w", "b"))


def test_a_replica_survives_its_receiver_and_is_swept_only_by_its_own_rank(saved, holder) -> None:
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    server.replicas.close()  # the receiving process is gone: its lock is free, the slots stay
    assert [i.id.step for i in held.list()] == [7]
    assert sweep_orphans([held.ns], {(1, 0, 7)}) == []  # another rank's shard of step 7 on disk: not this one
    assert [i.id.step for i in held.list()] == [7]
    assert sweep_orphans([held.ns], {(0, 0, 7)}) == [str(held.ns / "rank-00000")]


def test_the_newest_sealed_replica_is_never_overwritten(tmp_path: Path, shm_dir: str, holder) -> None:
    server, held = holder
    mgr = CheckpointManager(tmp_path / "src", memory_dir=shm_dir, keep_last=5)
    src = MemoryTier(namespace_dir(str((tmp_path / "src").resolve()), "default", shm_dir), 0)
    try:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step)).wait()
            replicate(src, server.addr)
            assert [i.id.step for i in held.list()] == [max(1, step - 1), step][-min(step, 2):]
    finally:
        mgr.close()


def test_a_wrong_secret_is_refused_and_nothing_is_sealed(saved, holder) -> None:
    _, src = saved
    server, held = holder
    rep, results = replicate(src, server.addr, secret=b"x" * 32)
    assert results == [False] and rep.failed == 1
    assert held.list() == []


def test_a_dead_peer_costs_one_abandoned_send(saved) -> None:
    _, src = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
    t0 = time.monotonic()
    outcomes: list[str] = []
    _, results = replicate(src, dead, timeout_s=120, count=outcomes.append)
    assert results == [False] and outcomes == ["failed"] and time.monotonic() - t0 < 60  # not the timeout


def test_a_slow_peer_is_abandoned_after_the_timeout(saved) -> None:
    _, src = saved
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers the handshake
        rep, results = replicate(src, f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1)
    assert results == [False] and rep.failed == 1


def test_the_bandwidth_cap_paces_the_send(saved, holder) -> None:
    _, src = saved
    server, _ = holder
    nbytes = src.list()[-1].bytes
    t0 = time.monotonic()
    replicate(src, server.addr, bytes_per_s=nbytes / 0.5)
    assert time.monotonic() - t0 >= 0.45


def test_a_damaged_replica_is_detected_and_skipped(saved, holder) -> None:
    """A byte flipped in a held replica: the local peer tier and a remote fetch both find
    the checksum mismatch; restore falls back to the next source or names the shard."""
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    data = held.ns / "rank-00000" / "slot-0.bin"
    with open(data, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    ckpt_id = held.list()[-1].id
    ref = held.read_manifest(ckpt_id).shards[0]
    remote = RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, SECRET, timeout_s=20)
    def needs(world: int) -> list[ShardNeed]:
        return [ShardNeed(0)]

    with pytest.raises(CheckpointError, match=r"shard 0 of step 7"):
        restore_agreed(LOCAL, Inventory([held, remote]), needs, lambda plan: load_plan(plan, None))
    found = restore_agreed(LOCAL, Inventory([held, remote, src]), needs, lambda plan: load_plan(plan, None))
    assert found is not None and torch.equal(found[1]["w"], state_of(7)["w"])
    assert found[0].ckpt_id == CheckpointId(0, 7)


def test_a_fetched_replica_is_not_kept_after_its_read(saved, holder) -> None:
    """A replacement node's restore fetches a whole shard into process memory: once read and
    closed it must be freed, not cached for the rest of the job."""
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    ckpt_id = held.list()[-1].id
    ref = held.read_manifest(ckpt_id).shards[0]
    remote = RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, SECRET, timeout_s=20)
    reader = remote.open_shard(ckpt_id, ref)
    alive = weakref.ref(reader)
    reader.close()
    del reader
    gc.collect()
    assert alive() is None and len(remote.fetched) == 1
