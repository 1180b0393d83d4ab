"""NVRx's in-process restarts with our tiers as the state source (``ckpt.integrations.nvrx``):
three ranks started as NVRx expects, one SIGKILLed (or SIGSTOPped: hung) mid-training; NVRx restarts the training
function in the two survivors' processes, which restore the newest step from our memory
tier (the dead rank's sealed slot is on this node) and end bitwise equal to a relaunch at
two ranks from that step. Runs in the engines' venv (``make engines``: scripts/engines-venv.sh)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.procs import free_port, stop_process, wait_for

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "nvrx_child.py"
ENGINES_PYTHON = Path(os.environ.get("RECOVERY_ENGINES_PYTHON", REPO / ".venv-engines" / "bin" / "python"))
STEPS, KILL_AT = 12, 6


@pytest.fixture(scope="module")
def engines_python() -> str:
    if not ENGINES_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{ENGINES_PYTHON} is missing: `make test` builds it (make engines)")
        pytest.skip(f"{ENGINES_PYTHON} is missing: run `make engines`")
    return str(ENGINES_PYTHON)


def launch(python: str, workdir: Path, root: Path, world: int, *args: str, faulted: int = -1) -> list[dict]:
    """One job of ``world`` ranks (a process each, as NVRx expects) checkpointing under ``root``;
    the survivors must exit 0 (rank ``faulted``: killed, by itself or NVRx). Returns every rank's events."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, events = free_port(), workdir / "events.jsonl"
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    shm = Path("/dev/shm") / f"nvrx-test-{workdir.name}-{port}"
    procs = [subprocess.Popen([python, str(CHILD), "--root", str(root), "--events", str(events),
                               "--memory-dir", str(shm), *args],
                              env={**env, "RANK": str(r)}, stdout=(workdir / f"rank{r}.log").open("w"),
                              stderr=subprocess.STDOUT) for r in range(world)]

    def failed() -> int | None:  # the first rank that exited as it should not
        return next((r for r, p in enumerate(procs) if p.poll() not in (None, 0) and not (
            r == faulted and p.returncode in (-signal.SIGKILL, -signal.SIGTERM))), None)

    try:
        ended = wait_for(lambda: failed() is not None or all(p.poll() is not None for p in procs), timeout=600,
                         interval=0.1)  # a hang guard only
        r = failed()
        if r is not None:
            pytest.fail(f"rank {r} exited {procs[r].returncode}:\n{(workdir / f'rank{r}.log').read_text()[-3000:]}")
        assert ended, f"the job did not end in 600 s:\n{(workdir / 'rank0.log').read_text()[-3000:]}"
    finally:
        for p in procs:
            stop_process(p)
        shutil.rmtree(shm, ignore_errors=True)
    return [json.loads(line) for line in events.read_text().splitlines() if line.strip()]


def digests(evs: list[dict]) -> set[str]:
    return {e["digest"] for e in evs if e["event"] == "done"}


@pytest.mark.parametrize("fault", ["kill", pytest.param("stop", marks=pytest.mark.extended)])
def test_nvrx_restarts_in_the_survivors_and_restores_from_our_memory_tier(tmp_path: Path, engines_python: str,
                                                                         fault: str) -> None:
    """``stop``: NVRx's monitor kills the hung rank after its hard timeout, and stops the survivors
    by exceptions raised in their main threads wherever they are: each call's manager must still
    let go of its memory slots (their lock held in the survivor's own process failed every later
    call before ``_Managers``)."""
    evs = launch(engines_python, tmp_path / "faulted", tmp_path / "faulted" / "root", 3, "--steps", str(STEPS),
                 "--kill-rank", "1", "--kill-at", str(KILL_AT), "--fault", fault, faulted=1)
    started = {e["rank0"]: e["pid"] for e in evs if e["event"] == "step" and e["iteration"] == 0}
    done = {e["rank0"]: e for e in evs if e["event"] == "done"}
    assert set(done) == {0, 2}, evs[-5:]
    assert all(e["pid"] == started[r] and e["steps"] == STEPS and e["world"] == 2 for r, e in done.items()), done
    recs = [e for e in evs if e["event"] == "recovery"]
    assert {r["rank0"] for r in recs} == {0, 2} and len({r["restored_step"] for r in recs}) == 1, recs
    restored = recs[0]["restored_step"]
    assert KILL_AT - 1 <= restored <= KILL_AT, recs  # the step before the fault at most: a snapshot every step
    # the reference: a clean 3-rank run to the restored step, then a relaunch at 2 ranks from it
    root = tmp_path / "ref-root"
    launch(engines_python, tmp_path / "ref3", root, 3, "--steps", str(restored))
    expected = digests(launch(engines_python, tmp_path / "ref2", root, 2, "--steps", str(STEPS),
                              "--resume-step", str(restored)))
    assert len(expected) == 1 and digests(evs) == expected
