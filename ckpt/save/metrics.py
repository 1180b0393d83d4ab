"""Prometheus metrics of the checkpoint engine, exported only when asked
(``CheckpointManager(metrics_port=...)``): what an operator needs to see that
checkpoints are cheap, keep up, and land in every tier."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..listening import MetricsServer
from .drain import SaveHandle

_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class CheckpointMetrics:
    def __init__(self, rank: int = 0, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"rank": str(rank)}
        r = self.registry
        self.blocking = Histogram("ckpt_save_blocking_seconds", "Time save() blocked the training thread",
                                  ["rank"], buckets=_BUCKETS, registry=r).labels(**labels)
        self.stall = Counter("ckpt_save_stall_seconds", "Time save() waited for a slot still draining",
                             ["rank"], registry=r).labels(**labels)
        self._lag = Histogram("ckpt_tier_lag_seconds", "From save() to durable in a tier",
                              ["rank", "tier"], buckets=_BUCKETS, registry=r)
        self._bytes = Counter("ckpt_written_bytes", "Checkpoint bytes made durable, per tier",
                              ["rank", "tier"], registry=r)
        self._last = Gauge("ckpt_last_durable_step", "Newest step durable in a tier", ["rank", "tier"], registry=r)
        self.failures = Counter("ckpt_background_failures", "Background writes that failed",
                                ["rank"], registry=r).labels(**labels)
        self.saves = Counter("ckpt_saves", "Checkpoints taken", ["rank", "kind"], registry=r)
        self._restore = Histogram("ckpt_restore_seconds", "Time to restore, per tier it came from",
                                  ["rank", "tier"], buckets=_BUCKETS, registry=r)
        self._unsound = Counter("ckpt_unsound_snapshots", "Committed steps found suspect (replicas disagree) or "
                                "unhealthy (NaN/Inf), per culprit rank, node and GPU",
                                ["rank", "state", "culprit_rank", "culprit_node", "culprit_gpu"], registry=r)
        self._full = Gauge("ckpt_tier_full", "1 while a durable tier has no room for this rank's saves (the job "
                           "trains on with its other tiers)", ["rank", "tier"], registry=r)
        self.rank = str(rank)
        self.server: MetricsServer | None = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on a daemon thread (``ckpt.listening``: idle or slow connections, or running
        out of file descriptors, never stop a scrape); returns the bound port (0 picks one)."""
        self.server = MetricsServer(addr, port, lambda: (generate_latest(self.registry), CONTENT_TYPE_LATEST),
                                    name="ckpt-metrics").start()
        return self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def saved(self, blocking_s: float, urgent: bool) -> None:
        self.blocking.observe(blocking_s)
        self.saves.labels(rank=self.rank, kind="urgent" if urgent else "periodic").inc()

    def durable(self, handle: SaveHandle, tier: str) -> None:
        self._lag.labels(rank=self.rank, tier=tier).observe(handle.durable_s[tier])
        self._bytes.labels(rank=self.rank, tier=tier).inc(handle.nbytes)
        self._last.labels(rank=self.rank, tier=tier).set(handle.step)

    def failed(self, handle: SaveHandle) -> None:
        self.failures.inc()

    def tier_full(self, tier: str, full: bool) -> None:
        self._full.labels(rank=self.rank, tier=tier).set(int(full))

    def restored(self, tier: str, seconds: float) -> None:
        self._restore.labels(rank=self.rank, tier=tier).observe(seconds)

    def unsound(self, state: str, culprits: list[dict]) -> None:
        for c in culprits or [{}]:
            self._unsound.labels(rank=self.rank, state=state, culprit_rank=str(c.get("rank", "?")),
                                 culprit_node=str(c.get("node", "?")), culprit_gpu=str(c.get("gpu", "?"))).inc()
