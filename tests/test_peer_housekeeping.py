"""Peer replicas as an operator sees them, one process: ``ckpt ls`` on the holder's node
(a PEER column, never a "memory" copy), ``ckpt gc`` of a gone job's replicas, the
start-up refusal when /dev/shm cannot hold the node's slots, and placement that
avoids nodes at risk."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from ckpt import CheckpointError, CheckpointManager
from ckpt.cli import cli
from ckpt.peers.peering import _shm_gauge
from ckpt.peers.placement import ring_targets
from ckpt.peers.replicas import ReplicaSlots
from ckpt.peers.server import PeerServer
from ckpt.tiers.memory import MemoryTier, namespace_dir
from ckpt.tiers.peer import PeerTier, replica_namespace
from tests.test_peers import SECRET, replicate, state_of


def held_replica(tmp_path: Path, shm_dir: str, *, object_store: bool) -> tuple[Path, Path]:
    """A one-rank job (disk, and an object store when asked) saves step 7; another node,
    whose root is ``holder``, holds its replica and has since exited. Returns (holder
    root, the replica's rank directory)."""
    store = f"file://{tmp_path}/objstore" if object_store else None
    with CheckpointManager(tmp_path / "src", memory_dir=shm_dir, object_store=store, chunk_bytes=64 << 10,
                           keep_memory=True) as mgr:
        mgr.save(7, state_of(7))
        mgr.wait()
    src = MemoryTier(namespace_dir(os.path.realpath(tmp_path / "src"), "default", shm_dir), 0)
    holder = tmp_path / "holder"
    holder.mkdir()
    ns = replica_namespace(os.path.realpath(holder), "default", shm_dir)
    replicas = ReplicaSlots(ns, {"root": os.path.realpath(holder), "run": "default", "object": store})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=20)
    server.start(SECRET)
    try:
        _, results = replicate(src, server.addr)
        assert results == [True]
    finally:
        server.close()
        replicas.close()  # the holder's process is gone: its lock is free
    return holder, ns / "rank-00000"


def ckpt(*args: str | Path) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_ls_on_the_holder_shows_a_peer_column_not_a_memory_copy(tmp_path: Path, shm_dir: str) -> None:
    holder, rdir = held_replica(tmp_path, shm_dir, object_store=False)
    registry = CollectorRegistry()
    _shm_gauge(registry, 0, rdir.parent)
    slots = sum(p.stat().st_size for p in rdir.glob("slot-*.bin"))
    assert registry.get_sample_value("ckpt_peer_replica_shm_bytes", {"rank": "0"}) == slots > 0
    [row] = json.loads(ckpt("ls", holder, "--memory-dir", shm_dir, "--json"))
    assert (row["step"], row["tiers"], row["peer"], row["status"]) == (7, ["peer"], [0], "replica")
    assert row["peer_bytes"] > 0
    text = ckpt("ls", holder, "--memory-dir", shm_dir)
    assert "PEER" in text and "rank 0" in text and "in peer replica slots" in text


@pytest.mark.parametrize("object_store", [True, False], ids=["step-in-object-store", "no-object-store"])
def test_gc_drops_a_gone_jobs_replica_once_its_step_is_in_the_jobs_object_store(tmp_path: Path, shm_dir: str,
                                                                                 object_store: bool) -> None:
    holder, rdir = held_replica(tmp_path, shm_dir, object_store=object_store)
    out = json.loads(ckpt("gc", holder, "--memory-dir", shm_dir, "--json"))
    assert (str(rdir) in out["leftovers_removed"]) is object_store
    assert rdir.exists() is not object_store  # never this node's disk: without the store it stays (--force)


def test_gc_orphans_drops_a_replica_durable_in_the_object_store(tmp_path: Path, shm_dir: str) -> None:
    _, rdir = held_replica(tmp_path, shm_dir, object_store=True)
    out = json.loads(ckpt("gc", "--orphans", "--memory-dir", shm_dir, "--json"))
    assert str(rdir.parent) in [o["namespace"] for o in out["removed"]], out
    assert not rdir.exists()


def test_a_memory_dir_too_small_for_the_nodes_slots_is_refused_at_start_up(tmp_path: Path, shm_dir: str) -> None:
    huge = {"w": torch.zeros(1).expand(1 << 40)}  # 4 TiB to checkpoint, allocated nowhere
    with pytest.raises(CheckpointError, match=r"cannot hold this node's checkpoints.*\(own slots \+ 3 x peers\).*"
                                              r"1 rank\(s\) x \(2 own slots \+ 3 x 0 replica\(s\) held\) x 4096\.00 "
                                              r"GiB shard = 8192\.00 GiB; [\d.]+ GiB free"):
        CheckpointManager(tmp_path / "root", memory_dir=shm_dir, state=huge)
    assert not list(Path(shm_dir).rglob("slot-*.bin")), "nothing may be allocated"
    CheckpointManager(tmp_path / "root", memory_dir=shm_dir, state=state_of(1)).close()  # the pool was released


def test_placement_passes_over_nodes_at_risk_while_healthy_ones_are_left() -> None:
    nodes = ["a", "b", "c", "d"]
    assert ring_targets(nodes, 0, 1, frozenset({"b"})) == [2]
    assert ring_targets(nodes, 0, 2, frozenset({"b"})) == [2, 3]
    assert ring_targets(nodes, 3, 1, frozenset({"a", "b"})) == [2]
    assert ring_targets(nodes, 0, 3, frozenset({"b"})) == [1, 2, 3]  # too few healthy ones: ring order, b too
    assert ring_targets(["a", "b"], 0, 1, frozenset({"b"})) == [1]  # the only other node: better than none
    assert ring_targets(["a", "a", "b", "b", "c", "c"], 1, 1, frozenset({"b"})) == [5]  # same local index
