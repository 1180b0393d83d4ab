"""EVAL.md metrics for alarms held in memory, via the reference scorer's own `score()`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from predictor import score_alarms
from predictor.wire import timestamps_ms

HORIZON_S = 3600.0
MIN_LEAD_S = 120.0


@dataclass
class Truth:
    """A trace's failures in the reference scorer's column dict, and its node-days."""

    failures: dict
    node_days: float


def _columns(table: pa.Table, cols: list[str]) -> dict:
    out = {}
    for c in cols:
        col = table.column(c)
        if c == "timestamp":
            out[c] = timestamps_ms(col)
        elif c in ("node", "mode"):
            out[c] = np.asarray(pc.cast(col, pa.string()).to_pylist(), dtype=object)
        else:
            out[c] = np.asarray(col.to_pylist())
    return out


def load_truth(trace_dir: str | Path, nodes: set[str] | None = None) -> Truth:
    """Failures (optionally of some nodes only) and the node-days they were observed over."""
    trace_dir = Path(trace_dir)
    fails = pq.read_table(trace_dir / "failures.parquet", columns=["timestamp", "node", "gpu", "mode", "precursor_s"])
    days = score_alarms.node_days(str(trace_dir))
    if nodes is not None:
        fails = fails.filter(pc.is_in(pc.cast(fails.column("node"), pa.string()), pa.array(sorted(nodes), pa.string())))
        meta = trace_dir / "trace.json"
        total_nodes = json.loads(meta.read_text())["nodes"] if meta.exists() else None
        days = days * len(nodes) / total_nodes if total_nodes else days
    return Truth(_columns(fails, ["timestamp", "node", "gpu", "mode", "precursor_s"]), days)


def score(alarms: pa.Table, truth: Truth, level: str = "node") -> dict:
    """The reference metrics (EVAL.md) of an alarm table against a trace's failures."""
    return score_alarms.score(_columns(alarms, ["timestamp", "node", "gpu"]), truth.failures, truth.node_days,
                              HORIZON_S, MIN_LEAD_S, level)


def _why_missing(metric: str, r: dict) -> str:
    """In words, why the reference scorer has no value for `metric` (it writes NaN or None)."""
    if not r["failures"]:
        return "no failures in this trace"
    if metric == "recall_of_predictable":
        return "no predictable failures in this trace"
    if metric == "false_alarms_per_1000_node_days":
        return "no node-days in this trace"
    if metric.startswith("lead_s"):
        return "no failure was caught"
    return "no failure was caught and no alarm was false"


def _explained(r: dict) -> dict:
    """The reference metrics with null (never NaN, which is not JSON) where a value is missing,
    and `why_missing` saying why for each."""
    out, why = dict(r), {}
    for k, v in r.items():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out[k], why[k] = None, _why_missing(k, r)
    if why:
        out["why_missing"] = why
    return out


def report(alarms: pa.Table, truth: Truth) -> dict:
    """Node and GPU level, as the reference scorer prints them (JSON-safe, see _explained)."""
    return {level: _explained(score(alarms, truth, level)) for level in ("node", "gpu")}
