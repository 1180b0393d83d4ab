"""One node agent: a source, sampled on schedule, fanned out to the sender and the exporter."""
from __future__ import annotations

import logging
import threading
import time

from agents.exporter import Exporter
from agents.sampler import Sampler, Sink
from agents.sender import Sender
from agents.shm import ShmWatch
from agents.sources.base import Source
from agents.spool import Spool
from agents.stats import AgentStats

log = logging.getLogger(__name__)


class Agent:
    """Wires the parts; ``run`` blocks until stopped, out of time, or a replay ends."""

    def __init__(self, source: Source, interval_s: float, *, predictor: str | None = None, token: str | None = None,
                 spool_dir: str | None = None, spool_max_bytes: int = 256 << 20, batch_s: float = 10.0,
                 metrics_port: int | None = None, metrics_addr: str = "127.0.0.1", sinks: tuple[Sink, ...] = (),
                 shm_dir: str | None = "/dev/shm", reclaim_shm_s: float = 300.0):
        """``shm_dir``: where checkpoint jobs keep shared memory (reported on /metrics, and every
        ``reclaim_shm_s`` the memory of jobs that are gone reclaimed once durable: agents/shm.py)."""
        self.source, self.stats = source, AgentStats()
        self.shm = ShmWatch(shm_dir, reclaim_shm_s) if shm_dir else None
        self.sender = None
        spool = None
        if predictor:
            if not token or not spool_dir:
                raise ValueError("sending to a predictor needs a token and a spool directory")
            spool = Spool(spool_dir, spool_max_bytes)
            self.sender = Sender(predictor, token, spool, self.stats, batch_s=batch_s)
        self.exporter = Exporter(self.stats, spool, source.model_name, stale_s=max(60.0, 3 * interval_s),
                                 shm=self.shm, source_metrics=source.metrics)
        self.metrics_port = self.exporter.serve(metrics_port, metrics_addr) if metrics_port is not None else None
        all_sinks = [self.exporter.observe] + ([self.sender.put] if self.sender else []) + list(sinks)
        self.sampler = Sampler(source, all_sinks, interval_s, self.stats)
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask ``run`` to return (safe from a signal handler)."""
        self._stop.set()

    def run(self, duration_s: float | None = None, drain_s: float = 5.0) -> dict[str, int]:
        """Sample until stopped; then send what is left (up to ``drain_s``) and return the counters."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        self.sampler.start()
        if self.shm is not None:
            self.shm.start()
        try:
            while not self._stop.wait(1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if self.source.finished:  # the tick that emptied it has delivered its rows
                    break
        finally:
            self.sampler.stop()
            if self.shm is not None:
                self.shm.close()
            if self.sender is not None:
                self.sender.close(drain_s)
                if len(self.sender.spool):
                    log.warning("%d batches left in the spool %s; the next start sends them",
                                len(self.sender.spool), self.sender.spool.directory)
            self.exporter.close()
            self.source.close()
        snap = self.stats.snapshot()
        if self.sender is not None:
            snap["spool_batches"] = len(self.sender.spool)
        return snap
