"""Simulated nodes on one machine: two torchrun agents (c10d rendezvous on loopback), each
node with its own disk root and its own shared memory, as with local NVMe on real nodes.
Each node commits the shards it holds, agreed through the rendezvous store; nobody
reads another node's disk (before, every disk commit waited 600 s for shards that
were never going to appear in rank 0's root)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from ckpt.tiers.local import LocalDiskTier
from tests.integration_helpers import REPO, torchrun_nodes

STEPS, EVERY = 20, 5
SCRIPT = REPO / "examples" / "train_torchrun.py"


@pytest.fixture(scope="module")
def node_shm():
    dirs = [tempfile.mkdtemp(prefix=f"ckpt-node{i}-", dir="/dev/shm") for i in range(2)]
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def run_nodes(base: Path, name: str, shm: list[str], *extra: str, restarts: int = 0) -> list[str]:
    args = [["--root", str(base / name / f"node{i}"), "--memory-dir", shm[i], "--steps", str(STEPS),
             "--every", str(EVERY), "--out", str(base / f"{name}.json"), *extra] for i in range(2)]
    return torchrun_nodes(SCRIPT, args, restarts=restarts)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, node_shm: list[str]) -> Path:
    """The uninterrupted run ("clean"), once for both tests: a 2-node launch is the slow part."""
    base = tmp_path_factory.mktemp("multinode")
    run_nodes(base, "clean", node_shm)
    return base


def test_each_node_commits_its_own_shards(base: Path) -> None:
    for node in (0, 1):
        disk = LocalDiskTier(base / "clean" / f"node{node}")
        steps = [i.id.step for i in disk.list() if i.complete]
        assert steps == [15, 20], f"node{node}: {steps}"  # keep_last=2 of the commits at 5, 10, 15, 20
        manifest = disk.read_manifest(disk.list()[-1].id)
        assert manifest.world_size == 2 and [s.rank for s in manifest.shards] == [node]


def test_a_killed_rank_resumes_exactly_from_its_own_nodes_memory(base: Path, node_shm: list[str]) -> None:
    logs = run_nodes(base, "faulty", node_shm, "--faults", "13", restarts=2)
    assert "fault injector: SIGKILL rank 1 at step 13" in logs[1], logs[1][-3000:]
    for node, log in enumerate(logs):
        assert f"rank {node} restored step 10" in log, log[-3000:]
    clean, faulty = (json.loads((base / f"{n}.json").read_text())["digest"] for n in ("clean", "faulty"))
    assert faulty == clean, "the resumed run diverged from the uninterrupted one"
