"""Prometheus ``/metrics`` in dcgm-exporter's names and labels, plus the agent's own counters.

Same metric names, types and labels (``gpu``, ``UUID``, ``device``,
``modelName``, ``Hostname``) as NVIDIA's dcgm-exporter, so an existing scrape
config, dashboard or alert rule works unchanged. The DCGM block is written by
hand because prometheus_client would append ``_total`` to counters whose DCGM
names must stay as they are; the agent's counters go through prometheus_client.
A GPU that stops reporting (failed, removed) leaves the page after ``stale_s``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agents.shm import ShmWatch
from agents.spool import Spool
from agents.stats import AgentStats
from ckpt.listening import MetricsServer
from telemetry import schema as S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name: (type, help) as in dcgm-exporter's default-counters.csv
DCGM_METRICS = {
    S.SM_CLOCK: ("gauge", "SM clock frequency (in MHz)."),
    S.GPU_TEMP: ("gauge", "GPU temperature (in C)."),
    S.MEMORY_TEMP: ("gauge", "Memory temperature (in C)."),
    S.POWER: ("gauge", "Power draw (in W)."),
    S.THROTTLE: ("gauge", "Current clock throttle reasons (bitmask)."),
    S.PCIE_REPLAY: ("counter", "Total number of PCIe retries."),
    S.SBE: ("counter", "Total number of single-bit volatile ECC errors."),
    S.DBE: ("counter", "Total number of double-bit volatile ECC errors."),
    S.REMAP_CORR: ("counter", "Number of remapped rows for correctable errors."),
    S.REMAP_UNCORR: ("counter", "Number of remapped rows for uncorrectable errors."),
    S.REMAP_FAILURE: ("gauge", "Whether remapping of rows has failed."),
    S.NVLINK_CRC: ("counter", "Total number of NVLink flow-control CRC errors."),
}

COUNTER_HELP = {
    "samples_collected": "GPU samples read from the source.",
    "xid_events_collected": "XID events read from the source.",
    "samples_sent": "GPU samples accepted by the predictor.",
    "xid_events_sent": "XID events accepted by the predictor.",
    "batches_sent": "Batches accepted by the predictor.",
    "send_errors": "Failed attempts to send a batch (retried).",
    "samples_dropped": "GPU samples dropped because the spool was full.",
    "xid_events_dropped": "XID events dropped because the spool was full.",
    "samples_rejected": "GPU samples in batches the predictor refused as malformed.",
    "xid_events_rejected": "XID events in batches the predictor refused as malformed.",
    "sample_errors": "Sampling ticks that failed.",
}


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class _AgentCollector:
    def __init__(self, stats: AgentStats, spool: Spool | None, shm: ShmWatch | None,
                 source_metrics: Callable[[], list]):
        self.stats, self.spool, self.shm, self.source_metrics = stats, spool, shm, source_metrics

    def collect(self):
        yield from self.source_metrics()
        for name, value in self.stats.snapshot().items():
            c = CounterMetricFamily(f"ckpt_guard_agent_{name}", COUNTER_HELP[name])
            c.add_metric([], value)
            yield c
        if self.spool is not None:
            yield GaugeMetricFamily("ckpt_guard_agent_spool_bytes", "Bytes of batches waiting in the spool.",
                                    value=self.spool.bytes)
            yield GaugeMetricFamily("ckpt_guard_agent_spool_batches", "Batches waiting in the spool.",
                                    value=len(self.spool))
        if self.shm is not None:
            yield from self.shm.families()


class Exporter:
    """Keeps each GPU's latest sample and serves it; ``observe`` is a sampler sink."""

    def __init__(self, stats: AgentStats, spool: Spool | None = None,
                 model_name: Callable[[str, int], str] = lambda node, gpu: "unknown", stale_s: float = 60.0,
                 shm: ShmWatch | None = None, source_metrics: Callable[[], list] = list):
        """``shm``: the checkpoint jobs' shared memory on this node (None: do not report it);
        ``source_metrics``: the source's own metric families (Source.metrics)."""
        self._model_name, self.stale_s = model_name, stale_s
        self._latest: dict[tuple[str, int], tuple[float, dict]] = {}
        self._last_xid: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_AgentCollector(stats, spool, shm, source_metrics))
        ProcessCollector(registry=self._registry)
        self.server: MetricsServer | None = None

    def observe(self, samples: list[dict], xids: list[dict]) -> None:
        now = time.monotonic()
        with self._lock:
            for r in samples:
                self._latest[(r["node"], r["gpu"])] = (now, r)
            for x in xids:
                self._last_xid[(x["node"], x["gpu"])] = x["xid"]

    def render(self) -> bytes:
        """The /metrics page: DCGM gauges and counters, then the agent's own."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (seen, _) in self._latest.items() if now - seen > self.stale_s]:
                del self._latest[key]
            latest = sorted(self._latest.items())
            xids = dict(self._last_xid)
        labels = {}
        for (node, gpu), (_, row) in latest:
            labels[(node, gpu)] = (f'gpu="{gpu}",UUID="{_escape(row.get("uuid") or "")}",device="nvidia{gpu}",'
                                   f'modelName="{_escape(self._model_name(node, gpu))}",Hostname="{_escape(node)}"')
        lines = []
        for name, (kind, doc) in DCGM_METRICS.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            for key, (_, row) in latest:
                if row.get(name) is not None:  # a blank field is left out, as dcgm-exporter does
                    lines.append(f"{name}{{{labels[key]}}} {_number(row[name])}")
        lines += [f"# HELP {S.XID_ERRORS} Value of the last XID error encountered.", f"# TYPE {S.XID_ERRORS} gauge"]
        for key, _ in latest:
            lines.append(f"{S.XID_ERRORS}{{{labels[key]}}} {xids.get(key, 0)}")
        return ("\n".join(lines) + "\n").encode() + generate_latest(self._registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on a background thread (``ckpt.listening``: idle or slow connections,
        or running out of file descriptors, never stop a scrape); returns the bound port (0 picks one)."""
        self.server = MetricsServer(addr, port, lambda: (self.render(), CONTENT_TYPE), name="agents-metrics").start()
        return self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
