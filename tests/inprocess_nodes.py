"""Two simulated nodes under ``python -m ckpt.inprocess.launch --nodes 2`` on loopback, and the
loss of node 1 (for tests/test_inprocess_nodes.py and benchmarks/recovery_inprocess.py).

Each node launcher has its own ``CKPT_GUARD_NODE``, memory dir and disk root; the workers are
tests/inprocess_child.py. Node 1 is lost the way a host is, its memory dir and disk root
removed: its launcher SIGKILLed (its workers die with it, ``PR_SET_PDEATHSIG``; the lifeline
closes), or, ``silent``, its launcher and workers SIGSTOPped (a host that vanished: its
sockets stay open, its beats stop), SIGKILLed once node 0 is done.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ckpt.control import Control, control_key
from ckpt.inprocess import membership
from ckpt.secret import SECRET_ENV
from tests.procs import free_port, running, stop_process, wait_for

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "inprocess_child.py"
# every node launcher of a job is handed the same secret (never on argv)
ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), SECRET_ENV: os.urandom(32).hex()}


@dataclass
class LostNode:
    events: list[dict]  # every worker's, both nodes
    fault_t: float  # wall clock of node 1's loss
    log: str  # node 0's launcher and workers
    node1_workers_gone: bool  # no worker of node 1 outlived its launcher


def job_store(port: int, timeout_s: float = 120.0) -> Control:
    """The job's store at ``port`` as its launchers see it (signed values, attempt 0)."""
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return membership.of_attempt(base, 0, control_key(ENV[SECRET_ENV].encode()))


class Reconnecting:
    """The job's store (node 0's launcher's) as the fault's driver polls it: a connection that
    drops on a busy machine (``Failed to recv``) is made again; node 0's launcher ending
    before the poll is answered is an error with its log (a verdict, not a lost connection)."""

    def __init__(self, port: int, node0: subprocess.Popen, log: Path) -> None:
        self.port, self.node0, self.log, self.store = port, node0, log, None

    def until(self, ask: Callable[[Control], Any], what: str, timeout: float = 300.0) -> Any:
        """``ask(store)`` until it is truthy (hang guard: ``timeout``)."""
        found = wait_for(lambda: self._ask(ask, what), timeout=timeout, interval=0.01)
        if found is None:
            raise AssertionError(f"{what} in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")
        return found

    def _ask(self, ask: Callable[[Control], Any], what: str) -> Any:
        if self.node0.poll() is not None:
            raise AssertionError(f"{what}: node 0's launcher ended ({self.node0.returncode}) first:\n"
                                 f"{self.log.read_text()[-3000:]}")
        try:
            self.store = self.store or job_store(self.port, timeout_s=60.0)
            return ask(self.store)
        except dist.DistError:  # dropped or refused: asked again on a new connection
            self.store = None
            return None


# the launcher imported, then started once the file argv[1] exists (a test's outsider acts first)
_ON_GO = ("import sys, time, ckpt.inprocess.launch as launch\nfrom pathlib import Path\n"
          "while not Path(sys.argv[1]).exists():\n    time.sleep(0.01)\nsys.exit(launch.main(sys.argv[2:]))")


def start_node_launcher(k: int, nodes: int, port: int, workdir: Path, shm: Path, launcher: list[str], child: list[str],
                        go: Path | None = None, **popen) -> subprocess.Popen:
    """Node ``k``'s launcher (its own CKPT_GUARD_NODE, memory dir ``shm/nodeK`` and disk root
    ``workdir/nodeK``), its workers appending to ``workdir/events.jsonl``, its output in
    ``workdir/nodeK.log``; ``go``: imported now, started once that file exists."""
    (shm / f"node{k}").mkdir(mode=0o700)
    start = ["-m", "ckpt.inprocess.launch"] if go is None else ["-c", _ON_GO, str(go)]
    cmd = [sys.executable, *start, "--nodes", str(nodes), "--node-rank", str(k),
           "--master-port", str(port), *launcher, str(CHILD), "--root", str(workdir / f"node{k}"),
           "--memory-dir", str(shm / f"node{k}"), "--events", str(workdir / "events.jsonl"), *child]
    with open(workdir / f"node{k}.log", "wb") as out:
        return subprocess.Popen(cmd, env={**os.environ, **ENV, "CKPT_GUARD_NODE": f"node{k}"}, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, **popen)


def lose_node_1(workdir: Path, shm: Path, launcher: list[str], child: list[str], *, at_step: int,
                hang_s: float, silent: bool = False, also: Callable[[], bool] | None = None) -> LostNode:
    """Start node 0 (the job launcher) and node 1; once worker 0 has done ``at_step`` steps and
    node 0's spares are ready (and ``also()`` holds, if given), lose node 1; node 0's launcher
    must then end the job well."""
    port, events = free_port(), workdir / "events.jsonl"
    workdir.mkdir(parents=True, exist_ok=True)
    logs = [workdir / f"node{k}.log" for k in range(2)]
    procs = [start_node_launcher(k, 2, port, workdir, shm, ["--hang-s", str(hang_s), *launcher], child,
                        start_new_session=k == 1) for k in range(2)]
    try:
        store = Reconnecting(port, procs[0], logs[0])
        # each node's part of the first round: the workers it runs
        parts = [store.until(lambda ctl, k=k: membership.wait_round(ctl, 0, 1.0, k), f"no first round for node {k}")
                 for k in range(2)]
        hosts = {w: k for k, part in enumerate(parts) for w in [*dict(part.members), *part.spares]}
        ready = [membership.ready_key(s) for s in parts[0].spares]

        def fault_point(ctl: Control) -> bool:
            return (int(ctl.get(membership.step_key(0)) or -1) >= at_step
                    and all(ctl.has(k) for k in ready) and (also is None or also()))

        store.until(fault_point, f"worker 0 never reached step {at_step}")
        fault_t = time.time()
        if silent:
            os.killpg(procs[1].pid, signal.SIGSTOP)  # the launcher and its workers: one session
        else:
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
        shutil.rmtree(shm / "node1")
        shutil.rmtree(workdir / "node1", ignore_errors=True)
        procs[0].wait(timeout=600)
        log = logs[0].read_text()
        if procs[0].returncode != 0:
            raise AssertionError(f"node 0's launcher failed ({procs[0].returncode}):\n{log[-4000:]}")
    finally:
        if silent:
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
        for p in procs:
            stop_process(p)
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    node1 = {e["pid"] for e in evs if e["event"] == "start" and hosts.get(e["worker"]) == 1}
    gone = wait_for(lambda: not any(running(pid) for pid in node1), timeout=30, interval=0.05)
    return LostNode(evs, fault_t, log, gone)


def run_nodes(workdir: Path, shm: Path, launcher: list[str], child: list[str], *, nodes: int = 2,
              timeout: float = 600) -> tuple[list[dict], list[str]]:
    """Run a job on ``nodes`` node launchers to its end; every launcher must exit 0. Returns
    every worker's events and each node's log."""
    port, events = free_port(), workdir / "events.jsonl"
    workdir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], [workdir / f"node{k}.log" for k in range(nodes)]
    try:
        for k in range(nodes):
            procs.append(start_node_launcher(k, nodes, port, workdir, shm, launcher, child))
        deadline = time.monotonic() + timeout  # a hang guard only
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            stop_process(p)
    texts = [log.read_text() for log in logs]
    failed = [f"node {k} ({p.returncode}):\n{t[-3000:]}" for k, (p, t) in enumerate(zip(procs, texts))
              if p.returncode != 0]
    assert not failed, "\n\n".join(failed)
    return [json.loads(line) for line in events.read_text().splitlines() if line.strip()], texts


def lost_shard_sources(log: str, step: int, ranks: list[int]) -> dict[int, set[str]]:
    """Where the survivors' restore lines (``rank R restored step S (shard K from TIER, ...)``) say
    the shards of ``ranks`` came from (each survivor reads only the shards it needs)."""
    found: dict[int, set[str]] = {r: set() for r in ranks}
    for line in re.findall(rf"rank \d+ restored step {step} \((.*?)\)", log):
        for rank, tier in re.findall(r"shard (\d+) from ([\w-]+)", line):
            if int(rank) in found:
                found[int(rank)].add(tier)
    return found
