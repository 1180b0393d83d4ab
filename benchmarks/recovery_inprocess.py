"""The in-process rows of the recovery benchmark (benchmarks/recovery_bench.py): the same fault
under ``python -m ckpt.inprocess.launch`` with a warm spare (2 ranks + 1 spare) and shrinking
(3 ranks -> 2), trained by tests/inprocess_child.py (``--model gpt``: every mode's model,
benchmarks/recovery_model.py; gloo; an overlapped snapshot every step: ``--overlap``).

* ``killed``: the rank SIGKILLs itself at step ``FAULT_AT``.
* ``hung``: it SIGSTOPs itself; the launcher's beat check (``--hang-s``) declares and kills it.
* ``xid79``: rank 0 posts an eviction of the other rank to the launcher's store (what a
  predictor listener does on an XID 79): the launcher SIGKILLs it, it never resumes in place.
* ``node_failed``: rank 0's predictor listener (``run(listener=...)``) hears "node_failed" for
  the other rank's GPU, as ``predictor serve`` sends it: that rank alone is evicted.
* ``behind``: the rank stops stepping after step ``FAULT_AT`` (alive, beating: not frozen); the
  launcher's progress deadline (``--progress-s PROGRESS_S``) names it behind and evicts it.
* ``lost_node``: two simulated nodes on loopback (``--nodes 2``, tests/inprocess_nodes.py): with
  a spare, 1 rank + 1 spare each; shrinking, 2 ranks each (4 -> 2); both with peer replicas
  (``--peers 1``: the lost ranks' shards come from node 0's memory). Past step
  ``FAULT_AT`` node 1's launcher is SIGKILLed (its workers die with it) and its memory dir and
  disk root removed; its lifeline closes, so it is declared lost at once. The row is fault ->
  first resumed step on node 0; ``lost_shards_from``: where the survivors read the lost ranks'
  shards (node 1's memory and disk are gone).
* ``vanished_node``: as ``lost_node``, but node 1's launcher and workers are SIGSTOPped (a host
  that vanished: its sockets stay open): it is declared lost after ``--hang-s NODE_HANG_S`` without a
  beat, and node 0's ranks blocked in a collective with it are cut loose.

Each row's equality is checked against a run of the same launcher: with a spare, an
uninterrupted 2-rank run; shrinking, a clean 3-rank (lost_node: 4-rank) run to the restored step
then a relaunch at 2 ranks from it (so: bitwise equal to a relaunch from the same checkpoint at
the new size).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import leaves_no_shm
from tests.inprocess_nodes import lose_node_1, lost_shard_sources

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "inprocess_child.py"
MODEL = ["--model", "gpt", "--overlap"]
# HANG_S: the silence (no beat, no CPU time) that declares a rank frozen: 1 s, torchft's heartbeat
# timeout in its rows of the same benchmark (recovery_engines.py), so the hung rows compare alike.
# NODE_HANG_S: a node launcher's silence that declares the node vanished (beats only: no CPU time
# to read on another host); at 1 s one run of the benchmark lost its job before the fault
STEPS, FAULT_AT, HANG_S, NODE_HANG_S, PROGRESS_S = 20, 10, 1.0, 2.0, 2.0
MODES = {"inprocess_spare": ["--nproc", "2", "--spares", "1"], "inprocess_shrink": ["--nproc", "3"]}
CASES = {"killed": ["--kill-worker", "1", "--kill-at", str(FAULT_AT)],
         "hung": ["--kill-worker", "1", "--kill-at", str(FAULT_AT), "--hang"],
         "xid79": ["--evict-worker", "1", "--kill-at", str(FAULT_AT)],
         "node_failed": ["--node-failed-gpu", "1", "--kill-at", str(FAULT_AT)],
         "behind": ["--stall-worker", "1", "--kill-at", str(FAULT_AT)], "lost_node": [], "vanished_node": []}
# lost_node, per node: the launcher's flags; the lost ranks' shards come from peer replicas in both
# (shrinking took them from the object store, 3 steps back, until the snapshot was sealed at the
# end of the next forward: the two lost ranks' replicas now share the step before the fault)
NODE_MODES = {"inprocess_spare": ["--nproc", "1", "--spares", "1"], "inprocess_shrink": ["--nproc", "2"]}


def launch(workdir: Path, name: str, launcher: list[str], child: list[str]) -> list[dict]:
    """One job under the in-process launcher: its workers' events. The hung case declares a
    frozen rank after ``HANG_S``, the behind case a rank left behind after ``PROGRESS_S``; the
    others keep the launcher's defaults (a starved process on a loaded machine must not be
    taken for a frozen one)."""
    events = workdir / f"{name}.jsonl"
    hang = ["--hang-s", str(HANG_S)] if "--hang" in child else []
    hang += ["--progress-s", str(PROGRESS_S)] if "--stall-worker" in child else []
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", *hang, *launcher, str(CHILD),
           "--root", str(workdir / name), "--events", str(events), *MODEL, *child]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the launcher failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    leaves_no_shm(under=workdir / name)  # the workers' memory tier: the default /dev/shm
    return [json.loads(line) for line in events.read_text().splitlines()]


def _digests(evs: list[dict]) -> set[str]:
    return {e["digest"] for e in evs if e["event"] == "done"}


class References:
    """Digests of the runs a faulty one must equal, each computed once."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self._cache = workdir, {}
        self.clean_events: list[dict] | None = None  # the uninterrupted 2-rank run, once it ran

    def get(self, mode: str, restored: int, before: int = 3) -> set[str]:
        """``before``: the world size the shrinking run had before the fault."""
        key = (mode, (restored, before) if mode == "inprocess_shrink" else None)
        if key not in self._cache:
            name = f"ref-{mode}-{restored}-{before}"
            if mode == "inprocess_spare":
                evs = self.clean_events = launch(self.workdir, name, ["--nproc", "2"], ["--steps", str(STEPS)])
            else:  # both legs on one root: the relaunch restores the clean run's step
                launch(self.workdir, name, ["--nproc", str(before)], ["--steps", str(restored)])
                evs = launch(self.workdir, name, ["--nproc", "2"], ["--steps", str(STEPS), "--resume-step",
                                                                        str(restored)])
            # both legs append to one events file: the relaunch's ends are the ones at 2 ranks
            self._cache[key] = _digests([e for e in evs if e.get("world") == 2])
        return self._cache[key]


def run_row(case: str, mode: str, workdir: Path, refs: References) -> dict:
    """One fault under one in-process mode: the benchmark's row."""
    lost = None
    if case in ("lost_node", "vanished_node"):
        with tempfile.TemporaryDirectory(prefix="recovery-bench-nodes-", dir="/dev/shm") as shm:
            lost = lose_node_1(workdir / f"{case}-{mode}", Path(shm), NODE_MODES[mode],
                               [*MODEL, "--steps", str(STEPS), "--peers", "1"],
                               at_step=FAULT_AT, hang_s=NODE_HANG_S, silent=case == "vanished_node")
            leaves_no_shm(shm)
        evs, fault = lost.events, {"t": lost.fault_t}
    else:
        evs = launch(workdir, f"{case}-{mode}", MODES[mode], ["--steps", str(STEPS), *CASES[case]])
        fault = next(e for e in evs if e["event"] == "fault")
    starts = [e for e in evs if e["event"] == "start"]
    started = {e["worker"]: e["pid"] for e in starts}
    done = [e for e in evs if e["event"] == "done"]
    recs = [e for e in evs if e["event"] == "recovery"]
    survivors = [r for r in recs if r["failed_at_step"] is not None]
    if not (done and survivors):
        raise SystemExit(f"{case}/{mode}: no recovery in the events")
    lead = min(survivors, key=lambda r: (r["round"], r["rank"]))  # the first recovery, as rank 0 saw it
    restored = lead["restored_step"]
    phases = {k: round(v, 4) for k, v in lead["phases"].items() if k.endswith("_s")}
    leaked = [r.get("leaked_groups") for r in recs]
    return {"case": case, "mode": mode,
            "fault_to_first_step_s": round(max(r["resumed_at"] for r in recs if r["round"] == lead["round"])
                                           - fault["t"], 4),
            "detect_s": round(lead["phases"]["fault_time"] - fault["t"], 4),
            "steps_lost": lead["failed_at_step"] - restored,
            "relaunched": len(starts) > len(started),  # a fallback relaunch starts a worker again
            "survivor_pids_kept": all(e["pid"] == started[e["worker"]] for e in done),
            "equal_to_clean": _digests(evs) == refs.get(mode, restored, 3 if lost is None else 4),
            "world_size_after": lead["world_size"], "restored_step": restored, "phases": phases,
            "recoveries": len({r["round"] for r in recs}),  # > 1: a second fault (or a false frozen) followed
            "final_world_size": max(e["world"] for e in done),
            "broken_groups_still_held": max((x for x in leaked if x is not None), default=None),
            **({} if lost is None else {"node1_workers_gone": lost.node1_workers_gone, "lost_shards_from": {
                r: sorted(t) for r, t in lost_shard_sources(lost.log, restored, [1] if mode == "inprocess_spare"
                                                            else [2, 3]).items()}})}


def leak_check(workdir: Path, recoveries: int = 5) -> dict:
    """``recoveries`` consecutive recoveries (a warm spare each time; rank 1 dies every 5 steps):
    what the surviving rank 0 holds after each. Nothing may accumulate."""
    evs = launch(workdir, "leak", ["--nproc", "2", "--spares", str(recoveries)],
                 ["--steps", str(5 * recoveries + 5), "--kill-rank-every", "5"])
    seen = [e for e in evs if e["event"] == "recovery" and e["worker"] == 0]
    per = [{"round": e["round"], "threads": e["threads"], "fds": e["fds"], "rss_kib": e["rss_kib"],
            "broken_groups_still_held": e["leaked_groups"], "total_s": round(e["phases"]["total_s"], 4)}
           for e in seen]
    grew = {k: per[-1][k] - per[0][k] for k in ("threads", "fds", "rss_kib")} if per else {}
    return {"recoveries": len(per), "after_each": per, "growth_first_to_last": grew}


def readiness_cost(clean_events: list[dict] | None = None, checks: int = 2000) -> dict:
    """What being ready costs a healthy step: one store check per step (``membership.changed``,
    timed here against a loopback TCPStore), beside the median step of a clean run when given.
    The beat thread adds one store write per 0.2 s off the training thread."""
    import statistics
    import time

    import torch.distributed as dist

    from ckpt.inprocess import membership

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = membership.of_attempt(dist.TCPStore("127.0.0.1", server.port, is_master=False), 0, os.urandom(32))
    t0 = time.perf_counter()
    for _ in range(checks):
        membership.changed(client, 0)
    per_check = (time.perf_counter() - t0) / checks
    out = {"check_per_step_s": per_check}
    if clean_events:
        ts = sorted(e["t"] for e in clean_events if e["event"] == "step" and e["worker"] == 0)
        step = statistics.median(b - a for a, b in zip(ts, ts[1:]))
        out.update(median_step_s=step, cost_share_of_step=per_check / step)
    return out
