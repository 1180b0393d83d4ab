"""Recovery benchmark: seconds from a fault to the first resumed training step.

    python benchmarks/recovery_bench.py --json out.json [--repeats 3] [--cases killed,hung] [--modes ...]

Writes ``{"meta": {command, machine, date, load}, "rows": [...]}``: one row per case (killed,
hung, lost_node, xid79; node_failed, behind and vanished_node in process only) and mode
(``relaunch``: today's torchrun restart, below;
``inprocess_spare`` / ``inprocess_shrink``: ``ckpt.inprocess``, benchmarks/recovery_inprocess.py;
``nvrx_inprocess`` / ``nvrx_ckpt_tiers`` / ``torchft_2_groups``: NVRx's in-process restart (alone,
and with our tiers as its state source: ``ckpt.integrations.nvrx``) and torchft,
benchmarks/recovery_engines.py, in ``--engines-python``, skipped with the reason where an engine
is absent or has no such case) with ``fault_to_first_step_s``,
``detect_s``, ``steps_lost`` (steps done before the fault that are redone; the step in flight is
always redone), ``relaunched``, ``survivor_pids_kept``, ``equal_to_clean`` and the phases.
``--only`` also runs the legacy scenarios below by name (their medians under ``scenarios``).

Every mode trains the same model (benchmarks/recovery_model.py: examples/train_torchrun.py's
tiny GPT). torchrun (gloo, CPU, 2 ranks, one node) trains examples/train_torchrun.py; its fault
injector hits rank 1 at step 12, and the job restarts once. Scenarios, each against
today's behaviour where it differs:

* ``killed``: SIGKILL (peers' sockets close: noticed at once).
* ``hung``: SIGSTOP (the process frozen: declared once its beat stopped, ``frozen_fast``;
  before, at the 10 s floor) with the hang detector's defaults; ``hung_alive``: rank 1
  asleep in a call (alive, beating, as in a stuck kernel: declared at the 10 s floor);
  ``hung_4s`` with ``--hang-deadline 4``, and
  ``hung_baseline``: today's behaviour, without the detector (the training group's
  timeout set to 10 s; measured 161 s all the same: the survivor still waits out a
  collective timeout, likely the checkpoint coordinator's 120 s group, then torchrun's
  30 s SIGTERM grace that a stopped process ignores).
* ``xid79``: a simulated agent posts XID 79 for this host to a real ``predictor serve``
  (loopback, ``--no-auth``) once the job reached step 12; ``detect_s`` is the post ->
  the last rank's "job stopped" line, and the phases count from the post. Today a dead
  GPU leaves its rank hung: the ``hung*`` rows are its baseline.

* ``lost_node_peer`` / ``lost_node_objstore``: two simulated nodes (a torchrun agent
  and one rank each); past step 17, node 1 is lost (agent and rank SIGKILLed, its
  memory and disk wiped) and a replacement agent with empty directories starts at once;
  its rank's own shard comes from node 0's memory (``--peers 1``) or, today, from the
  object store (a file:// directory). The phases count from the loss;
  ``replacement_agent_startup_s`` is the replacement agent's own start-up (launched ->
  its "Starting elastic_operator" log line: the interpreter and torch's imports), part
  of ``phase_relaunch_s``: in a real cluster the scheduler's, not the job's, cost.
* ``lost_node_hot_spare``: as ``lost_node_peer``, but no agent starts after the loss: a
  third one, started once the first round completed, stands by in the rendezvous (torch
  keeps an agent that finds the round full in its redundancy list) and joins the next
  round in node 1's place; ``ckpt simulate --replace-s 0``, measured.

From the ranks' own log lines: ``detect_s`` (fault -> hang declared), ``relaunch_s``
(fault -> rank 0 restored a checkpoint in the new incarnation), ``total_s`` (fault ->
first resumed step begins), and ``phase_*``: the restart's phases as rank 0 logged them
(``ckpt.recovery.restarts``: detect, exit, relaunch, startup, pg_init, setup, restore,
first_step, total; these count from the fault as the job knows it, and to the end of
the first resumed step). Medians of ``--repeats`` runs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.engine_workers import add_torchft_args, torchft_settings  # noqa: E402
from benchmarks.harness import leaves_no_shm, median_of, parser, run_meta, write_json  # noqa: E402
from benchmarks.harness.engines import engines_python  # noqa: E402
from benchmarks.harness.procs import exit_on_sigterm  # noqa: E402
from benchmarks.recovery_engines import rows as engine_rows  # noqa: E402
from benchmarks.recovery_inprocess import CASES, References, leak_check, readiness_cost, run_row  # noqa: E402
from benchmarks.recovery_rows import median_row  # noqa: E402
from tests.integration_helpers import REPLACEABLE, finish_nodes, kill_node, rendezvous_state, start_node  # noqa: E402
from tests.procs import free_port, stop_process, wait_for  # noqa: E402

SCENARIOS = {
    "killed": ["--faults", "12"],
    "hung": ["--faults", "12:stop"],
    "hung_alive": ["--faults", "12:hang"],
    "hung_4s": ["--faults", "12:stop", "--hang-deadline", "4"],
    "hung_baseline": ["--faults", "12:stop", "--no-hang-detection", "--pg-timeout", "10"],
    "xid79": [],  # run_xid
    "lost_node_peer": [],  # run_lost_node
    "lost_node_objstore": [],
    "lost_node_hot_spare": [],
}
# A lost agent stays in the rendezvous until keep_alive_interval x keep_alive_max_attempt
# without a heartbeat (5 s x 3 by default): the next round waits that long for it.
RDZV_CONF = os.environ.get("RECOVERY_RDZV_CONF", "keep_alive_interval=1,keep_alive_max_attempt=3")
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
MONITOR_INTERVAL = os.environ.get("RECOVERY_MONITOR_INTERVAL", "0.1")  # torchrun's default (was 0.5 here)


def run(scenario: str, workdir: Path, memory_dir: str) -> dict[str, float | None]:
    """One faulty run of ``scenario``: its phases in seconds."""
    if scenario == "xid79":
        return run_xid(workdir, memory_dir)
    if scenario.startswith("lost_node"):
        return run_lost_node(workdir, peer=scenario != "lost_node_objstore", spare=scenario == "lost_node_hot_spare")
    log = _torchrun(scenario, workdir, memory_dir, *SCENARIOS[scenario])
    fault = re.search(r"fault injector: (?:SIG\w+|hang) rank 1 at step 12 \(([\d.]+)\)", log)
    first = re.search(r"rank0 incarnation 1: first step \d+ at ([\d.]+)", log)
    if not (fault and first):
        raise SystemExit(f"{scenario}: no fault, or no restart, in the log:\n{log[-3000:]}")
    fault, first = float(fault.group(1)), float(first.group(1))
    restored = _stamp(re.search(_STAMP + r"rank0 rank 0 restored step", log))
    detected = _stamp(re.search(_STAMP + r"rank\d+ hang detected", log))
    return {"detect_s": None if detected is None else detected - fault, "relaunch_s": restored - fault,
            "total_s": first - fault, "restored_step": _restored_step(log), **_phases(log)}


def _torchrun(scenario: str, workdir: Path, memory_dir: str, *extra: str) -> str:
    """The example under torchrun (2 ranks, one restart allowed): its log."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--monitor-interval={MONITOR_INTERVAL}",
           str(REPO / "examples" / "train_torchrun.py"), "--root", str(workdir / "root"), "--memory-dir",
           memory_dir, "--steps", "30", "--every", "5", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{scenario}: torchrun failed ({proc.returncode}):\n{log[-3000:]}")
    leaves_no_shm(memory_dir)
    return log


def run_xid(workdir: Path, memory_dir: str) -> dict[str, float | None]:
    """A simulated agent posts XID 79 for this host to a real ``predictor serve`` (no auth,
    loopback) once the job reached step 12: its phases from that post."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port), "--no-auth"],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url, timeline, posted = f"http://127.0.0.1:{port}", workdir / "timeline.jsonl", []
    try:
        if not wait_for(lambda: healthy(url), timeout=60):
            raise SystemExit("predictor serve did not come up")

        def agent() -> None:
            if wait_for(lambda: _reached(timeline, 12), timeout=300, interval=0.01):
                body = json.dumps({"timestamp": int(time.time() * 1000), "node": socket.gethostname(), "gpu": 0,
                                   "xid": 79}) + "\n"
                posted.append(time.time())
                req = urllib.request.Request(url + "/v1/xid", data=body.encode(), method="POST", headers={
                    "Content-Type": "application/x-ndjson", "X-Batch-Id": f"bench-{time.time_ns()}"})
                urllib.request.urlopen(req, timeout=10).close()

        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        log = _torchrun("xid79", workdir, memory_dir, "--predictor", url, "--step-time", "0.2",
                        "--timeline", str(timeline))
        thread.join(timeout=10)
    finally:
        stop_process(server)
    stopped = [_stamp(m) for m in re.finditer(_STAMP + r"rank\d+ rank \d+: job stopped", log)]
    first = re.search(r"rank0 incarnation 1: first step \d+ at ([\d.]+)", log)
    if not (posted and stopped and first):
        raise SystemExit(f"xid79: no XID posted, no reaction or no restart in the log:\n{log[-3000:]}")
    return {"detect_s": max(stopped) - posted[0], "relaunch_s": _stamp(re.search(_STAMP + r"rank0 rank 0 restored",
                                                                                  log)) - posted[0],
            "total_s": float(first.group(1)) - posted[0], "restored_step": _restored_step(log), **_phases(log)}


def _restored_step(log: str) -> int | None:
    found = re.search(r"rank0 rank 0 restored step (\d+)", log)
    return None if found is None else int(found.group(1))


def _phases(log: str) -> dict[str, float | None]:
    """The restart's phases as rank 0 logged them (``ckpt.recovery.restarts``), prefixed ``phase_``."""
    found = re.search(r"restart timing: (\{.*\})", log)
    if not found:
        raise SystemExit(f"no restart timing line in the log:\n{log[-3000:]}")
    timing = json.loads(found.group(1))
    return {f"phase_{k}": v for k, v in timing.items() if k.endswith("_s")}


def run_lost_node(workdir: Path, *, peer: bool, spare: bool = False) -> dict[str, float | None]:
    """Two simulated nodes (a torchrun agent and one rank each); once the job is past step
    17, node 1 is lost (agent and worker SIGKILLed, its memory and disk wiped) and a
    replacement agent with empty directories starts at once, or with ``spare`` a third
    agent that has stood by in the rendezvous since the first round completed takes its
    place. Its rank's own shard comes from node 0's memory (``--peers 1``), or from the
    object store (a file:// directory): its phases from the loss."""
    port, shm = free_port(), [Path(tempfile.mkdtemp(prefix=f"recovery-node{i}-", dir="/dev/shm")) for i in range(3)]
    timeline = workdir / "timeline.jsonl"
    tier = ["--peers", "1"] if peer else ["--object-store", f"file://{workdir / 'objstore'}"]
    args = [["--root", str(workdir / f"node{i}"), "--memory-dir", str(shm[i]), "--steps", "40", "--every", "5",
             "--step-time", "0.2", *tier, *(["--timeline", str(timeline)] if i == 0 else [])] for i in range(3)]
    script = REPO / "examples" / "train_torchrun.py"

    def node(i: int, env: dict[str, str] = REPLACEABLE) -> subprocess.Popen:
        # its own loopback address, in node order: torch ranks nodes by address, then by
        # agent pid, and a replacement with a wrapped-around pid would take rank 0
        return start_node(script, i, 2, port, args[i], restarts=1, env=env, rdzv_conf=RDZV_CONF,
                          local_addr=f"127.0.0.{i + 1}")

    try:
        nodes = [node(0), node(1)]
        if spare:
            if not wait_for(lambda: (s := rendezvous_state(port)) is not None and s.complete, timeout=300):
                _abandon(nodes, "hot spare: the first round never completed")
            nodes.append(node(2))
            if not wait_for(lambda: len(getattr(rendezvous_state(port), "redundancy_list", ())) == 1, timeout=300):
                _abandon(nodes, "hot spare: the third agent never stood by")
        if not wait_for(lambda: _reached(timeline, 17), timeout=300, interval=0.05):
            _abandon(nodes, "lost node: the job never reached step 17")
        lost = time.time()
        kill_node(nodes[1])
        shutil.rmtree(shm[1])
        shm[1].mkdir(mode=0o700)
        shutil.rmtree(workdir / "node1")
        replaced = time.time()  # LOGLEVEL=INFO: the agent logs when its own start-up is done
        nodes[1] = nodes.pop() if spare else node(1, {**REPLACEABLE, "LOGLEVEL": "INFO"})
        log, replacement_log = finish_nodes(nodes, timeout=400)
        leaves_no_shm(*shm)
    finally:
        for d in shm:
            shutil.rmtree(d, ignore_errors=True)
    # the first step after the loss: not "incarnation >= 1", as torchrun counts a restart
    # for a new member (the spare leaving its standby list first) as no restart at all
    first = next((float(t) for t in re.findall(r"rank0 incarnation \d+: first step \d+ at ([\d.]+)", log)
                  if float(t) > lost), None)
    restored = _stamp(re.search(_STAMP + r"rank0 rank 0 restored step", log))
    if not (first and restored):
        raise SystemExit(f"lost node: no restart in node 0's log:\n{log[-3000:]}")
    ready = re.search(r"^I(\d{4} \d\d:\d\d:\d\d\.\d+) .*Starting elastic_operator", replacement_log, re.M)
    agent_s = None if ready is None or spare else datetime.strptime(
        f"{datetime.now().year}{ready.group(1)}", "%Y%m%d %H:%M:%S.%f").timestamp() - replaced
    return {"detect_s": None, "relaunch_s": restored - lost, "total_s": first - lost,
            "replacement_agent_startup_s": agent_s, "restored_step": _restored_step(log), **_phases(log)}


def _abandon(nodes: list[subprocess.Popen], why: str) -> None:
    """Stop every simulated node (by pid) and the benchmark, with node 0's output."""
    logs = [kill_node(n) for n in nodes]
    raise SystemExit(f"{why}:\n{logs[0][-3000:]}")


def healthy(url: str) -> bool:
    """``predictor serve`` at ``url`` answers its health check."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _reached(timeline: Path, step: int) -> bool:
    return timeline.exists() and any(json.loads(line)["step"] >= step for line in timeline.read_text().splitlines())


def _stamp(found: re.Match | None) -> float | None:
    """A log line's asctime (local time, ms) as epoch seconds."""
    return None if found is None else datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


# today's relaunch rows: the scenario that measures each case
RELAUNCH = {"killed": "killed", "hung": "hung", "lost_node": "lost_node_peer", "xid79": "xid79"}
FAULT_STEP = {"killed": 12, "hung": 12}  # the step the injector hits (12 steps done)
INPROCESS_ONLY = ["node_failed", "behind", "vanished_node"]  # their relaunch path is another row's
SKIPPED = {
    ("node_failed", "relaunch"): "the xid79 relaunch row: under ckpt.resumable the predictor's node_failed "
                                 "ends every rank (exit 87) and torchrun restarts the job",
    ("behind", "relaunch"): "the hung relaunch row's path: the watchdog's verdict ends every rank (exit 86) and "
                            "torchrun restarts the job",
    ("vanished_node", "relaunch"): "the lost_node relaunch row's path, detected by the rendezvous' heartbeat",
}
# benchmarks/recovery_engines.py, in --engines-python
ENGINE_MODES = ["nvrx_inprocess", "nvrx_ckpt_tiers", "torchft_2_groups"]
MODES = ["relaunch", "inprocess_spare", "inprocess_shrink", *ENGINE_MODES]


def relaunch_row(case: str, measured: dict[str, float | None]) -> dict:
    restored = measured.get("restored_step")
    return {"case": case, "mode": "relaunch", "scenario": RELAUNCH[case],
            "fault_to_first_step_s": measured["total_s"], "detect_s": measured["detect_s"],
            "steps_lost": None if restored is None or case not in FAULT_STEP else FAULT_STEP[case] - restored,
            "relaunched": True, "survivor_pids_kept": False,
            "equal_to_clean": None,  # not checked here: tests/test_distributed_torchrun.py checks exact resume
            "phases": {k: v for k, v in measured.items() if k.startswith("phase_")}}


def main() -> None:
    ap = parser(__doc__, repeats=1)
    ap.add_argument("--cases", default=",".join([*RELAUNCH, *INPROCESS_ONLY]),
                    help="comma-separated: killed, hung, lost_node, xid79, node_failed, behind, vanished_node")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--engines-python", default=engines_python(),
                    help="an interpreter with nvidia-resiliency-ext 0.4.1 and torchft 0.2.0 for their rows "
                    "(docs/research/recovery-engines.md); without them those rows are skipped with the reason")
    add_torchft_args(ap)
    ap.add_argument("--no-leak-check", action="store_true", help="skip the 5-consecutive-recoveries check")
    ap.add_argument("--only", default="", help="also run these legacy scenarios (medians under 'scenarios'): "
                    + ", ".join(SCENARIOS))
    args = ap.parse_args()
    torchft = torchft_settings(args)
    exit_on_sigterm()
    meta = run_meta(repeats=args.repeats)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-ref-") as refdir:
        refs = References(Path(refdir))
        for case in args.cases.split(","):
            for mode in args.modes.split(","):
                if (case, mode) in SKIPPED:
                    rows.append({"case": case, "mode": mode, "skipped": SKIPPED[case, mode]})
                    continue
                if mode in ENGINE_MODES:
                    rows.extend(engine_rows(args.engines_python, args.repeats, (mode,), (case,), torchft))
                    continue
                runs = []
                for i in range(args.repeats):
                    t0 = time.monotonic()
                    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp, \
                            tempfile.TemporaryDirectory(prefix="recovery-bench-", dir="/dev/shm") as shm:
                        if mode == "relaunch":
                            runs.append(relaunch_row(case, run(RELAUNCH[case], Path(tmp), shm)))
                        elif case in CASES:
                            runs.append(run_row(case, mode, Path(tmp), refs))
                    print(f"{case}/{mode} #{i + 1}: {runs[-1]} ({time.monotonic() - t0:.0f} s)", file=sys.stderr,
                          flush=True)
                rows.append(median_row(runs))
        leaks = None if args.no_leak_check else leak_check(Path(refdir))
        print(f"leak check: {leaks}", file=sys.stderr, flush=True)
        ready = readiness_cost(refs.clean_events)
    scenarios = {}
    for scenario in filter(None, args.only.split(",")):
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
        with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp, \
                tempfile.TemporaryDirectory(prefix="recovery-bench-", dir="/dev/shm") as shm:
            scenarios[scenario] = median_of([run(scenario, Path(tmp), shm) for _ in range(args.repeats)])
    write_json(args.json, meta, rows, echo=True, leak_check=leaks, readiness_cost=ready,
               **({"scenarios": scenarios} if scenarios else {}))

if __name__ == "__main__":
    main()
