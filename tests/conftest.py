"""The fixtures every test module may ask for by name; the helpers they use live in the
``*_helpers``/``*_fixtures`` modules beside this file."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ckpt import CheckpointManager
from ckpt.tiers.memory.namespace import DEFAULT_SHM_DIR
from ckpt.tiers.memory.owners import left_behind
from tests.agents_fixtures import Receiver
from tests.ckpt_helpers import SAVED_NEWEST, CrashServer, ckpt_dir, step_state
from tests.objstore_fixtures import create_bucket, moto_server
from tests.predictor_fixtures import LiveServer, run_cli, simulate
from tests.session_cache import CleanRuns, built_once


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``extended`` (another variant of a scenario the default suite already runs
    end to end) run only when asked: ``-m extended`` (``make test-extended``) or
    CKPT_TESTS=all; the default suite stays well inside its time (skipped, with the reason)."""
    if "extended" in (config.getoption("markexpr") or "") or os.environ.get("CKPT_TESTS") == "all":
        return
    skip = pytest.mark.skip(reason="extended: another variant of a scenario the suite runs; -m extended runs it")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def leaves_no_shared_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves checkpoint shared memory behind in /dev/shm (issue 54): a finished
    job frees its slots; a test that keeps some (a crash, keep_memory) removes them itself."""
    before = left_behind(DEFAULT_SHM_DIR, pid=os.getpid())  # its tmp_path is new: nothing under it yet
    yield
    # this test's: made by this process (an xdist worker), or naming a root under its tmp_path (its
    # child processes'); a neighbour's (another worker, another checkout's tests) names neither
    tmp = getattr(request.node, "funcargs", {}).get("tmp_path")
    left = sorted(p for p in left_behind(DEFAULT_SHM_DIR, under=tmp, pid=os.getpid()) - before if p.exists())
    if left:
        for ns in left:
            shutil.rmtree(ns, ignore_errors=True)
        pytest.fail(f"the test left {len(left)} checkpoint namespace(s) in {DEFAULT_SHM_DIR}: "
                    f"{', '.join(map(str, left))} (removed now)")


@pytest.fixture(scope="session")
def clean_runs(tmp_path_factory: pytest.TempPathFactory) -> CleanRuns:
    """Clean reference runs, each command run once a session (tests/session_cache.py)."""
    return CleanRuns(tmp_path_factory)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private memory_dir under /dev/shm, so no test touches another run's slots."""
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="ckpt-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The local-disk tier root of the run under test."""
    return tmp_path / "ckpt"


@pytest.fixture(scope="module")
def crash_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrashServer]:
    """One zygote per test module (its start-up is one torch import)."""
    server = CrashServer(tmp_path_factory.mktemp("crash"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_server():
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket; returns its name."""
    return create_bucket(s3_server)


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory) -> Path:
    """10 nodes x 1.5 days at 60 s with failures enriched 6x (about 30 failures)."""
    return built_once(tmp_path_factory, "trace", lambda d: simulate(d / "small", 10, 1.5, 60, 5, "--failure-rate",
                                                                    "0.3")) / "small"


@pytest.fixture(scope="session")
def training_trace(tmp_path_factory) -> Path:
    """8 nodes x half a day at 60 s with failures enriched 10x: few rows, yet failures with
    visible precursors on both the training and the validation nodes."""
    return built_once(tmp_path_factory, "training-trace", lambda d: simulate(d / "train", 8, 0.5, 60, 5,
                                                                             "--failure-rate", "0.5")) / "train"


@pytest.fixture(scope="session")
def trained_model(training_trace, tmp_path_factory) -> Path:
    """`predictor train` end to end on its own small trace (seconds of CPU), so the tests that
    score ``small_trace`` with it score nodes and days it never saw."""
    def train(out: Path) -> None:
        run_cli("predictor.cli", "train", "--trace", str(training_trace), "--out", str(out / "small.skops"), "--json")

    return built_once(tmp_path_factory, "model", train) / "small.skops"


@pytest.fixture
def live_server(tmp_path):
    """Factory: start `predictor serve ARGS`; every server started is stopped afterwards."""
    servers = []

    def start(*args: str) -> LiveServer:
        servers.append(LiveServer(tmp_path, *args))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One `predictor serve --max-body 20000` for a module's tests (each uses its own node names)."""
    srv = LiveServer(tmp_path_factory.mktemp("serve"), "--max-body", "20000")
    yield srv
    srv.stop()


@pytest.fixture
def receiver():
    rx = Receiver()
    yield rx
    rx.stop()


@pytest.fixture
def saved(root: Path, shm_dir: str) -> Path:
    """Steps 1..3 durable on disk (and in the memory slots: 2 and 3, kept as after a crash); the
    newest's directory."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5, keep_memory=True) as mgr:
        for step in range(1, SAVED_NEWEST + 1):
            mgr.save(step, step_state(step))
        mgr.wait()
    return ckpt_dir(root, SAVED_NEWEST)


@pytest.fixture
def disk_only(root: Path, tmp_path: Path) -> Callable[[], CheckpointManager]:
    """A manager that sees the disk tier only (its memory_dir holds no slots)."""
    empty = tmp_path / "no-slots"
    empty.mkdir()
    return lambda: CheckpointManager(root, memory_dir=str(empty))
