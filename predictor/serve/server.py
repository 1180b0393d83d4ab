"""`predictor serve`: ingest, risk, jobs and their "checkpoint now" stream, /metrics.

aiohttp on one event loop: handlers only read, decode and validate a batch (cheap,
Arrow), then hand it to the scoring queue (scoring_queue.py) and answer once its
rows are scored. Each pass's results fan out here to job streams (SSE) and to the
strict-threshold alerts.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from aiohttp import web

from predictor.alerts.alertmanager import StrictAlerts
from predictor.ingest import wire
from predictor.ingest.auth import Tokens
from predictor.ingest.batch_ids import BatchIds
from predictor.model.job_risk import NodeCalibration, node_scores
from predictor.model.model_io import Model
from predictor.model.scoring import Scored, Scorer
from predictor.serve.jobs import (
    DEFAULT_LIMITS,
    LISTENER_QUEUE,
    JobLimits,
    JobRegistry,
    JobRisks,
    Refused,
    parse_registration,
)
from predictor.serve.metrics import ServiceMetrics
from predictor.serve.scoring_queue import ScoringQueue, Stopping
from predictor.serve.strict_json import strict_dumps
from telemetry.schema import is_critical_xid
from telemetry.wire import TELEMETRY_KEYS, XID_KEYS

log = logging.getLogger(__name__)
MAX_PENDING_SAMPLES = 2_000_000      # beyond this, ask senders to back off (429)
#: Distinct node names the service keeps state for (a few KB each, for good): serve --max-nodes.
MAX_NODES = 100_000
KEEPALIVE_S = 15.0
ROUTE_ROLES = {                      # who may call what (the invariant in ARCHITECTURE.md)
    "ingest": {"agent", "operator"},
    "jobs": {"job", "operator"},
    "risk": {"operator"},
}


class Service:
    """The state behind the HTTP app: scorer, queue, jobs, alerts, metrics."""

    def __init__(self, model: Model, tokens: Tokens | None, max_body: int = 16 * 2**20,
                 alerts: StrictAlerts | None = None, max_ahead_s: float = wire.MAX_AHEAD_S,
                 max_nodes: int = MAX_NODES, job_limits: JobLimits = DEFAULT_LIMITS):
        self.scorer = Scorer(model)
        self.job_risks = JobRisks(self.scorer, NodeCalibration.of(model))
        self.tokens = tokens
        self.max_body = max_body
        self.max_ahead_s = max_ahead_s
        self.max_nodes, self.nodes = max_nodes, set()   # nodes admitted: scored or queued
        self.jobs = JobRegistry(job_limits)
        self.metrics = ServiceMetrics(self)
        self.alerts = alerts or StrictAlerts(None, None)
        self.alerts.on_delivery = self.metrics.alert_delivered
        self.batch_ids = BatchIds()
        self.queue = ScoringQueue(self.scorer, self.metrics, self._publish)

    # ------------------------------------------------------------ lifecycle
    async def start(self, _app=None) -> None:
        self.queue.start()
        await self.alerts.start()

    async def stop(self, _app=None) -> None:
        self.queue.stop()
        for job_id in list(self.jobs.jobs):
            self.jobs.remove(job_id)
        await self.alerts.stop()

    # ------------------------------------------------------------ auth
    def _require(self, request: web.Request, route: str) -> None:
        if self.tokens is None:
            return
        role = self.tokens.role_of(request.headers.get("Authorization"))
        if role is None:
            self.metrics.refused(route, "unauthorized")
            raise _json_error(web.HTTPUnauthorized, "missing or unknown bearer token",
                              headers={"WWW-Authenticate": "Bearer"})
        if role not in ROUTE_ROLES[route]:
            self.metrics.refused(route, "forbidden")
            raise _json_error(web.HTTPForbidden, f"a {role} token may not call this endpoint")

    # ------------------------------------------------------------ ingest
    async def ingest(self, request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        self._require(request, "ingest")
        batch_id = request.headers.get("X-Batch-Id", "").strip()
        if not batch_id or len(batch_id) > 128:
            self.metrics.batch(kind, "malformed")
            raise _json_error(web.HTTPBadRequest, "X-Batch-Id header missing (or longer than 128 characters)")
        if not await self.batch_ids.claim(batch_id):
            self.metrics.batch(kind, "duplicate")
            return _json_response({"accepted": 0, "duplicate": True})
        taken = False
        try:
            table = await self._batch(request, kind)
            self._admit_nodes(table, kind)
            if self.queue.pending_rows + table.num_rows > MAX_PENDING_SAMPLES:
                self.metrics.batch(kind, "throttled")
                raise _json_error(web.HTTPTooManyRequests, "scoring is behind; retry later",
                                  headers={"Retry-After": "1"})
            try:
                scored = self.queue.submit(kind, table)
            except Stopping:                       # queued now, it would never be scored
                raise _unavailable() from None
            taken = True
        finally:
            self.batch_ids.settle(batch_id, taken)
        self.metrics.batch(kind, "accepted", table.num_rows)
        if kind == "xid":
            self._announce_failures(table)
        try:
            await scored
        except Stopping:
            raise _unavailable() from None
        return _json_response({"accepted": table.num_rows}, status=202)

    def _admit_nodes(self, table: pa.Table, kind: str) -> None:
        """429 for a batch that would take the service past --max-nodes distinct nodes: each
        costs state for good, so the bound holds before it is spent (known nodes still flow)."""
        new = [n for n in pc.unique(table.column("node")).to_pylist() if n not in self.nodes]
        if not new:
            return
        if len(self.nodes) + len(new) > self.max_nodes:
            self.metrics.batch(kind, "node_limit")
            log.warning("refused a %s batch: %d new node(s) (%r ...) past --max-nodes %d", kind, len(new), new[0],
                        self.max_nodes)
            raise _json_error(web.HTTPTooManyRequests, f"{len(new)} new node(s) ({new[0]!r} ...) would take this "
                              f"service past serve --max-nodes {self.max_nodes} distinct nodes",
                              headers={"Retry-After": "300"})
        self.nodes.update(new)

    def _announce_failures(self, table: pa.Table) -> None:
        """A critical XID means a lost GPU: the jobs on its node hear "node_failed" now, not
        after scoring (the job stops at once; a lost GPU never reaches a step boundary)."""
        seen = set()
        sampled = wire.timestamps_ms(table.column("timestamp")).tolist()  # when the agent saw it
        for node, gpu, xid, at in zip(*(table.column(k).to_pylist() for k in ("node", "gpu", "xid")), sampled):
            if is_critical_xid(xid) and node not in seen:
                seen.add(node)
                payload = {"event": "node_failed", "node": node, "gpu": gpu, "xid": xid,
                           "reason": f"critical XID {xid} on GPU {gpu}", "sampled_at_ms": at,
                           "sent_at_ms": int(time.time() * 1000)}
                if self.jobs.fail(node, payload):
                    log.warning("node %s failed (XID %d on GPU %d): told its jobs", node, xid, gpu)

    async def _batch(self, request: web.Request, kind: str) -> pa.Table:
        """The request's whole body as a validated table, or an HTTP error that says why."""
        keys = TELEMETRY_KEYS if kind == "telemetry" else XID_KEYS
        if request.content_length is not None and request.content_length > self.max_body:
            self.metrics.batch(kind, "too_large")
            raise _json_error(web.HTTPRequestEntityTooLarge,
                              f"body of {request.content_length} bytes is over the {self.max_body}-byte cap; split it")
        try:
            body = await _read_body(request, self.max_body)
            table = wire.decode(wire.decompress(body, request.headers.get("Content-Encoding"), self.max_body),
                                request.headers.get("Content-Type"), keys)
            wire.check_not_ahead(table, int(time.time() * 1000), self.max_ahead_s)
        except wire.TooLarge as e:
            self.metrics.batch(kind, "too_large")
            raise _json_error(web.HTTPRequestEntityTooLarge, str(e)) from None
        except wire.BadBatch as e:
            self.metrics.batch(kind, "malformed")
            raise _json_error(web.HTTPBadRequest, str(e)) from None
        return table

    async def _publish(self, before: np.ndarray, scored: Scored) -> None:
        """Crossings of the sensitive threshold → job streams; strict threshold → alerts."""
        if not len(scored.slots):
            return
        slots, risk = scored.slots, scored.risk
        peak = np.zeros(len(self.scorer.risk))
        np.maximum.at(peak, slots, risk)
        prev = np.zeros(len(peak))
        prev[: len(before)] = before
        sens = self.scorer.model.sensitive
        touched = np.unique(slots)
        state = self.scorer.state
        for slot in touched[(peak[touched] >= sens) & (prev[touched] < sens)].tolist():
            node, gpu = state.slot_key[slot]
            rows = np.flatnonzero(slots == slot)
            top = int(rows[np.argmax(risk[rows])])  # the row that crossed: a later one in the batch may be lower
            payload = {"event": "checkpoint", "node": node, "gpu": gpu, "risk": round(float(peak[slot]), 6),
                       "reason": scored.reasons[top], "sensitive": sens,
                       "sent_at_ms": int(time.time() * 1000)}
            for _ in self.jobs.notify(node, payload):
                self.metrics.checkpoint_sent()
        self._publish_job_risk({state.slot_key[s][0] for s in touched.tolist()})
        strict = self.scorer.model.strict
        now = self.scorer.risk[touched]
        changed = touched[(now >= strict) | np.isin(touched, self._firing_slots())]
        await self.alerts.observe([(state.slot_key[s][0], state.slot_key[s][1], state.uuid[s],
                                    float(self.scorer.risk[s]), self.scorer.reason.get(s, ""),
                                    bool(self.scorer.risk[s] >= strict)) for s in changed.tolist()])

    def _publish_job_risk(self, nodes: set[str]) -> None:
        """A "risk" event to each job with a node just scored, if its probability moved enough."""
        if self.job_risks.calibration is None or not self.jobs.jobs:
            return
        job_ids = set().union(*(self.jobs.by_node.get(n, ()) for n in nodes))
        if not job_ids:
            return
        scores = node_scores(self.scorer)
        for job_id in job_ids:
            job = self.jobs.jobs.get(job_id)
            if job is not None:
                self.jobs.risk(job, self.job_risks.of(job, scores))

    def _firing_slots(self) -> np.ndarray:
        of = self.scorer.state.slot_of
        return np.asarray([of[k] for k in self.alerts.firing], dtype=np.int64)

    # ------------------------------------------------------------ risk
    async def risk(self, request: web.Request) -> web.Response:
        job_id = request.query.get("job")
        if job_id is not None:                  # a job's own risk: its job token may read it
            return _json_response(self.job_risks.of(self._job(request, job_id)))
        self._require(request, "risk")
        node = request.query.get("node")
        if not node:
            at_risk = [r for r in map(self.scorer.node_risk, list(self.scorer.state.node_names))
                       if r and r["risk"] >= self.scorer.model.sensitive]
            return _json_response({"nodes": at_risk,
                                      "sensitive": self.scorer.model.sensitive, "strict": self.scorer.model.strict})
        r = self.scorer.node_risk(node)
        if r is None:
            raise _json_error(web.HTTPNotFound, f"no telemetry seen from node {node!r}")
        return _json_response(r)

    # ------------------------------------------------------------ jobs
    async def register_job(self, request: web.Request) -> web.Response:
        self._require(request, "jobs")
        try:
            body = await request.json()
        except (ValueError, RecursionError):     # not JSON, not UTF-8, nested past the parser's depth
            raise _json_error(web.HTTPBadRequest, "body must be JSON: {\"nodes\": [...]}") from None
        try:
            nodes, name, interval = parse_registration(body, self.jobs.limits)
            owner = self.tokens.owner_of(request.headers.get("Authorization")) if self.tokens else ""
            job = self.jobs.register(nodes, name, interval, owner)
        except Refused as e:
            retry = {"Retry-After": "60"} if e.status == 429 else None
            raise _json_error(REFUSED[e.status], str(e), headers=retry) from None
        return _json_response(job.public(), status=201)

    def _job(self, request: web.Request, job_id: str | None = None):
        """The job ``job_id`` (default: named in the path), if this token may see it: a job token
        only the jobs it registered, an operator token any (it cleans up after jobs that are
        gone). Another token's job answers 404 as an absent one does: ids cannot be probed."""
        self._require(request, "jobs")
        job = self.jobs.jobs.get(job_id or request.match_info["job_id"])
        if job is not None and self.tokens is not None:
            auth = request.headers.get("Authorization")
            if self.tokens.role_of(auth) != "operator" and job.owner != self.tokens.owner_of(auth):
                self.metrics.refused("jobs", "not_owner")
                job = None
        if job is None:
            raise _json_error(web.HTTPNotFound, "no such job")
        return job

    async def get_job(self, request: web.Request) -> web.Response:
        return _json_response(self._job(request).public())

    async def delete_job(self, request: web.Request) -> web.Response:
        job = self._job(request)
        self.jobs.remove(job.id)
        self.job_risks.forget(job.id)
        return _json_response({"deleted": job.id})

    async def job_events(self, request: web.Request) -> web.StreamResponse:
        """SSE: `hello` on connect, `checkpoint` and `node_failed` events, comment keep-alives."""
        job = self._job(request)
        q: asyncio.Queue = asyncio.Queue(LISTENER_QUEUE)
        job.listeners.add(q)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            hello = {"job": job.id, "nodes": len(job.nodes), "sensitive": self.scorer.model.sensitive,
                     "at_risk": [r for r in (self.scorer.node_risk(n) for n in sorted(job.nodes))
                                 if r and r["risk"] >= self.scorer.model.sensitive],
                     "risk": self.job_risks.of(job)}
            await resp.write(_sse("hello", hello))
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    await resp.write(b": keep-alive\n\n")
                    continue
                if event is None:                  # job deleted
                    await resp.write(_sse("closed", {"job": job.id}))
                    break
                await resp.write(_sse(event["event"], event, event["event_id"]))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            job.listeners.discard(q)
        return resp

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def health(self, _request: web.Request) -> web.Response:
        return _json_response({"ok": True, "gpus": len(self.scorer.state.slot_key),
                                  "pending_samples": self.queue.pending_rows})


async def _read_body(request: web.Request, cap: int) -> bytes:
    """All of the body, however many TCP reads it arrives in, or TooLarge past `cap` bytes
    (`content.read(n)` alone answers with what is buffered, not the whole body)."""
    body = bytearray()
    while True:
        part = await request.content.read(cap + 1 - len(body))
        if not part:
            return bytes(body)
        body += part
        if len(body) > cap:
            raise wire.TooLarge(f"body is over the {cap}-byte cap; split it")


def _sse(event: str, data: dict, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {strict_dumps(data)}\n\n".encode()


_json_response = functools.partial(web.json_response, dumps=strict_dumps)
REFUSED = {400: web.HTTPBadRequest, 413: web.HTTPRequestEntityTooLarge, 429: web.HTTPTooManyRequests}


def _unavailable() -> web.HTTPException:
    return _json_error(web.HTTPServiceUnavailable, "shutting down; retry", headers={"Retry-After": "1"})


def _json_error(cls, reason: str, headers: dict | None = None) -> web.HTTPException:
    body = {"text": json.dumps({"error": reason}), "content_type": "application/json", "headers": headers}
    if cls is web.HTTPRequestEntityTooLarge:        # its constructor wants the sizes; the text says them
        return cls(max_size=0, actual_size=0, **body)
    return cls(**body)


def make_app(service: Service) -> web.Application:
    """The aiohttp application; the body cap is enforced by the ingest handler itself."""
    app = web.Application(client_max_size=service.max_body + 1)
    app.router.add_post("/v1/{kind:telemetry|xid}", service.ingest)
    app.router.add_get("/v1/risk", service.risk)
    app.router.add_post("/v1/jobs", service.register_job)
    app.router.add_get("/v1/jobs/{job_id}", service.get_job)
    app.router.add_delete("/v1/jobs/{job_id}", service.delete_job)
    app.router.add_get("/v1/jobs/{job_id}/events", service.job_events)
    app.router.add_get("/metrics", service.metrics_endpoint)
    app.router.add_get("/healthz", service.health)
    app.on_startup.append(service.start)
    app.on_shutdown.append(service.stop)
    return app


class CannotListen(RuntimeError):
    """The address is taken or not this machine's: said in one line, not a traceback."""


def run(model: Model, host: str = "127.0.0.1", port: int = 9410, tokens: Tokens | None = None,
        max_body: int = 16 * 2**20, alertmanager_url: str | None = None, webhook_url: str | None = None,
        resend_s: float = 60.0, max_ahead_s: float = wire.MAX_AHEAD_S, max_nodes: int = MAX_NODES,
        job_limits: JobLimits = DEFAULT_LIMITS) -> None:
    """Serve until interrupted."""
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    alerts = StrictAlerts(alertmanager_url, webhook_url, resend_s)
    service = Service(model, tokens, max_body, alerts, max_ahead_s, max_nodes, job_limits)
    # auto_decompress off: wire.decompress inflates gzip itself, under the size cap
    web.run_app(make_app(service), sock=sock, access_log=None, auto_decompress=False,
                print=lambda msg: log.info("listening on http://%s:%d (auth %s)", host, port,
                                           "on" if tokens else "OFF"))
