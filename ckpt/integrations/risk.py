"""Listening to the failure predictor: register the job's nodes, turn "checkpoint now"
events into urgent-save requests, and keep training going when the predictor is away.

Talks to ``predictor serve`` over its documented HTTP API only (``POST /v1/jobs``, the
SSE stream ``GET /v1/jobs/{id}/events``), with the standard library, so the checkpoint
engine never imports the predictor. One rank (rank 0) listens; ``mgr.agree()`` at the
next step boundary makes every rank save the same step.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Callable, Iterator

from .urgency import SaveRequests

log = logging.getLogger(__name__)
TOKEN_ENV = "CKPT_GUARD_JOB_TOKEN"  # the predictor server reads the same name
_OLD_TOKEN_ENV = "CKPT_PREDICTOR_TOKEN"  # before one prefix: still read, with a warning


def read_token(token_file: str | os.PathLike | None = None) -> str | None:
    """The job token: from a file, else from $CKPT_GUARD_JOB_TOKEN (never from argv)."""
    if token_file is not None:
        return Path(token_file).read_text().strip()
    if TOKEN_ENV not in os.environ and _OLD_TOKEN_ENV in os.environ:
        warnings.warn(f"${_OLD_TOKEN_ENV} is deprecated: use ${TOKEN_ENV}", FutureWarning, stacklevel=2)
        return os.environ[_OLD_TOKEN_ENV]
    return os.environ.get(TOKEN_ENV)


class RiskListener:
    """Background thread: registers ``nodes`` as one job and follows its event stream.

    ``requests.request()`` fires on every "checkpoint" event, ``on_node_failed`` on every
    "node_failed" one (a critical XID on a node of the job); ``elevated`` is True while
    a node of the job was reported at risk within ``elevated_s``; ``hazard_ratio`` is the
    job's hazard over its fleet's base rate from the predictor's latest "risk" event (None
    while unknown or the predictor is away), so a policy can scale the periodic interval
    by it (``IntervalPolicy.interval_at``). Any failure to reach the predictor is logged once per
    outage and retried with backoff; training never waits for it.
    """

    def __init__(self, url: str, nodes: list[str], requests: SaveRequests, *, token: str | None = None,
                 name: str = "", elevated_s: float = 900.0, timeout_s: float = 30.0) -> None:
        self.url, self.nodes, self.requests, self.name = url.rstrip("/"), sorted(set(nodes)), requests, name
        self.token, self.elevated_s, self.timeout_s = token, elevated_s, timeout_s
        self.job_id: str | None = None
        self.events: list[dict] = []  # "checkpoint" events received, for timelines
        self.on_node_failed: Callable[[dict], None] | None = None  # the job's reaction (loop.resumable sets it)
        self._last_risk = float("-inf")
        self._risky: dict[str, float] = {}  # node -> when it was last reported at risk
        self.risk: dict | None = None  # the latest job risk the predictor stated
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-risk-listener", daemon=True)

    @property
    def elevated(self) -> bool:
        return time.monotonic() - self._last_risk < self.elevated_s

    @property
    def at_risk_nodes(self) -> set[str]:
        """The nodes reported at risk within ``elevated_s`` (peer placement avoids them)."""
        now = time.monotonic()
        return {n for n, t in list(self._risky.items()) if now - t < self.elevated_s}

    @property
    def hazard_ratio(self) -> float | None:
        ratio = (self.risk or {}).get("hazard_ratio")
        return float(ratio) if isinstance(ratio, (int, float)) else None

    def start(self) -> "RiskListener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self.job_id is not None:
            try:
                self._call("DELETE", f"/v1/jobs/{self.job_id}")
            except (OSError, ValueError):
                pass

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(req, timeout=timeout or self.timeout_s)

    def _run(self) -> None:
        delay, down_since = 1.0, None
        while not self._stop.is_set():
            try:
                if self.job_id is None:
                    with self._call("POST", "/v1/jobs", {"nodes": self.nodes, "name": self.name}) as r:
                        self.job_id = json.loads(r.read())["id"]
                    log.info("registered with the predictor at %s as job %s (%d nodes)", self.url, self.job_id,
                             len(self.nodes))
                for event, data in self._stream():
                    delay, down_since = 1.0, None
                    self._handle(event, data)
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    self.job_id = None  # the predictor restarted and forgot the job: register again
                elif e.code in (401, 403):
                    log.warning("the predictor refused the job token (%d); training goes on without it", e.code)
                    return
                down_since = self._outage(down_since, e)
            except (OSError, ValueError, KeyError) as e:
                down_since = self._outage(down_since, e)
            self._stop.wait(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 60.0)

    def _outage(self, since: float | None, error: Exception) -> float:
        self.risk = None  # stale while away: the policy falls back to its own rate
        if since is None:
            log.warning("predictor at %s unreachable (%s); periodic checkpoints continue, retrying", self.url, error)
            return time.monotonic()
        return since

    def _handle(self, event: str, data: dict) -> None:
        if event == "hello" and data.get("at_risk"):
            self._last_risk = time.monotonic()
            self._risky.update({r["node"]: self._last_risk for r in data["at_risk"]
                                if isinstance(r, dict) and isinstance(r.get("node"), str)})
        if event == "hello" or event == "risk":
            risk = data.get("risk") if event == "hello" else data
            self.risk = risk if isinstance(risk, dict) and risk.get("calibrated") else None
        elif event == "checkpoint":
            self._last_risk = time.monotonic()
            if isinstance(data.get("node"), str):
                self._risky[data["node"]] = self._last_risk
            self.requests.request()  # before the event is recorded: whoever sees the event sees the request
            log.warning("predictor: node %s at risk (%s); requested an urgent checkpoint",
                        data.get("node"), data.get("reason") or data.get("reasons"))
            self.events.append({**data, "received": time.time()})
        elif event == "node_failed":
            log.critical("predictor: node %s failed (%s, sent %s ms ago); stopping the job", data.get("node"),
                         data.get("reason"), _age_ms(data))
            if self.on_node_failed is not None:
                self.on_node_failed(data)
        elif event == "closed":
            self.job_id = None

    def _stream(self) -> Iterator[tuple[str, dict]]:
        """Server-sent events of the job, as (event, data) pairs."""
        with self._call("GET", f"/v1/jobs/{self.job_id}/events", timeout=120.0) as resp:
            event, data = "message", []
            for raw in resp:
                if self._stop.is_set():
                    return
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if data:
                        yield event, json.loads("\n".join(data))
                    event, data = "message", []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())


def _age_ms(event: dict) -> str:
    sent = event.get("sent_at_ms")
    return f"{time.time() * 1000 - sent:.0f}" if isinstance(sent, (int, float)) else "?"
