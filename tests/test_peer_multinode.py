"""Losing a whole node, on one machine: two simulated nodes (one torchrun agent each,
own CKPT_GUARD_NODE, own disk root and memory dir), one or two ranks each with state
of its own, ``peers=1``, no object store. Node 1 is lost mid-run (agent and workers
SIGKILLed by pid, its shared memory and disk deleted) and replaced by a fresh agent
with empty directories: its rank restores its shard from node 0's replica and the
job ends bitwise equal to an uninterrupted run. With node 0's replicas lost too, the
job stops with an error naming the shard nobody holds instead of starting over."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import pytest

from ckpt.tiers.peer import PeerTier, replica_namespace
from tests.integration_helpers import REPLACEABLE, REPO, finish_nodes, kill_node, start_node, torchrun_nodes
from tests.procs import free_port, wait_for
from tests.session_cache import CleanRuns

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


def digests(base: Path, name: str, world: int) -> list[str]:
    return [json.loads((base / name / f"rank-{r}.json").read_text())["digest"] for r in range(world)]


def lose_node1(base: Path, shm: list[str], *, restarts: int, replacement_restarts: int, nproc: int = 1,
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Callable[[], subprocess.Popen], PeerTier]:
    """Run the job, wait until node 0 holds a replica of node 1's ranks' step >= 15, lose node 1
    (every process by pid, then its memory and disk). Returns node 0's agent, a function
    that starts node 1's replacement, and node 0's replicas. Node 1 and its replacement sort
    after node 0 by address, so they keep node 1's ranks (by pid, the replacement could take
    rank 0: tests/test_hot_spare.py covers that)."""
    port = free_port()
    args = [node_args(base, "lost", shm, i, 0.15) for i in range(2)]
    env = {**REPLACEABLE, **(env or {})}
    node0 = start_node(SCRIPT, 0, 2, port, args[0], nproc=nproc, restarts=restarts, env=env, local_addr="127.0.0.1")
    node1 = start_node(SCRIPT, 1, 2, port, args[1], nproc=nproc, restarts=restarts, env=env, local_addr="127.0.0.2")
    held = PeerTier(replica_namespace(os.path.realpath(args[0][0]), "default", shm[0]))
    lost = set(range(nproc, 2 * nproc))
    assert wait_for(lambda: any(lost <= i.ranks and i.id.step >= 15 for i in held.list()), timeout=120), \
        "node 0 never held replicas of node 1's ranks"
    kill_node(node1)
    shutil.rmtree(shm[1])
    os.mkdir(shm[1], 0o700)
    shutil.rmtree(args[1][0])
    return node0, lambda: start_node(SCRIPT, 1, 2, port, args[1], nproc=nproc, restarts=replacement_restarts,
                                     env=env, local_addr="127.0.0.2"), held


def clean_digests(clean_runs: CleanRuns, nproc: int) -> list[str]:
    """Each rank's digest at the end of the uninterrupted run the interrupted ones must match
    (run once a session, in memory dirs of its own)."""
    def run(workdir: Path) -> list[str]:
        with tempfile.TemporaryDirectory(prefix="ckpt-peer-clean0-", dir="/dev/shm") as shm0, \
                tempfile.TemporaryDirectory(prefix="ckpt-peer-clean1-", dir="/dev/shm") as shm1:
            port = free_port()
            nodes = [start_node(SCRIPT, i, 2, port, node_args(workdir, "clean", [shm0, shm1], i, 0.0), nproc=nproc,
                                env=REPLACEABLE) for i in range(2)]
            for i, log in enumerate(finish_nodes(nodes, timeout=240)):
                for r in range(i * nproc, (i + 1) * nproc):
                    assert f"rank {r}: step {STEPS} durable in the peer tier" in log, log[-3000:]
        return digests(workdir, "clean", 2 * nproc)
    return clean_runs.digests(["peer_child", str(nproc), str(STEPS), str(EVERY)], run)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.extended)], ids=["2x1", "2x2"])
def test_a_lost_node_restores_from_its_peer_and_ends_bitwise_equal(tmp_path: Path, shm: list[str],
                                                                   nproc: int, clean_runs: CleanRuns) -> None:
    node0, replace, _ = lose_node1(tmp_path, shm, restarts=2, replacement_restarts=2, nproc=nproc)
    logs = finish_nodes([node0, replace()], timeout=300)

    for local in range(nproc):  # the same local rank on the next node holds the replica
        r = nproc + local
        found = re.search(rf"rank {r} restored its shard of step (\d+) from rank {local}'s replica \(node node0\)",
                          logs[1])
        assert found and int(found.group(1)) >= 15, logs[1][-4000:]
        assert re.search(rf"rank {local} restored step {found.group(1)} .*shard {local} from memory", logs[0]), \
            logs[0][-4000:]
        # re-replicated at once: the restored step itself, not the next save
        assert re.search(rf"rank {r} has a peer replica again \(step {found.group(1)}\): unprotected for", logs[1]), \
            logs[1][-4000:]
    assert digests(tmp_path, "lost", 2 * nproc) == clean_digests(clean_runs, nproc), \
        "the job diverged after losing node 1"


def test_with_both_holders_of_a_shard_lost_it_comes_from_the_object_store_bitwise(
        tmp_path: Path, shm: list[str], clean_runs: CleanRuns) -> None:
    """Node 1 lost and node 0's replicas of it gone too, with an object store: rank 1's
    shard comes from the store (older than the replica was), is re-replicated at once,
    and the job still ends bitwise equal."""
    store = {"PEER_CHILD_OBJECT_STORE": f"file://{tmp_path}/objstore"}
    node0, replace, held = lose_node1(tmp_path, shm, restarts=2, replacement_restarts=2, env=store)
    shutil.rmtree(held.ns)
    logs = finish_nodes([node0, replace()], timeout=300)
    found = re.search(r"rank 1 restored its shard of step (\d+) from the object store", logs[1])
    assert found, logs[1][-4000:]
    assert re.search(rf"rank 1 has a peer replica again \(step {found.group(1)}\)", logs[1]), logs[1][-4000:]
    assert digests(tmp_path, "lost", 2) == clean_digests(clean_runs, 1), "the job diverged after losing node 1"


def test_with_every_copy_of_a_shard_lost_the_job_stops_naming_it(tmp_path: Path, shm: list[str]) -> None:
    node0, replace, held = lose_node1(tmp_path, shm, restarts=1, replacement_restarts=0)
    shutil.rmtree(held.ns)  # node 0's replicas of rank 1 are gone too (no object store)
    node1 = replace()
    outs = [p.communicate(timeout=240)[0] for p in (node0, node1)]
    assert node0.returncode != 0 and node1.returncode != 0
    for log in outs:
        assert "no copy of the shard(s) of rank(s) 1 is left" in log, log[-4000:]
    assert not (tmp_path / "lost" / "rank-0.json").exists(), "a rank started over"


def test_an_urgent_save_is_evacuated_to_the_peer_ahead_of_a_periodic_one(tmp_path: Path, shm: list[str]) -> None:
    """An alarm's urgent save (step 6) comes while the periodic replica of step 5 is still
    being sent under a 0.5 MB/s cap (3.6 MB a rank): that send is cut off, step 6 goes
    first and uncapped, and its handle reports the peer tier beside the disk."""
    args = [[*node_args(tmp_path, "evac", shm, i, 0.02)[:3], "10", "5", "0.02", "6", str(1 << 19), "4096"]
            for i in range(2)]
    logs = torchrun_nodes(SCRIPT, args, nproc=1, timeout=240)
    for i, log in enumerate(logs):
        durable = re.search(rf"rank {i}: urgent step 6 durable (\{{.*\}})", log)
        assert durable and {"disk", "peer"} <= set(json.loads(durable.group(1))), log[-3000:]
        assert "replica of step 5 cut off for the urgent step 6" in log, log[-3000:]
        held = PeerTier(replica_namespace(os.path.realpath(args[i][0]), "default", shm[i]))
        assert [info.id.step for info in held.list()] == [6, 10], "step 5 was sealed: the urgent save waited"


def test_replicas_move_off_a_node_reported_at_risk(tmp_path: Path, shm: list[str]) -> None:
    """Three nodes, a ring 0 -> 1 -> 2 -> 0; from step 12 node1 is at risk: node0's and
    node1's replicas go to node2, none to node1 any more."""
    extra = tempfile.mkdtemp(prefix="ckpt-peer-node2-", dir="/dev/shm")
    try:
        shm3 = [*shm, extra]
        args = [[*node_args(tmp_path, "risk", shm3, i, 0.0)[:3], "20", "5", "0.0"] for i in range(3)]
        env = {"PEER_CHILD_AT_RISK": "node1@12"}
        port = free_port()
        logs = finish_nodes([start_node(SCRIPT, i, 3, port, args[i], env=env) for i in range(3)], timeout=300)
        assert "rank 0 replicates to rank 2 (node node2) (avoiding at-risk node(s) node1)" in logs[0], logs[0][-3000:]

        def held(i: int) -> dict[int, list[int]]:
            tier = PeerTier(replica_namespace(os.path.realpath(args[i][0]), "default", shm3[i]))
            return {r: [info.id.step for info in tier.list() if r in info.ranks] for r in range(3)}

        assert held(2)[0] == [15, 20] and held(2)[1] == [15, 20] and held(2)[2] == []
        # step 10's send may still be in flight when step 12 moves placement (it is then cut off)
        assert held(1)[0] in ([5, 10], [5]), "node1 kept getting replicas while at risk"
    finally:
        shutil.rmtree(extra, ignore_errors=True)


def test_no_rank_stops_serving_while_a_last_replica_is_on_its_way(tmp_path: Path, shm: list[str]) -> None:
    """Node 0 replicates under a 0.5 MB/s cap (about 1 s for its 0.5 MB), node 1 uncapped: node 1
    is done first and must keep serving until node 0's last replica (step 10) has arrived.
    Closing at once cut that send off (seen in CI: rank 0 had no peer copy of its last step)."""
    args = [[*node_args(tmp_path, "last", shm, i, 0.0)[:3], "10", "5", "0.0", "0", str(1 << 19 if i == 0 else 0), "512"]
            for i in range(2)]
    logs = torchrun_nodes(SCRIPT, args, nproc=1, timeout=240)
    for i, log in enumerate(logs):
        assert f"rank {i}: step 10 durable in the peer tier" in log, log[-3000:]
        held = PeerTier(replica_namespace(os.path.realpath(args[1 - i][0]), "default", shm[1 - i]))
        assert 10 in [info.id.step for info in held.list()], f"node {1 - i} holds no replica of rank {i}'s step 10"
