"""The fault campaign's two-node rows (benchmarks/fault_campaign.py): two simulated nodes on
loopback, one rank each (tests/inprocess_nodes.py, the recovery benchmark's machinery), each
node its own memory tier and disk root, so a ``replicated=`` key has one copy on each node.

* lost_node / vanished_node: node 1 (1 rank + 1 spare per node, peer replicas) SIGKILLed, or
  SIGSTOPped, and its memory and disk removed: node 0's spare takes rank 1 from node 0's peer
  replica of it.
* peer_replica_wrong_at_save: as lost_node, but node 0 sealed its replica of rank 1's step
  ``FAULT_AT`` (or the first after) with one byte flipped after its chunks were checked
  (benchmarks/fault_campaign_hooks.py): the restore must refuse it and take another copy.
  Every rank saves its own copy of the model (``--own-copies``): with ``replicated=`` rank 1's
  shard holds nothing node 0's spare reads (the replicated keys come from rank 0's own copy),
  so a damaged replica of it would never be read.
* peer_holder_killed: node 1 SIGKILLed while it receives node 0's replica of step ``FAULT_AT``
  (held there by the hook): node 0's send is abandoned, and the job goes on.
* sdc_param_nodes / sdc_optim_nodes: the SDC rows with the two replicas on two nodes, so the
  replica comparison at the next save has two copies to compare.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from benchmarks.fault_campaign_jobs import DAMAGE_SEEN, FAULT_AT, MODEL, STEPS, Job
from benchmarks.fault_campaign_rows import Campaign, recovered, sdc_row
from tests.inprocess_nodes import lose_node_1, run_nodes

NODE_HANG_S = 2.0  # the recovery benchmark's (benchmarks/recovery_inprocess.py)
# a row whose node is SIGKILLed is caught by its lifeline, not by missed beats: a longer hang
# timeout keeps a loaded machine's late beats from losing node 1 before the fault
KILLED_HANG_S = 10.0
NODE = ["--nproc", "1", "--spares", "1"]


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _hook_event(events: list[dict]) -> dict | None:
    """The peer fault hook's ``fault`` event (the hook has done its fault), if any."""
    return next((e for e in events if e.get("event") == "fault" and "peer_fault" in e), None)


def _hook_fired(path: Path) -> bool:
    """The peer fault hook has done its fault."""
    return _hook_event(_events(path)) is not None


def _hook_fired_and_stepped(path: Path) -> bool:
    """``_hook_fired``, and a rank has finished the step after the damaged one: every rank's own
    snapshot of the damaged step is sealed by then (at the next step's forward, before its
    all-reduce), so the restore's newest common step is the damaged one. Killed sooner, it
    could be the step before, and the damaged replica would never be read."""
    events = _events(path)
    hook = _hook_event(events)
    return hook is not None and any(e.get("event") == "step" and e.get("step", 0) >= hook["step"] + 1
                                    for e in events)


def lose(c: Campaign, fault: str, silent: bool = False, child: tuple[str, ...] = (),
         hooked: Callable[[Path], bool] | None = None, hang_s: float = NODE_HANG_S) -> tuple[dict, Job]:
    """Node 1 lost (killed, or ``silent``: stopped) at ``FAULT_AT`` (and, ``hooked``, once it
    says so of the job's events: the peer fault hook has acted); the row as node 0 saw the
    recovery, and node 0's job."""
    shm, work = c.shm / fault, c.workdir / fault
    shm.mkdir()
    lost = lose_node_1(work, shm, NODE, [*MODEL, "--steps", str(STEPS), "--peers", "1", *child], at_step=FAULT_AT,
                       hang_s=hang_s, silent=silent,
                       also=(lambda: hooked(work / "events.jsonl")) if hooked else None)
    job = Job(lost.events, lost.log, 0)
    out = recovered(fault, job, c.clean(), r"node ?1|\b1\b")
    # a busy machine can miss node 1's beats before the fault: such a recovery is not this row's
    early = [r for r in job.of("recovery") if r["phases"].get("fault_time", lost.fault_t) < lost.fault_t - 0.5]
    hook = _hook_event(job.of("fault"))
    return {**out, "node1_workers_gone": lost.node1_workers_gone, "lost_before_fault": bool(early),
            **({"hook": {k: hook[k] for k in ("step", "peer_fault", "replica_of")}} if hook else {})}, job


def lost_node(c: Campaign, fault: str, silent: bool) -> dict:
    return lose(c, fault, silent)[0]


def peer_replica_wrong(c: Campaign, fault: str) -> dict:
    """Node 0's replica of rank 1 sealed wrong, then node 1 lost: ``detected`` is the restore
    refusing that replica (a damaged-shard or skipped-step line naming its step)."""
    out, job = lose(c, fault, child=("--kill-at", str(FAULT_AT), "--peer-fault", "wrong_at_save",
                                     "--peer-fault-node", "node0", "--own-copies"), hooked=_hook_fired_and_stepped,
                    hang_s=KILLED_HANG_S)
    bad = out["hook"]["step"] if "hook" in out else None
    refused = [x for x in job.log.splitlines() if DAMAGE_SEEN.search(x) and f"step {bad}" in x]
    return {**out, "detected": bool(refused), "detect_steps": 0 if refused else None, "named": None,
            "damaged_step": bad, "damage_lines": refused[:3]}


def peer_holder_killed(c: Campaign, fault: str) -> dict:
    """Node 1 killed while it receives node 0's replica: the row as lost_node's, with what node
    0's sender said of the send it lost."""
    out, job = lose(c, fault, child=("--kill-at", str(FAULT_AT), "--peer-fault", "stall_receive",
                                     "--peer-fault-node", "node1"), hooked=_hook_fired)
    said = [x for x in job.log.splitlines() if "abandoned" in x or "cut off" in x]
    return {**out, "sender_lines": said[:3]}


def sdc_nodes(c: Campaign, fault: str, kind: str) -> dict:
    """One bit flipped in rank 1's parameter or optimizer state at ``FAULT_AT``, its replica on
    the other node: the replica comparison must mark the next save suspect, name rank 1, and
    the job go back to the newest step whose replicas agreed, then end equal to the clean run
    (the flip happens once: the same restore schedule retrains it clean)."""
    work, shm = c.workdir / fault, c.shm / fault
    shm.mkdir()
    events, logs = run_nodes(work, shm, ["--nproc", "1"], [*MODEL, "--steps", str(STEPS), "--sdc", kind,
                                                           "--sdc-worker", "1", "--kill-at", str(FAULT_AT)])
    job = Job(events, "\n".join(logs), 0)
    recs = [r for r in job.of("recovery") if r["failed_at_step"] is not None]
    return {**sdc_row(fault, job, c.clean()), "reasons": [r["reason"] for r in recs][:2]}
