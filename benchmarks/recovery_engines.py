"""The other engines' side of the recovery benchmark: NVRx's in-process restart and torchft.

    python benchmarks/recovery_engines.py --json out.json [--repeats 3] [--python .venv-engines/bin/python]

Issue #33 asks for our in-process recovery "measured side by side with NVRx and torchft".
This runs the recovery benchmark's model and step (examples/train_torchrun.py: the tiny GPT,
AdamW at 3e-3, its synthetic corpus; a global batch of 12 so that 3 and 2 ranks split it
evenly) under each engine, on gloo (CPU, loopback), and writes rows in the issue's schema
(``case``, ``mode``, ``fault_to_first_step_s``, ``detect_s``, ``steps_lost``, ``relaunched``,
``survivor_pids_kept``, ``equal_to_clean``, ``phase_*``) so that benchmarks/recovery_bench.py
can merge them (``rows()``).

* ``nvrx_inprocess``: nvidia-resiliency-ext 0.4.1, ``inprocess.Wrapper`` around the training
  function, 3 ranks (plain processes with RANK/WORLD_SIZE/MASTER_*, as its examples), default
  rank assignment (the world shrinks by the ranks that are gone). The state source is the
  survivors' own memory: model and optimizer live outside the wrapped function, and each
  (re)start wraps the model in DDP again, which broadcasts rank 0's weights. Faults at step 12
  on rank 1 (rank 0 hosts the Wrapper's store: NVRx needs it alive): ``killed`` (SIGKILL),
  ``hung`` (SIGSTOP), ``exception`` (a RuntimeError in the training function), ``lost_node``
  (2 simulated nodes: rank 0 | ranks 1 and 2, both SIGKILLed at once; nothing on disk to wipe).
  Phases from the ranks' own stamps: detect (fault -> the first survivor's abort begins),
  abort, membership (abort done -> the training function runs again), process_group,
  restore (the DDP broadcast), first_step (to the end of the first step after recovery).
* ``nvrx_ckpt_tiers``: the same NVRx job through ``ckpt.integrations.nvrx.run``: NVRx restarts the
  training function, our tiers are its state source (a ``CheckpointManager`` with an overlapped
  snapshot every step; each restart restores the newest step every rank can read, the dead
  ranks' shards from their memory slots on this host). ``equal_to_clean`` here: bitwise equal
  to a clean 3-rank run to the step restored, then a relaunch from it at the size the
  survivors went on at (a shrunk world is not comparable to a clean 3-rank run).
* ``torchft_2_groups``: torchft 0.2.0, a Lighthouse on 127.0.0.1 and two replica groups of
  one rank each (torchft's ``Manager`` and optimizer wrapper, ProcessGroupGloo; gradients through
  ``Manager.allreduce``: its DDP wrapper asserts on a failed all-reduce), steps padded to 0.2 s
  and a 5 s gloo timeout unless ``--torchft-step-s`` / ``--torchft-timeout-s`` say otherwise
  (``TorchftSettings``: the two decide its hung row).
  Faults at step 12 on group 1: ``killed`` (SIGKILL, and a new group 1 started at once: it
  heals from group 0 over torchft's HTTP transport, ``rejoin_s``), ``hung`` (SIGSTOP; group 0
  goes on alone). ``fault_to_first_step_s`` is group 0's first committed step after the fault.

``xid79`` rows are skipped: neither engine listens to GPU health events (an XID 79 reaches
them as a hung rank or a CUDA error: the ``hung``/``exception`` rows). Rows of an engine that
does not import in ``--python`` are skipped with the import error. ``equal_to_clean``: the
final weights' digest equals that of a run of the same engine without a fault (bitwise).
Medians of ``--repeats`` runs; progress on stderr.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.engine_workers import FAULT_STEP, TorchftSettings, add_torchft_args, torchft_settings  # noqa: E402
from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402
from benchmarks.harness.engines import engine_available, engine_versions, engines_python  # noqa: E402
from benchmarks.harness.procs import exit_on_sigterm, finish, spawn  # noqa: E402
from benchmarks.recovery_rows import median_row  # noqa: E402
from tests.procs import free_ports, wait_for  # noqa: E402

NVRX_CASES = {"killed": "kill", "hung": "stop", "exception": "raise", "lost_node": "kill_node"}
TORCHFT_CASES = {"killed": "kill", "hung": "stop"}
WORKERS = str(Path(__file__).with_name("engine_workers.py"))
TORCHFT_DEFAULT = TorchftSettings()


XID_SKIP = ("neither engine listens to GPU health events: an XID 79 reaches it as a hung rank or a CUDA "
            "error (the hung and exception rows)")
TORCHFT_NODE_SKIP = ("a replica group per node holds no per-node state (the restarted group heals from the "
                     "live peer): a lost node is the killed row")


# ---------------------------------------------------------------- driver

def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(events: list[dict[str, Any]]) -> int:
    return max((e["step"] + 1 for e in events if e["event"] == "step"), default=0)


def run_nvrx(python: str, case: str | None, workdir: Path, *, worker: str = "nvrx", world: int = 3,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One NVRx job (``world`` ranks of ``worker``), faulted as ``case`` (None: clean): its row's
    measurements."""
    fault = NVRX_CASES.get(case, "none")
    port, *aux = free_ports(3)
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    procs = [spawn(python, WORKERS, ["--worker", worker, "--events", str(workdir), "--fault", fault,
                             "--digest", str(workdir / "digest"), *extra], logs[r],
                    {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "AUX_PORTS": ",".join(map(str, aux))})
             for r in range(world)]
    victims = {"kill": [1], "stop": [1], "kill_node": [1, 2]}.get(fault, [])
    fault_t = None
    if victims:
        if not wait_for(lambda: _steps(_read(workdir / "rank0.jsonl")) >= FAULT_STEP, timeout=600, interval=0.01):
            finish(procs, 1, logs)
        fault_t = time.time()
        for v in victims:
            os.kill(procs[v].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    try:
        finish([procs[0]] + [p for i, p in enumerate(procs) if i and i not in victims], 900, logs)
    finally:
        for v in victims:  # NVRx's hard timeout SIGKILLs a stopped rank; reap it all the same
            if procs[v].poll() is None:
                os.kill(procs[v].pid, signal.SIGKILL)
            procs[v].wait()
    events = _read(workdir / "rank0.jsonl")
    survivors = [r for r in range(world) if r not in victims and (fault != "raise" or r != 1)]
    if case == "exception":
        fault_t = next(e["t"] for e in _read(workdir / "rank1.jsonl") if e["event"] == "fault")
    out: dict[str, Any] = {"digest": (workdir / "digest").read_text()}
    if fault_t is None:
        return out
    evs = {r: _read(workdir / f"rank{r}.jsonl") for r in survivors}
    abort_begin = min(e["t"] for r in survivors for e in evs[r] if e["event"] == "abort_begin" and e["t"] > fault_t)
    after = [e for e in events if e["t"] > fault_t]
    abort_end = next(e["t"] for e in after if e["event"] == "abort_end")
    fn = next(e for e in after if e["event"] == "fn_start")
    pg = next(e["t"] for e in after if e["event"] == "pg_ready")
    restored = next(e for e in after if e["event"] == "restored")
    first = next(e for e in after if e["event"] == "step" and e["t"] > restored["t"])
    # steps rank 0 finished before its abort (rank 1 may log its fault before rank 0 logs the step before)
    done_before = max((e["step"] + 1 for e in events if e["event"] == "step" and e["t"] < abort_begin), default=0)
    pids = {r: {e["pid"] for e in evs[r]} for r in survivors}
    return {**out, "fault_to_first_step_s": first["t"] - fault_t, "detect_s": abort_begin - fault_t,
            "steps_lost": done_before - restored["step"], "restored_step": restored["step"], "world_after": fn["world"],
            "survivor_pids_kept": all(len(p) == 1 for p in pids.values()),
            "phase_detect_s": abort_begin - fault_t, "phase_abort_s": abort_end - abort_begin,
            "phase_membership_s": fn["t"] - abort_end, "phase_process_group_s": pg - fn["t"],
            "phase_restore_s": restored["t"] - pg, "phase_first_step_s": first["t"] - restored["t"]}


def run_torchft(python: str, case: str | None, workdir: Path, settings: TorchftSettings = TORCHFT_DEFAULT
                ) -> dict[str, Any]:
    """One torchft job (Lighthouse + 2 replica groups), faulted as ``case`` (None: clean)."""
    logs = [workdir / f"group{g}.log" for g in range(2)] + [workdir / "lighthouse.log"]
    lighthouse = spawn(python, WORKERS, ["--worker", "lighthouse", "--events", str(workdir)], logs[-1], {})
    ready = wait_for(lambda: _read(workdir / "lighthouse.jsonl"), timeout=300)
    if not ready:
        lighthouse.kill()
        raise SystemExit(f"the Lighthouse did not start:\n{logs[-1].read_text()[-2000:]}")
    addr, fault = ready[0]["address"], TORCHFT_CASES.get(case, "none")
    args = [["--worker", "torchft", "--events", str(workdir), "--group", str(g), "--lighthouse", addr,
             "--digest", str(workdir / "digest"), "--torchft-timeout-s", str(settings.collective_timeout_s),
             "--torchft-step-s", str(settings.step_s)] for g in range(2)]
    procs = [spawn(python, WORKERS, args[g], logs[g], {}) for g in range(2)]
    fault_t, replacement = None, None
    try:
        if fault != "none":
            if not wait_for(lambda: _steps(_read(workdir / "group0.jsonl")) >= FAULT_STEP, timeout=600, interval=0.01):
                finish(procs, 1, logs)
            fault_t = time.time()
            os.kill(procs[1].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            if fault == "kill":
                procs[1].wait()
                logs.append(workdir / "group1-restarted.log")  # appends to group1.jsonl
                replacement = spawn(python, WORKERS, args[1], logs[-1], {})
        finish([procs[0]] + ([replacement] if replacement else [procs[1]] if fault == "none" else []), 900, logs)
    finally:
        if fault == "stop":
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
        lighthouse.terminate()
        lighthouse.wait()
    out: dict[str, Any] = {"digest": (workdir / "digest").read_text()}
    if fault_t is None:
        return out
    g0 = [e for e in _read(workdir / "group0.jsonl") if e["event"] == "step"]
    after = [e for e in g0 if e["t"] > fault_t]
    failed = next((e for e in after if not e["committed"]), None)
    first = next(e for e in after if e["committed"] and e["t"] > (failed["t"] if failed else fault_t))
    done_before = max((e["step"] + 1 for e in g0 if e["committed"] and e["t"] < fault_t), default=0)
    row = {**out, "fault_to_first_step_s": first["t"] - fault_t,
           "detect_s": None if failed is None else failed["t"] - fault_t,
           "steps_lost": done_before - first["step"], "survivor_pids_kept": len({e["pid"] for e in g0}) == 1,
           "phase_detect_s": None if failed is None else failed["t"] - fault_t,
           "phase_first_step_s": first["t"] - (failed["t"] if failed else fault_t)}
    if replacement:
        g1 = [e for e in _read(workdir / "group1.jsonl") if e["t"] > fault_t]
        healed = next((e["t"] for e in g1 if e["event"] == "healed"), None)
        joined = next((e["t"] for e in g1 if e["event"] == "step" and e["committed"]), None)
        row |= {"rejoin_s": None if joined is None else joined - fault_t,
                "rejoin_heal_s": None if healed is None else healed - fault_t}
    return row


def run_nvrx_tiers(python: str, case: str | None, workdir: Path) -> dict[str, Any]:
    """NVRx with our tiers: the faulted job, then its reference (a clean 3-rank run to the step
    restored, and a relaunch from it at the size the survivors went on at): ``equal_to_clean``."""
    shm = Path(tempfile.mkdtemp(prefix="recovery-engines-", dir="/dev/shm"))
    try:
        def job(name: str, world: int, *extra: str, fault: str | None = None) -> dict[str, Any]:
            (workdir / name).mkdir()
            return run_nvrx(python, fault, workdir / name, worker="nvrx_tiers", world=world,
                            extra=("--memory-dir", str(shm / name), *extra))

        got = job("faulted", 3, "--root", str(workdir / "faulted-root"), fault=case)
        if case is None:
            return got
        root, restored = str(workdir / "ref-root"), got["restored_step"]
        job("ref", 3, "--root", root, "--steps", str(restored))
        again = job("ref-after", got["world_after"], "--root", root, "--resume-step", str(restored))
        digest = got.pop("digest")
        leaves_no_shm(shm)
        return {**got, "equal_to_clean": digest == again["digest"]}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# mode: (module, cases, runner, the cases where a process is started again: torchft's killed group)
ENGINES = {"nvrx_inprocess": ("nvidia_resiliency_ext.inprocess", NVRX_CASES, run_nvrx, ()),
           "nvrx_ckpt_tiers": ("nvidia_resiliency_ext.inprocess", NVRX_CASES, run_nvrx_tiers, ()),
           "torchft_2_groups": ("torchft", TORCHFT_CASES, run_torchft, ("killed",))}
CASES = ("killed", "hung", "lost_node", "xid79", "exception")


def rows(python: str | None = None, repeats: int = 1, modes: tuple[str, ...] = tuple(ENGINES),
         cases: tuple[str, ...] = CASES, torchft: TorchftSettings = TORCHFT_DEFAULT) -> list[dict[str, Any]]:
    """The engines' rows (medians of ``repeats`` faulty runs, each checked against one clean run)."""
    python, out = python or engines_python(), []
    for mode in modes:
        module, engine_cases, run_one, relaunching = ENGINES[mode]
        described = {}  # the settings a row depends on
        if run_one is run_torchft:
            run_one, described = functools.partial(run_torchft, settings=torchft), {"torchft": asdict(torchft)}
        missing = engine_available(python, module)
        clean = None
        for case in cases:
            skip = (f"{module} does not import in {python}: {missing}" if missing else XID_SKIP if case == "xid79"
                    else TORCHFT_NODE_SKIP if case == "lost_node" and mode == "torchft_2_groups"
                    else None if case in engine_cases else f"{mode} has no {case} case")
            if skip:
                out.append({"case": case, "mode": mode, "skipped": skip})
                continue
            try:
                runs = []
                for i in range(repeats):
                    t0 = time.monotonic()
                    with tempfile.TemporaryDirectory(prefix="recovery-engines-") as tmp:
                        got = run_one(python, case, Path(tmp))
                    if "equal_to_clean" not in got:  # else the runner compared with a reference of its own
                        if clean is None:
                            with tempfile.TemporaryDirectory(prefix="recovery-engines-") as tmp:
                                clean = run_one(python, None, Path(tmp))["digest"]
                        got["equal_to_clean"] = got.pop("digest") == clean
                    runs.append(got)
                    print(f"{mode} {case} #{i + 1}: {got} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                          flush=True)
            except (Exception, SystemExit) as failed:  # one engine's failure leaves the other rows standing
                out.append({"case": case, "mode": mode, "failed": f"{type(failed).__name__}: {failed}"[-2000:]})
                continue
            out.append({"case": case, "mode": mode, "relaunched": case in relaunching, **median_row(runs),
                        "repeats": repeats, "survivor_pids_kept": all(r["survivor_pids_kept"] for r in runs),
                        **described})
    return out


def main() -> None:
    ap = parser(__doc__, repeats=1)
    ap.add_argument("--python", default=engines_python(),
                    help="an interpreter with nvidia-resiliency-ext 0.4.1 and torchft 0.2.0 (and this repo's deps)")
    ap.add_argument("--modes", default=",".join(ENGINES))
    ap.add_argument("--cases", default=",".join(CASES))
    add_torchft_args(ap)
    args = ap.parse_args()
    for name, known in (("modes", ENGINES), ("cases", CASES)):
        if bad := [x for x in getattr(args, name).split(",") if x not in known]:
            ap.error(f"unknown {name}: {', '.join(bad)} (one of {', '.join(known)})")
    exit_on_sigterm()
    start = run_meta(engines_python=args.python, versions=engine_versions(args.python))
    table = rows(args.python, args.repeats, tuple(args.modes.split(",")), tuple(args.cases.split(",")),
                 torchft_settings(args))
    write_json(args.json, start, table, echo=True)


if __name__ == "__main__":
    main()
