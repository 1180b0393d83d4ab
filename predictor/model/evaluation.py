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
from scipy import stats

from predictor.ingest.wire import timestamps_ms
from predictor.model import score_alarms

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


def recall_interval(caught: int, n: int, level: float = 0.95) -> list[float]:
    """Exact (Clopper-Pearson) interval of a recall of `caught` out of `n`."""
    a = (1 - level) / 2
    lo = stats.beta.ppf(a, caught, n - caught + 1) if caught > 0 else 0.0
    hi = stats.beta.ppf(1 - a, caught + 1, n - caught) if caught < n else 1.0
    return [round(float(lo), 4), round(float(hi), 4)]


def rate_interval(events: int, node_days: float, level: float = 0.95) -> list[float]:
    """Exact (Garwood) interval of a Poisson rate of `events` in `node_days`, per 1000 node-days."""
    a = (1 - level) / 2
    lo = stats.chi2.ppf(a, 2 * events) / 2 if events > 0 else 0.0
    hi = stats.chi2.ppf(1 - a, 2 * events + 2) / 2
    return [round(float(lo) / node_days * 1000, 3), round(float(hi) / node_days * 1000, 3)]


def _with_intervals(r: dict) -> dict:
    """The headline rates' 95 % intervals (`ci95`): a trace of a few hundred node-days holds a
    handful of false episodes and a few dozen failures, so one more or fewer moves them a lot
    (one false episode in 192 node-days reads 5.2 per 1000; a predictor at a true 2 raises at
    least one there a third of the time)."""
    ci = {}
    if r.get("recall_of_predictable") is not None:
        n = r["predictable_failures"]
        ci["recall_of_predictable"] = recall_interval(round(r["recall_of_predictable"] * n), n)
    if r.get("false_alarms_per_1000_node_days") is not None:
        ci["false_alarms_per_1000_node_days"] = rate_interval(r["false_alarms"], r["node_days"])
    return {**r, "ci95": ci}


def report(alarms: pa.Table, truth: Truth) -> dict:
    """Node and GPU level, as the reference scorer prints them (JSON-safe, see _explained), with
    the 95 % intervals of recall of predictable and the false-alarm rate."""
    return {level: _with_intervals(_explained(score(alarms, truth, level))) for level in ("node", "gpu")}
