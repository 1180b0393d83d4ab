"""Restart timing: where the seconds between a fault and the first resumed step go.

A restart spans two generations of processes: the one that failed and the one torchrun
starts. Each writes what it knows to a small file per node, in the job's shared-memory
namespace (node-local; it outlives the processes, not the node):

* the failing generation: when the fault happened and when it was detected (the hang
  detector, a "node failed" event, or a rank that died of an exception), and when each
  rank left (or was SIGKILLed by a peer);
* the new generation marks, in memory, its own start (the kernel's process start
  time), ``init_process_group`` and the restore.

At the new generation's start every rank reads its node's file and one gather brings
everything to rank 0, which logs one line per restart once the first step is done::

    restart timing: {"cause": "...", "detect_s": 4.1, "exit_s": 0.3, "relaunch_s": 1.2, ...}

Phases are consecutive, so they add up to ``total_s``: detect (fault -> detected), exit
(-> the last rank of the old generation left), agent (-> the newest torchrun agent's
process started: a replacement node's, whose arrival is the scheduler's cost; null when
every agent survived), relaunch (-> the last new process started: torchrun's monitor,
stop, rendezvous and spawn; for a replacement agent, its own start-up too), startup (-> init_process_group
called: interpreter and imports), pg_init, setup (-> restore started: model, checkpoint
manager), restore, first_step (-> the first resumed step done). Each mark is the slowest
rank's: the collectives wait for it. A phase whose mark is missing (a lost node's file,
a process without restore) merges into the next one.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from .process_identity import boot_time, started

log = logging.getLogger(__name__)

EVENTS_FILE = "restarts.jsonl"
_COMPACT_BYTES = 1 << 20  # rewrite the node's file beyond this (a few KB per restart)
PHASES = ("detect", "exit", "agent", "relaunch", "startup", "pg_init", "setup", "restore", "first_step")
_marks: dict[str, float] = {}  # this process's own marks (wall clock, seconds)


def mark(name: str) -> None:
    """Note when this process reached ``name`` (``pg_init_start``, ``restore_done``...)."""
    _marks[name] = time.time()


def process_marks() -> dict[str, float]:
    """This process's marks, with its start time and (under torchrun) its agent's, from the kernel."""
    times = {"started": process_start_time(),
             "agent_started": process_start_time(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else None}
    return {**_marks, **{k: t for k, t in times.items() if t is not None}}


def process_start_time(pid: int | None = None) -> float | None:
    """When ``pid`` (this process) started, as epoch seconds (to the kernel's clock tick)."""
    ticks, boot = started(pid or os.getpid()), boot_time()
    return boot + int(ticks) / os.sysconf("SC_CLK_TCK") if ticks and boot is not None else None


class RestartRecorder:
    """Appends this generation's fault and exit records to the node's file (``path``;
    None: records nothing). One short line per ``write``: atomic with O_APPEND."""

    def __init__(self, path: Path | None, incarnation: str, rank: int, node: str) -> None:
        self.path, self.incarnation, self.rank, self.node = path, incarnation, rank, node

    def fault(self, cause: str, fault_t: float, culprits: list[str] | tuple[str, ...] = ()) -> None:
        """Detected now; ``fault_t``: when it happened, as well as the detector knows;
        ``culprits``: the nodes to blame (a hung rank's, a failed one), if any."""
        self._append({"ev": "fault", "t": fault_t, "detected": time.time(), "cause": cause,
                      "culprits": sorted(set(culprits))})

    def left(self, rank: int | None = None) -> None:
        """``rank`` (this one by default) leaves now: exits, or is SIGKILLed by this one."""
        self._append({"ev": "exit", "t": time.time(), "rank": self.rank if rank is None else rank})

    def _append(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps({"inc": self.incarnation, "rank": self.rank, "node": self.node, **record}) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:  # timing is a diagnostic: never fail a fault path for it
            log.debug("restart timing: cannot record to %s: %s", self.path, e)


def culprit_nodes(records: list[dict]) -> list[str]:
    """The nodes the old generation's faults blame."""
    return sorted({node for r in records if r.get("ev") == "fault" for node in r.get("culprits", ())})


def previous_records(path: Path | None) -> list[dict]:
    """The newest generation's records in this node's file, read before this generation
    wrote any (the file is compacted to those once it grows large)."""
    if path is None:
        return []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut by a full /dev/shm: skip it
            continue
    newest = records[-1].get("inc") if records else None
    mine = [r for r in records if r.get("inc") == newest]
    if len(lines) > 16 and sum(map(len, lines)) > _COMPACT_BYTES:
        _compact(path, mine)
    return mine


def _compact(path: Path, keep: list[dict]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("restart timing: cannot compact %s: %s", path, e)


def restart_reporter(records: list[dict], marks: list[dict[str, float]]) -> Callable[[float | None], None]:
    """What rank 0 calls at the first resumed step (its time; None when unknown): logs
    the restart's timing, one line."""
    def report(first_step_t: float | None) -> None:
        log.warning("restart timing: %s", json.dumps(summarize(records, marks, first_step_t)))
    return report


def summarize(records: list[dict], marks: list[dict[str, float]], first_step_t: float | None) -> dict:
    """One restart's phases (seconds, see the module docstring) from the old generation's
    ``records`` (every node's) and the new one's ``marks`` (every rank's)."""
    faults = sorted((r for r in records if r.get("ev") == "fault"), key=lambda r: r["detected"])
    exits = [r["t"] for r in records if r.get("ev") == "exit"]

    def slowest(name: str) -> float | None:
        values = [m[name] for m in marks if name in m]
        return max(values) if values else None

    fault_t = min(f["t"] for f in faults) if faults else None
    agent_t = slowest("agent_started")  # an agent older than the fault survived it: no agent phase
    points = [("fault", fault_t), ("detect", faults[0]["detected"] if faults else None),
              ("exit", max(exits) if exits else None),
              ("agent", agent_t if agent_t is not None and fault_t is not None and agent_t > fault_t else None),
              ("relaunch", slowest("started")), ("startup", slowest("pg_init_start")),
              ("pg_init", slowest("pg_init_done")), ("setup", slowest("restore_start")),
              ("restore", slowest("restore_done")), ("first_step", first_step_t)]
    out: dict = {"cause": faults[0]["cause"] if faults else "unknown (no record of the fault: a lost node?)",
                 "culprit_nodes": culprit_nodes(records)}
    previous = None
    for name, t in points:
        if name != "fault":
            out[f"{name}_s"] = None if t is None or previous is None else round(t - previous, 3)
        if t is not None:
            previous = t
    known = [t for _, t in points if t is not None]
    out["total_s"] = round(known[-1] - points[0][1], 3) if points[0][1] is not None and first_step_t else None
    return out
