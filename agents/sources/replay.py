"""Replay source: streams a recorded trace at N x its own pace."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from agents.sources.base import Source
from telemetry import schema as S


def _load(path: str, schema: pa.Schema, nodes: list[str] | None) -> pa.Table:
    """The schema's columns (extra ones ignored, a missing optional one null), time-ordered, ms ints."""
    have = set(pq.read_schema(path).names)
    filters = [("node", "in", nodes)] if nodes else None
    t = pq.read_table(path, columns=[f.name for f in schema if f.name in have], filters=filters)
    cols = {}
    for f in schema:
        if f.name not in have:
            if not f.nullable:
                raise ValueError(f"{path}: missing column {f.name!r}")
            cols[f.name] = pa.nulls(t.num_rows, f.type)
        elif f.name == "timestamp":
            cols[f.name] = pc.cast(t.column(f.name), S.TIMESTAMP, safe=False).cast(pa.int64())  # us/ns truncate to ms
        else:
            cols[f.name] = t.column(f.name).cast(f.type)  # dictionary-encoded names become strings
    t = pa.table(cols)
    return t.take(pc.sort_indices(t, [("timestamp", "ascending")]))


class ReplaySource(Source):
    """Each ``read`` returns the recorded rows whose time has come, at ``speed`` x.

    Timestamps stay as recorded (the predictor sees the trace's own time) unless
    ``retime``: then they are mapped onto the wall clock of the replay.
    """

    def __init__(self, trace_dir: str, speed: float = 1.0, nodes: list[str] | None = None,
                 retime: bool = False, clock: Callable[[], float] = time.time):
        super().__init__()
        if speed <= 0:
            raise ValueError("replay speed must be positive")
        path = os.path.join(trace_dir, "telemetry.parquet")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{trace_dir}: no telemetry.parquet (not a trace directory?)")
        self._tel = _load(path, S.TELEMETRY_SCHEMA, nodes)
        xid_path = os.path.join(trace_dir, "xid.parquet")
        self._xid = _load(xid_path, S.XID_SCHEMA, nodes) if os.path.exists(xid_path) else S.XID_SCHEMA.empty_table()
        if self._tel.num_rows == 0:
            raise ValueError(f"{trace_dir}: no samples{' for ' + ', '.join(nodes) if nodes else ''}")
        self._tel_ts = self._tel.column("timestamp").to_numpy()
        self._xid_ts = self._xid.column("timestamp").to_numpy() if self._xid.num_rows else np.zeros(0, np.int64)
        self._t0 = int(self._tel_ts[0])
        self._speed, self._retime, self._clock = speed, retime, clock
        self._wall0 = clock()
        self._pos = {"telemetry": 0, "xid": 0}
        meta = os.path.join(trace_dir, "trace.json")
        self._model = json.load(open(meta)).get("gpu_model", "unknown") if os.path.exists(meta) else "unknown"

    def _due(self, kind: str, table: pa.Table, ts: np.ndarray, horizon: float) -> list[dict]:
        a = self._pos[kind]
        b = int(np.searchsorted(ts, horizon, side="right"))
        self._pos[kind] = b
        rows = table.slice(a, b - a).to_pylist()
        if self._retime:
            for r in rows:
                r["timestamp"] = int(self._wall0 * 1000 + (r["timestamp"] - self._t0) / self._speed)
        return rows

    def read(self) -> list[dict]:
        horizon = self._t0 + (self._clock() - self._wall0) * 1000 * self._speed
        self._xids.extend(self._due("xid", self._xid, self._xid_ts, horizon))
        return self._due("telemetry", self._tel, self._tel_ts, horizon)

    def model_name(self, node: str, gpu: int) -> str:
        return self._model

    @property
    def total_samples(self) -> int:
        return self._tel.num_rows

    @property
    def finished(self) -> bool:
        return self._pos["telemetry"] >= self._tel.num_rows and self._pos["xid"] >= self._xid.num_rows
