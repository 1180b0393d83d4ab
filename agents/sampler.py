"""Calls the source on a schedule and hands every tick to the sinks (sender, exporter).

apscheduler, so that a slow tick (a hung NVML call, a loaded host) never piles
up: missed runs coalesce into one, a run late by less than the grace time still
happens, and only one tick runs at a time.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone

from apscheduler.schedulers.background import BackgroundScheduler

from agents.sources.base import Source
from agents.stats import AgentStats

log = logging.getLogger(__name__)

Sink = Callable[[list[dict], list[dict]], None]  # (samples, xid events)


class Sampler:
    """Every ``interval_s``: read ``source``, pass rows and XID events to each sink.

    XID events are also collected every ``xid_poll_s`` between ticks, so a
    critical XID reaches the predictor within about a second, not an interval.
    """

    def __init__(self, source: Source, sinks: list[Sink], interval_s: float, stats: AgentStats,
                 xid_poll_s: float = 1.0):
        self.source, self.sinks, self.interval_s, self.stats = source, sinks, interval_s, stats
        self._sched = BackgroundScheduler(
            timezone=timezone.utc,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": max(1, int(interval_s))},
        )
        self._sched.add_job(self.tick, "interval", seconds=interval_s, next_run_time=datetime.now(timezone.utc),
                            id="sample")
        if xid_poll_s < interval_s:
            self._sched.add_job(self.poll_xids, "interval", seconds=xid_poll_s, id="xid")

    def start(self) -> None:
        self._sched.start()

    def stop(self) -> None:
        self._sched.shutdown(wait=True)

    def tick(self) -> None:
        """One sample of every GPU, plus the XID events logged meanwhile."""
        try:
            samples = self.source.read()
        except Exception:
            self.stats.add(sample_errors=1)
            log.exception("reading the %s source failed", type(self.source).__name__)
            samples = []
        self._deliver(samples, self.source.xids())

    def poll_xids(self) -> None:
        xids = self.source.xids()
        if xids:
            self._deliver([], xids)

    def _deliver(self, samples: list[dict], xids: list[dict]) -> None:
        self.stats.add(samples_collected=len(samples), xid_events_collected=len(xids))
        for sink in self.sinks:
            try:
                sink(samples, xids)
            except Exception:
                log.exception("a sink failed on %d samples", len(samples))
