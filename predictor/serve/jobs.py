"""Training jobs registered for "checkpoint now", and the queues of their listeners.

A job names its nodes; when any of them crosses the sensitive threshold every
listener of the job gets one event, at most once per `min_interval_s` per job (a
job that has just checkpointed gains nothing from another urgent save). A node whose
GPU is lost (a critical XID) gets its jobs a "node_failed" event at once, unlimited.
The job's failure probability (model/job_risk.py) goes out as a "risk" event when it has
moved enough since the last one sent (a step, not a period: a rise is never held back,
and a risk that stays put sends nothing).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from predictor.model.job_risk import NodeCalibration, job_risk, node_scores
from predictor.model.scoring import Scorer

DEFAULT_MIN_INTERVAL_S = 60.0
MAX_INTERVAL_S = 7 * 86_400.0        # "at most one checkpoint a week" is the longest sensible limit
MAX_NODE_NAME = 253                  # a DNS name's length
MAX_JOB_NAME = 200
LISTENER_QUEUE = 64
#: A "risk" event goes out when the probability moved this much (absolute) or the hazard
#: ratio by this factor since the last one sent.
RISK_STEP_P = 0.02
RISK_STEP_RATIO = 1.25


@dataclass(frozen=True)
class JobLimits:
    """What registered jobs may cost the service (`predictor serve --max-jobs-per-token ...`):
    a job token cannot grow its memory without bound (25 jobs of 100,000 nodes: ~1 GB)."""
    per_token: int = 16              # live jobs registered with one token
    nodes_per_job: int = 100_000
    total_nodes: int = 1_000_000     # node entries over all jobs


DEFAULT_LIMITS = JobLimits()


class Refused(ValueError):
    """A registration the service will not take; ``status`` is the HTTP answer (400, 413, 429)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_registration(body: object, limits: JobLimits) -> tuple[list[str], str, float]:
    """(nodes, name, min_interval_s) of a POST /v1/jobs body, or Refused saying why."""
    nodes = body.get("nodes") if isinstance(body, dict) else None
    if not isinstance(nodes, list) or not nodes:
        raise Refused(400, "\"nodes\" must be a non-empty list of node names")
    if len(nodes) > limits.nodes_per_job:
        raise Refused(413, f"{len(nodes)} nodes: a job may name at most {limits.nodes_per_job} "
                           "(predictor serve --max-nodes-per-job)")
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_NODE_NAME for n in nodes):
        raise Refused(400, f"\"nodes\" must be node names (strings of 1 to {MAX_NODE_NAME} characters)")
    interval = body.get("min_interval_s", DEFAULT_MIN_INTERVAL_S)
    if (not isinstance(interval, (int, float)) or isinstance(interval, bool) or not math.isfinite(interval)
            or not 0 <= interval <= MAX_INTERVAL_S):
        raise Refused(400, f"\"min_interval_s\" must be a finite number of seconds from 0 to {MAX_INTERVAL_S:.0f} "
                           f"(got {interval!r})")
    name = body.get("name", "")
    if not isinstance(name, str):
        raise Refused(400, "\"name\" must be a string")
    return nodes, name[:MAX_JOB_NAME], float(interval)


@dataclass
class Job:
    id: str
    name: str
    nodes: frozenset[str]
    min_interval_s: float
    created: float = field(default_factory=time.time)
    last_sent: float = float("-inf")
    sent: int = 0
    suppressed: int = 0
    listeners: set[asyncio.Queue] = field(default_factory=set)
    risk_sent: dict | None = None
    owner: str = ""                  # who registered it (a token's digest): the per-token cap

    def public(self) -> dict:
        return {"id": self.id, "name": self.name, "nodes": sorted(self.nodes), "min_interval_s": self.min_interval_s,
                "created": self.created, "checkpoints_sent": self.sent, "checkpoints_suppressed": self.suppressed,
                "listeners": len(self.listeners), "stream": f"/v1/jobs/{self.id}/events"}


class JobRegistry:
    """Jobs by id and by node; `notify` fans an event out to the listeners of affected jobs."""

    def __init__(self, limits: JobLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.jobs: dict[str, Job] = {}
        self.by_node: dict[str, set[str]] = {}
        self.node_entries = 0
        self._event_ids = itertools.count(1)

    def register(self, nodes: list[str], name: str = "", min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
                 owner: str = "") -> Job:
        """A new job, or Refused (429) past the per-token or total limit."""
        distinct = frozenset(nodes)
        mine = sum(j.owner == owner for j in self.jobs.values())
        if mine >= self.limits.per_token:
            raise Refused(429, f"this token has {mine} jobs registered, the limit is {self.limits.per_token} "
                               "(predictor serve --max-jobs-per-token): delete finished ones")
        if self.node_entries + len(distinct) > self.limits.total_nodes:
            raise Refused(429, f"{len(distinct)} more nodes would take the registered jobs past "
                               f"{self.limits.total_nodes} nodes in all (predictor serve --max-job-nodes)")
        job = Job(uuid.uuid4().hex, name, distinct, float(min_interval_s), owner=owner)
        self.jobs[job.id] = job
        self.node_entries += len(distinct)
        for n in job.nodes:
            self.by_node.setdefault(n, set()).add(job.id)
        return job

    def remove(self, job_id: str) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job:
            self.node_entries -= len(job.nodes)
            for n in job.nodes:
                self.by_node.get(n, set()).discard(job.id)
            for q in job.listeners:
                q.put_nowait(None)            # tells the stream to end
        return job

    def notify(self, node: str, payload: dict, now: float | None = None) -> list[Job]:
        """Send "checkpoint now" to the jobs on `node`, each subject to its rate limit."""
        now = time.monotonic() if now is None else now
        sent = []
        for job_id in self.by_node.get(node, ()):
            job = self.jobs[job_id]
            if now - job.last_sent < job.min_interval_s:
                job.suppressed += 1
                continue
            job.last_sent = now
            job.sent += 1
            self._send(job, payload)
            sent.append(job)
        return sent

    def fail(self, node: str, payload: dict) -> list[Job]:
        """Send "node failed" to the jobs on `node`: never rate-limited (the job must stop now)."""
        jobs = [self.jobs[job_id] for job_id in self.by_node.get(node, ())]
        for job in jobs:
            self._send(job, payload)
        return jobs

    def risk(self, job: Job, risk: dict) -> bool:
        """Send the job's risk if it moved enough since the last "risk" event (see module doc)."""
        if job.risk_sent is not None and not _moved(job.risk_sent, risk):
            return False
        job.risk_sent = risk
        self._send(job, {"event": "risk", **risk})
        return True

    def _send(self, job: Job, payload: dict) -> None:
        event = {"event_id": next(self._event_ids), "job": job.id, **payload}
        for q in list(job.listeners):
            if q.full():                 # a listener that stopped reading loses its oldest event
                q.get_nowait()
            q.put_nowait(event)


def _moved(last: dict, now: dict) -> bool:
    if abs(now["probability"] - last["probability"]) >= RISK_STEP_P:
        return True
    a, b = last.get("hazard_ratio") or 0.0, now.get("hazard_ratio") or 0.0
    return max(a, b) > 0 and max(a, b) >= RISK_STEP_RATIO * min(a, b)


class JobRisks:
    """The live job risk the service states (/v1/risk?job=, "risk" events, metrics): each
    job's node probabilities from the scorer's node scores through the model's calibration;
    a node never heard from counts at the base rate."""

    def __init__(self, scorer: Scorer, calibration: NodeCalibration | None) -> None:
        self.scorer, self.calibration = scorer, calibration
        self._node_ids: dict[str, tuple[int, list[str], np.ndarray]] = {}

    def of(self, job: Job, scores: np.ndarray | None = None) -> dict:
        """P(any node of ``job`` fails within the horizon), with its base rate and top nodes."""
        cal = self.calibration
        if cal is None:
            return {"job": job.id, "calibrated": False,
                    "error": "the model has no node calibration: run `predictor calibrate` on it"}
        scores = node_scores(self.scorer) if scores is None else scores
        names, ids = self._ids(job)
        s = np.full(len(ids), np.nan)
        known = (ids >= 0) & (ids < len(scores))
        s[known] = scores[ids[known]]
        p = np.where(np.isnan(s), cal.base_probability, cal.probability(np.nan_to_num(s)))
        top = np.argsort(-p, kind="stable")[:3]
        return {"job": job.id, "calibrated": True, **job_risk(p, cal), "unseen_nodes": int((~known).sum()),
                "top_nodes": [{"node": names[i], "probability": round(float(p[i]), 6)} for i in top.tolist()],
                "sent_at_ms": int(time.time() * 1000)}

    def forget(self, job_id: str) -> None:
        self._node_ids.pop(job_id, None)

    def _ids(self, job: Job) -> tuple[list[str], np.ndarray]:
        """The job's node names, sorted, and their scorer node ids (-1: not seen yet); cached
        until new nodes appear (a job may have 100,000 nodes and a pass comes every few ms)."""
        seen = len(self.scorer.state.node_names)
        cached = self._node_ids.get(job.id)
        if cached is None or cached[0] != seen:
            of = self.scorer.state.node_of
            names = cached[1] if cached else sorted(job.nodes)
            cached = (seen, names, np.fromiter((of.get(n, -1) for n in names), np.int64, len(names)))
            self._node_ids[job.id] = cached
        return cached[1], cached[2]
