"""Losing a whole node, on one machine: two simulated nodes (one torchrun agent each,
own CKPT_GUARD_NODE, own disk root and memory dir), one rank each with state of its
own, ``peers=1``, no object store. Node 1 is lost mid-run (agent and workers
SIGKILLed by pid, its shared memory and disk deleted) and replaced by a fresh agent
with empty directories: its rank restores its shard from node 0's replica and the
job ends bitwise equal to an uninterrupted run."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from ckpt.tiers.peer import PeerTier, replica_namespace
from tests.integration_helpers import REPLACEABLE, REPO, finish_nodes, kill_node, start_node
from tests.procs import free_port, wait_for

SCRIPT = REPO / "tests" / "peer_child.py"
STEPS, EVERY = 40, 5


@pytest.fixture
def shm():
    dirs = [tempfile.mkdtemp(prefix=f"ckpt-peer-node{i}-", dir="/dev/shm") for i in range(2)]
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def node_args(base: Path, name: str, shm: list[str], i: int, step_time: float) -> list[str]:
    out = base / name
    out.mkdir(exist_ok=True)
    return [str(base / name / f"node{i}"), shm[i], str(out), str(STEPS), str(EVERY), str(step_time)]


def digests(base: Path, name: str) -> list[str]:
    return [json.loads((base / name / f"rank-{r}.json").read_text())["digest"] for r in range(2)]


def test_a_lost_node_restores_from_its_peer_and_ends_bitwise_equal(tmp_path: Path, shm: list[str]) -> None:
    port = free_port()
    clean = [start_node(SCRIPT, i, 2, port, node_args(tmp_path, "clean", shm, i, 0.0), env=REPLACEABLE)
             for i in range(2)]
    for i, log in enumerate(finish_nodes(clean, timeout=240)):
        assert f"rank {i}: step {STEPS} durable in the peer tier" in log, log[-3000:]
    for d in shm:
        shutil.rmtree(d)
        os.mkdir(d, 0o700)

    port = free_port()
    args = [node_args(tmp_path, "lost", shm, i, 0.15) for i in range(2)]
    node0 = start_node(SCRIPT, 0, 2, port, args[0], restarts=2, env=REPLACEABLE)
    node1 = start_node(SCRIPT, 1, 2, port, args[1], restarts=2, env=REPLACEABLE)
    held = PeerTier(replica_namespace(os.path.realpath(args[0][0]), "default", shm[0]))
    assert wait_for(lambda: any(1 in i.ranks and i.id.step >= 15 for i in held.list()), timeout=120), \
        "node 0 never held a replica of rank 1"
    kill_node(node1)
    shutil.rmtree(shm[1])
    os.mkdir(shm[1], 0o700)
    shutil.rmtree(args[1][0])
    node1 = start_node(SCRIPT, 1, 2, port, args[1], restarts=2, env=REPLACEABLE)
    logs = finish_nodes([node0, node1], timeout=240)

    found = re.search(r"rank 1 restored its shard of step (\d+) from rank 0's replica \(node node0\)", logs[1])
    assert found, logs[1][-4000:]
    assert int(found.group(1)) >= 15
    assert re.search(rf"rank 0 restored step {found.group(1)} .*shard 0 from memory", logs[0]), logs[0][-4000:]
    assert digests(tmp_path, "lost") == digests(tmp_path, "clean"), "the job diverged after losing node 1"
