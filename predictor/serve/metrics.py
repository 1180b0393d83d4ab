"""Prometheus metrics of the service, in a registry of its own (one per Service).

Per-GPU and per-node risk are read from the scorer's arrays at scrape time rather
than set per sample: at 50,000 samples/s, labelled gauge updates would cost more
than the scoring itself.
"""
from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from predictor.model.job_risk import node_scores
from predictor.model.scoring import Scorer
from predictor.serve.jobs import JobRegistry, JobRisks

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Queue(Protocol):
    @property
    def pending_rows(self) -> int: ...


class _Alerts(Protocol):
    @property
    def firing(self) -> Sized: ...


class Observed(Protocol):
    """What a scrape reads of the service: a Protocol, so that /metrics never imports the
    server (server -> scoring_queue -> metrics would close a circle)."""

    scorer: Scorer
    jobs: JobRegistry
    job_risks: JobRisks

    @property
    def queue(self) -> _Queue: ...

    @property
    def nodes(self) -> Sized: ...

    @property
    def alerts(self) -> _Alerts: ...


class _RiskCollector:
    def __init__(self, service: Observed):
        self.service = service

    def collect(self):
        sc = self.service.scorer
        st = sc.state
        # the scorer thread may be registering GPUs meanwhile: read a consistent prefix
        risk = sc.risk.copy()
        keys = st.slot_key[: len(risk)]
        risk = risk[: len(keys)]
        gpu = GaugeMetricFamily("predictor_gpu_risk", "Predicted probability that the GPU fails within the horizon",
                                labels=["node", "gpu"])
        for (node, g), r in zip(keys, risk.tolist()):
            gpu.add_metric([node, str(g)], r)
        yield gpu
        node = GaugeMetricFamily("predictor_node_risk", "Risk of the node's worst GPU", labels=["node"])
        for name, slots in list(zip(st.node_names, st.node_slots)):
            seen = [s for s in slots if s < len(risk)]
            if seen:
                node.add_metric([name], float(risk[seen].max()))
        yield node
        above = GaugeMetricFamily("predictor_gpus_at_risk", "GPUs at or above a threshold", labels=["threshold"])
        thr = GaugeMetricFamily("predictor_threshold", "The model's thresholds", labels=["threshold"])
        for name in ("sensitive", "strict"):
            value = getattr(sc.model, name)
            above.add_metric([name], float(np.sum(risk >= value)))
            thr.add_metric([name], value)
        yield above
        yield thr
        yield GaugeMetricFamily("predictor_pending_samples", "Samples accepted but not yet scored",
                                value=self.service.queue.pending_rows)
        yield GaugeMetricFamily("predictor_jobs", "Registered training jobs", value=len(self.service.jobs.jobs))
        yield GaugeMetricFamily("predictor_nodes", "Distinct nodes admitted (at most serve --max-nodes)",
                                value=len(self.service.nodes))
        yield GaugeMetricFamily("predictor_alerts_firing", "GPUs over the strict threshold, paged",
                                value=len(self.service.alerts.firing))
        yield from self._job_risk()

    def _job_risk(self):
        """Each registered job's calibrated risk (as on /v1/risk?job=), so dashboards and rules
        see what the jobs' checkpoint intervals follow; none without a node calibration."""
        svc = self.service
        yield GaugeMetricFamily("predictor_job_risk_calibrated",
                                "1 when the model states job-level risk (it has a node calibration)",
                                value=float(svc.job_risks.calibration is not None))
        labels = ["job_id", "job_name"]
        prob = GaugeMetricFamily("predictor_job_failure_probability",
                                 "P(a node of the job fails within the horizon), calibrated", labels=labels)
        base = GaugeMetricFamily("predictor_job_base_probability",
                                 "The same for as many nodes at the fleet's base rate", labels=labels)
        ratio = GaugeMetricFamily("predictor_job_hazard_ratio",
                                  "The job's failure hazard over as many nodes' at the base rate", labels=labels)
        jobs = list(svc.jobs.jobs.values())
        if svc.job_risks.calibration is not None and jobs:
            scores = node_scores(svc.scorer)
            for job in jobs:
                r = svc.job_risks.of(job, scores)
                prob.add_metric([job.id, job.name], r["probability"])
                base.add_metric([job.id, job.name], r["base_probability"])
                if r["hazard_ratio"] is not None:
                    ratio.add_metric([job.id, job.name], r["hazard_ratio"])
        yield from (prob, base, ratio)


class ServiceMetrics:
    """Counters and histograms the handlers and the scoring loop update."""

    def __init__(self, service: Observed):
        self.registry = CollectorRegistry()
        r = self.registry
        self._batches = Counter("predictor_batches", "Batches received, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self._refused = Counter("predictor_requests_refused", "Requests refused by auth", ["route", "why"], registry=r)
        self._rows = Counter("predictor_ingested_rows", "Rows accepted, by endpoint", ["endpoint"], registry=r)
        self._scored = Counter("predictor_scored_samples", "Samples scored", registry=r)
        self._dropped = Counter("predictor_dropped_samples", "Samples dropped as late or duplicate", registry=r)
        self._latency = Histogram("predictor_scoring_latency_seconds",
                                  "From a batch's receipt to its risk being published", buckets=LATENCY_BUCKETS,
                                  registry=r)
        self._cycle = Histogram("predictor_scoring_cycle_seconds", "One scoring pass over the queued batches",
                                buckets=LATENCY_BUCKETS, registry=r)
        self._checkpoints = Counter("predictor_checkpoint_events", "\"checkpoint now\" events sent to jobs", registry=r)
        self._deliveries = Counter("predictor_alert_deliveries", "Alert deliveries", ["target", "outcome"], registry=r)
        r.register(_RiskCollector(service))

    def batch(self, endpoint: str, outcome: str, rows: int = 0) -> None:
        self._batches.labels(endpoint, outcome).inc()
        if rows:
            self._rows.labels(endpoint).inc(rows)

    def refused(self, route: str, why: str) -> None:
        self._refused.labels(route, why).inc()

    def scored(self, samples: int, dropped: int) -> None:
        self._scored.inc(samples)
        if dropped:
            self._dropped.inc(dropped)

    def latency(self, seconds: float) -> None:
        self._latency.observe(seconds)

    def scoring_cycle(self, seconds: float) -> None:
        self._cycle.observe(seconds)

    def checkpoint_sent(self) -> None:
        self._checkpoints.inc()

    def alert_delivered(self, target: str, ok: bool) -> None:
        self._deliveries.labels(target, "ok" if ok else "failed").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
