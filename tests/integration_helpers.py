"""Shared helpers for the tests that run training scripts as real processes: ``torchrun``
(gloo, 2 ranks on CPU), and for the Lightning and Hugging Face integration tests:

An example training script (examples/train_lightning.py, examples/train_hf.py) runs as
real child processes; its fault injector SIGKILLs or SIGTERMs them, and the test starts
it again until it finishes, as a job scheduler would. ``Zygote`` imports the example
once (Lightning alone takes seconds to import) and forks one fresh process per run,
so a five-run test costs one import: ``python -m tests.integration_helpers MODULE``.
"""
from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import traceback
from base64 import b64decode
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tests.ckpt_helpers import REPO
from tests.procs import free_port, stop_process

FAULTS = "6:kill,10:term,14:kill"  # mid-epoch SIGKILL, preemption notice, SIGKILL after an epoch-end save


REPLACEABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_ENV = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def torchrun(script: Path, *args: str, restarts: int = 0, nproc: int = 2, check: bool = True) -> str:
    """Run ``script`` on ``nproc`` gloo ranks (restarted up to ``restarts`` times); its output,
    asserting success when ``check``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.5", str(script), *args]
    proc = subprocess.run(cmd, env={**os.environ, **_ENV}, capture_output=True, text=True, timeout=400, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 or not check, log[-4000:]
    return log


def torchrun_nodes(script: Path, node_args: list[list[str]], *, nproc: int = 1, restarts: int = 0,
                   timeout: float = 300.0) -> list[str]:
    """Simulated nodes on this machine: one torchrun agent per entry of ``node_args`` (that
    node's own arguments: its disk root, its memory dir), ``nproc`` ranks each, a c10d
    rendezvous on loopback hosted by node 0, ``CKPT_GUARD_NODE=node<i>``. Each node's
    output, asserting that every agent succeeded within ``timeout``."""
    port, nodes = free_port(), len(node_args)
    procs = [start_node(script, i, nodes, port, extra, nproc=nproc, restarts=restarts)
             for i, extra in enumerate(node_args)]
    return finish_nodes(procs, timeout)


def start_node(script: Path, i: int, nodes: int | str, port: int, extra: list[str], *, nproc: int = 1,
               restarts: int = 0, env: dict[str, str] | None = None, rdzv_conf: str = "",
               local_addr: str | None = None) -> subprocess.Popen:
    """Node ``i``'s torchrun agent (node 0 hosts the rendezvous at ``port``); started again
    with the same arguments, it replaces a lost node in the same job. For that, pass
    ``REPLACEABLE`` in ``env``: torch's shared rendezvous TCP store never publishes a new
    round's store address to a replacement agent (its host reuses the first round's), so
    the replacement waits forever; without sharing, each round's rank 0 hosts a fresh one.
    ``nodes`` may be elastic ("1:2"); ``rdzv_conf``: more ``--rdzv-conf`` settings (``key=value,...``).
    ``local_addr`` (a loopback address, 127.0.0.x): the node's address in the rendezvous,
    which orders the nodes into ranks (torch sorts them by address, then agent pid: without
    it, a replacement's pid decides, and pids wrap)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id=sim-{port}", f"--rdzv-conf=is_host={int(i == 0)}{',' + rdzv_conf if rdzv_conf else ''}",
           "--monitor-interval=0.5", *([f"--local-addr={local_addr}"] if local_addr else []),
           str(script), *extra]
    env = {**os.environ, **_ENV, "CKPT_GUARD_NODE": f"node{i}", **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)


def finish_nodes(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each agent's output, asserting that every one succeeded within ``timeout``."""
    logs, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(out)
    finally:
        for proc in procs:
            stop_process(proc)
    failed = [f"node{i} (exit {proc.returncode}):\n{log[-4000:]}" for i, (proc, log) in enumerate(zip(procs, logs))
              if proc.returncode != 0]
    assert not failed, "\n\n".join(failed)     # every failed node: the first to fail is often not node 0
    return logs


def kill_node(proc: subprocess.Popen) -> str:
    """Lose a node: SIGKILL its agent and every process under it, by pid (an orphaned
    worker that kept serving would make a test pass wrongly). Returns its output."""
    pids, todo = [], [proc.pid]
    while todo:  # the whole tree first: a killed parent's children are re-parented
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.communicate()[0]


def rendezvous_state(port: int) -> object | None:
    """The simulated job's rendezvous state as torch's c10d backend keeps it in node 0's
    store at ``port`` (``participants``, ``wait_list``, ``redundancy_list``, ``round``,
    ``complete``): how a test sees that an agent is standing by. None before the first round,
    and while the store does not answer (the probe's own connection timing out is not the job's
    failure: the caller's wait decides)."""
    from torch.distributed import DistNetworkError, TCPStore

    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    except DistNetworkError:
        return None
    key = f"torch.rendezvous.sim-{port}"
    if not store.check([key]):
        return None
    value = store.get(key)
    return None if value == b"Y2FuaW1hZGFt" else pickle.loads(b64decode(value))  # torch's "no state" sentinel


@dataclass
class Run:
    rc: int  # exit code, or minus the signal that ended it
    restored: int | None  # the step it resumed from
    log: str


class Zygote:
    """Client of the forking server below, for one example module."""

    def __init__(self, module: str, workdir: Path) -> None:
        self.workdir, self.runs = workdir, 0
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration_helpers", module], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, *argv: str, timeout: float = 120.0) -> Run:
        self.runs += 1
        log = self.workdir / f"run-{self.runs}.log"
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": list(argv), "log": str(log), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, "the zygote died"
        text = log.read_text()
        found = re.search(r"restored step (\d+)", text)
        return Run(json.loads(answer)["rc"], int(found.group(1)) if found else None, text)

    def run_until_done(self, *argv: str, attempts: int = 6) -> list[Run]:
        runs: list[Run] = []
        while not runs or runs[-1].rc != 0:
            assert len(runs) < attempts, "\n---\n".join(r.log[-2000:] for r in runs)
            runs.append(self.run(*argv))
            assert runs[-1].rc in (0, -signal.SIGKILL, 143), runs[-1].log[-4000:]
        return runs

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def assert_resumes_exactly(module: str, tmp_path: Path, memory_dir: str, restored: list[int]) -> None:
    """The example ``module`` interrupted by FAULTS, restarted after each, resumes from
    the ``restored`` steps (the second: the urgent save SIGTERM asked for) and ends
    bitwise equal to an uninterrupted run with the same seed."""
    runs, faulty, clean = faulty_and_clean(module, tmp_path, memory_dir)
    assert [r.rc for r in runs] == [-signal.SIGKILL, 143, -signal.SIGKILL, 0]
    assert [r.restored for r in runs] == [None, *restored]
    assert f"urgent checkpoint at step {restored[1]}" in runs[1].log
    assert faulty == clean, "the resumed run diverged from the uninterrupted one"


def assert_ddp_resumes_exactly(module: str, tmp_path: Path, memory_dir: str, restored: list[int]) -> None:
    """The same under torchrun on 2 DDP ranks, FAULTS hitting the last rank only: both
    ranks save the urgent step together, restore the same ``restored`` steps, and end
    bitwise equal to an uninterrupted 2-rank run. The same run checks a crash by an
    exception (the last rank raises at step 17, one step after the periodic save at 16):
    rank 0's restart timing line (``ckpt.recovery.restarts``) names the exception as the
    fault and counts the total from it, and both ranks resume from 16. One faulty launch
    checks both (each rank's start imports the framework: seconds of CPU)."""
    script = REPO / "examples" / f"{module.rsplit('.', 1)[-1]}.py"

    def run(name: str, *extra: str, restarts: int = 0) -> str:
        return torchrun(script, "--root", str(tmp_path / name), "--memory-dir", memory_dir,
                        "--out", str(tmp_path / f"{name}.json"), *extra, restarts=restarts)

    run("clean")
    log = run("faulty", "--faults", f"{FAULTS},17:raise", restarts=4)
    for rank in (0, 1):
        assert re.search(rf"rank{rank} \S+ urgent checkpoint at step {restored[1]}\b", log), log[-4000:]
        assert [int(s) for s in re.findall(rf"rank{rank} \S+ rank {rank} restored step (\d+)", log)] == [*restored, 16]
    timings = [json.loads(t) for t in re.findall(r"rank0 \S+ restart timing: (\{.*\})", log)]
    crash = [t for t in timings if "ended by RuntimeError: fault injector" in t["cause"]]
    assert len(crash) == 1 and crash[0]["total_s"] is not None, timings or log[-4000:]
    assert _digest(tmp_path, "faulty") == _digest(tmp_path, "clean"), \
        "the resumed DDP run diverged from the uninterrupted one"


def faulty_and_clean(module: str, tmp_path: Path, memory_dir: str) -> tuple[list[Run], str, str]:
    """An interrupted run, restarted after each fault until done, and an uninterrupted
    one with the same seed: the runs and both final weight digests."""
    zygote = Zygote(module, tmp_path)
    try:
        def argv(name: str, *extra: str) -> list[str]:
            return ["--root", str(tmp_path / name), "--memory-dir", memory_dir, "--out", str(tmp_path / f"{name}.json"),
                    *extra]
        clean = zygote.run(*argv("clean"))
        assert clean.rc == 0, clean.log[-4000:]
        runs = zygote.run_until_done(*argv("faulty", "--faults", FAULTS))
    finally:
        zygote.close()
    return runs, _digest(tmp_path, "faulty"), _digest(tmp_path, "clean")


def _digest(tmp_path: Path, name: str) -> str:
    """The final weights digest a run named ``name`` wrote (rank 0, ``--out``)."""
    return json.loads((tmp_path / f"{name}.json").read_text())["digest"]


def serve(module: str) -> None:
    """Import ``module`` once; per request line (argv, log, timeout) fork a process that
    runs its ``main()`` with that argv, and answer with how it ended."""
    main = importlib.import_module(module).main
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(module, main, req["argv"], req["log"])
        deadline = time.monotonic() + req["timeout"]
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(done[1])}), flush=True)


def _child(module: str, main: object, argv: list[str], log: str) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = [module, *argv]
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
