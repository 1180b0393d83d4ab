"""Live simulator source: one simulated node on the wall clock (see agents.fleetsim)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np

from agents.fleetsim import FleetConfig, NodeSim
from agents.sources.base import Source
from telemetry import schema as S


class SimSource(Source):
    """Each ``read`` advances the node by one interval (times ``cfg.time_scale``).

    Samples are stamped with the wall clock at the read; XID events keep their
    simulated times, which track the wall clock while reads come on schedule.
    With ``model_clock`` both carry the simulated clock instead, which runs
    ``time_scale`` times faster from the start: an hour of precursors then plays
    in a minute of a demo and still looks, to a predictor, like an hour.
    """

    def __init__(self, cfg: FleetConfig, clock: Callable[[], float] = time.time, *, model_clock: bool = False):
        super().__init__()
        if len(cfg.names()) != 1:
            raise ValueError("a live simulator source plays exactly one node")
        self._clock = clock
        self._t0_ms = int(clock() * 1000)
        self._scale = cfg.time_scale if model_clock else 1.0
        self.cfg = replace(cfg, days=None, start=datetime.fromtimestamp(self._t0_ms / 1000, timezone.utc))
        self.node = self.cfg.names()[0]
        self.sim = NodeSim(self.cfg, self.node, 0)
        self.sim.offset_ms = 0  # the sampler decides when a sample is taken
        self.failures: list[dict] = []  # ground truth, for demos and tests

    def read(self) -> list[dict]:
        c = self.sim.advance(1)
        now = self._stamp(int(self._clock() * 1000))
        cols = {m: c.metrics[m] for m in S.METRICS}
        rows = []
        for i, gpu in enumerate(c.gpu.tolist()):
            row = {"timestamp": now, "node": self.node, "gpu": gpu, "uuid": self.sim.uuids[c.uuid[i]]}
            for m, v in cols.items():
                x = v[i]
                row[m] = None if np.isnan(x) else float(x)
            rows.append(row)
        for ms, gpu, xid in zip(c.xid_ms.tolist(), c.xid_gpu.tolist(), c.xid.tolist()):
            self._xids.append({"timestamp": min(self._stamp(ms), now), "node": self.node, "gpu": gpu, "xid": xid})
        self.failures += c.failures
        return rows

    def _stamp(self, wall_ms: int) -> int:
        """A wall-clock time as samples carry it: itself, or on the simulated clock."""
        return self._t0_ms + round((wall_ms - self._t0_ms) * self._scale)

    def model_name(self, node: str, gpu: int) -> str:
        return self.cfg.profile.model_name
