"""Job-level risk: the probability that any node of a job fails within the horizon.

The model's GPU risk is a score, not a probability of failure: it is trained on
subsampled negatives and half the horizon (training.py), so 0.9 does not mean nine
in ten. A node's probability comes from an isotonic map, fitted on a labelled
trace's replay, from the node's score (its worst GPU with a recent sample) to the
observed share of node-instants followed by a failure of that node within the
horizon. A job's probability is then `1 - prod(1 - p_node)` (nodes fail
independently), stated beside the fleet's base rate on the calibration trace:
`hazard_ratio` (the job's hazard over the base hazard of as many nodes) transfers
to a fleet with another failure rate better than the probability, since labelled
traces are enriched with failures; the checkpoint policy multiplies its own
failure rate by it (ckpt/policy.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn.isotonic import IsotonicRegression
from threadpoolctl import threadpool_limits

from predictor.model.evaluation import HORIZON_S
from predictor.model.features import NODE_STALE_S
from predictor.model.model_io import Model
from predictor.model.replay import replay
from predictor.model.scoring import Scored, Scorer

INFO_KEY = "node_calibration"
#: Node-instants per node are taken this far apart for fitting and measuring.
GRID_S = 300.0
#: A probability is never stated as certain: a hazard must stay finite.
P_MAX = 1.0 - 1e-6


@dataclass
class NodeCalibration:
    """Node score -> P(the node fails within `horizon_s`), and the fleet's base rate."""

    score: np.ndarray                  # increasing breakpoints
    p: np.ndarray                      # probability at each breakpoint (linear between)
    base_rate_per_s: float             # node failures per node-second on the calibration trace
    horizon_s: float = HORIZON_S

    def probability(self, node_score: np.ndarray) -> np.ndarray:
        return np.clip(np.interp(node_score, self.score, self.p), 0.0, P_MAX)

    @property
    def base_probability(self) -> float:
        return 1.0 - math.exp(-self.base_rate_per_s * self.horizon_s)

    def to_info(self) -> dict:
        return {"score": self.score.round(8).tolist(), "p": self.p.round(8).tolist(),
                "base_rate_per_s": self.base_rate_per_s, "horizon_s": self.horizon_s}

    @staticmethod
    def of(model: Model) -> "NodeCalibration | None":
        """The model's calibration, or None for a model calibrated before job risk existed."""
        c = model.info.get(INFO_KEY)
        if not c:
            return None
        return NodeCalibration(np.asarray(c["score"], float), np.asarray(c["p"], float), float(c["base_rate_per_s"]),
                               float(c["horizon_s"]))


def job_risk(p_nodes: np.ndarray, calibration: NodeCalibration) -> dict:
    """The job's probability of a node failure within the horizon, against the base rate."""
    p_nodes = np.clip(np.asarray(p_nodes, float), 0.0, P_MAX)
    n = len(p_nodes)
    hazard = float(-np.log1p(-p_nodes).sum() / calibration.horizon_s)      # per second, all nodes
    base = n * calibration.base_rate_per_s
    return {"probability": round(float(-np.expm1(-hazard * calibration.horizon_s)), 6),
            "base_probability": round(float(-math.expm1(-base * calibration.horizon_s)), 6),
            "excess_hazard_per_s": float(max(0.0, hazard - base)),
            "hazard_ratio": round(hazard / base, 4) if base > 0 else None,
            "horizon_s": calibration.horizon_s, "nodes": n}


def node_scores(scorer: Scorer) -> np.ndarray:
    """Per node id: its worst GPU's risk among GPUs heard from within NODE_STALE_S of the node's
    newest sample (a GPU gone silent is reported by its XID or its absence, not its old risk);
    NaN for a node with no risk yet."""
    st = scorer.state
    n_slots = min(len(st.slot_key), len(scorer.risk))
    node = st.node_idx[:n_slots]
    t = scorer.risk_t[:n_slots]
    newest = np.full(len(st.node_names), -1, np.int64)
    np.maximum.at(newest, node, t)
    fresh = (t >= 0) & (t >= newest[node] - NODE_STALE_S * 1000)
    out = np.full(len(st.node_names), -np.inf)
    np.maximum.at(out, node[fresh], scorer.risk[:n_slots][fresh])
    return np.where(np.isfinite(out), out, np.nan)


# ------------------------------------------------------------ fitting and measuring on a trace
@dataclass
class NodeInstants:
    """Node-instants of a replayed labelled trace: node score, node, time, failed within H."""

    score: np.ndarray
    node: np.ndarray          # index into `names`
    t_ms: np.ndarray
    failed: np.ndarray        # bool
    names: list[str]
    node_seconds: float
    failures: int


def node_instants(trace: str | Path, model: Model, nodes: set[str] | None = None,
                  progress: bool | None = None) -> NodeInstants:
    """Replay `trace` and take every node's score about every GRID_S; label each by whether the
    node fails within the horizon after it. Instants in the hour after a failure of the
    node are left out (the failure is being reported, as EVAL.md leaves its alarms out)."""
    import pyarrow.parquet as pq

    from predictor.model.evaluation import load_truth
    scorer = Scorer(model)
    grid_ms = int(GRID_S * 1000)
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    due = [-1]

    def take(scored: Scored) -> None:
        """The state after a batch, dated to the batch's newest sample, at most once per GRID_S."""
        if not len(scored.t_ms):
            return
        hi = int(scored.t_ms.max())
        if hi >= due[0]:
            s = node_scores(scorer)
            ids = np.flatnonzero(~np.isnan(s))
            rows.append((s[ids], ids, np.full(len(ids), hi, np.int64)))
            due[0] = hi + grid_ms

    # small batches, so the model's OpenMP threads would mostly wait on each other: one thread
    # (measured on a busy 2-core machine: 13x less time; scoring_queue.py says the same)
    with threadpool_limits(1, user_api="openmp"):
        replay(trace, scorer, take, nodes=nodes, batch_rows=_batch_rows(trace), progress=progress)
    score, node, t = (np.concatenate(x) for x in zip(*rows)) if rows else (np.empty(0),) * 3
    names = list(scorer.state.node_names)
    truth = load_truth(trace, nodes).failures
    fails: dict[str, np.ndarray] = {}
    for n, te in zip(truth["node"], truth["timestamp"]):
        fails.setdefault(n, []).append(int(te))
    failed = np.zeros(len(t), bool)
    keep = np.ones(len(t), bool)
    h = int(HORIZON_S * 1000)
    for nid, name in enumerate(names):
        f = np.sort(np.asarray(fails.get(name, []), np.int64))
        if not len(f):
            continue
        sel = np.flatnonzero(node == nid)
        i = np.searchsorted(f, t[sel], side="right")           # first failure after each instant
        failed[sel] = (i < len(f)) & (f[np.minimum(i, len(f) - 1)] - t[sel] <= h)
        keep[sel] = ~((i > 0) & (t[sel] - f[np.maximum(i - 1, 0)] <= h))
    ts = pq.read_table(Path(trace) / "telemetry.parquet", columns=["timestamp"]).column("timestamp")
    span_s = (ts.cast("int64").to_numpy().max() - ts.cast("int64").to_numpy().min()) / 1000
    return NodeInstants(score[keep], node[keep], t[keep], failed[keep], names,
                        node_seconds=span_s * len(names), failures=len(truth["timestamp"]))


def _batch_rows(trace: str | Path) -> int:
    """Replay batches of about a grid step of the whole fleet (a 200,000-row batch spans hours
    of a small fleet; the instants are taken between batches)."""
    import json
    meta = Path(trace) / "trace.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        per_s = m["nodes"] * m.get("gpus_per_node", 8) / (m.get("interval_s") or 60)
        return int(max(1000, min(200_000, per_s * GRID_S)))
    return 20_000


def fit(instants: list[NodeInstants]) -> NodeCalibration:
    """Isotonic map from node score to the observed failure share (monotone: a higher score
    never means a lower probability)."""
    x = np.concatenate([i.score for i in instants])
    y = np.concatenate([i.failed for i in instants]).astype(float)
    if not y.any():
        raise ValueError("no node failure follows any node-instant: cannot calibrate on these traces")
    iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(x, y)
    rate = sum(i.failures for i in instants) / max(sum(i.node_seconds for i in instants), 1.0)
    return NodeCalibration(np.asarray(iso.X_thresholds_), np.asarray(iso.y_thresholds_), rate)


def reliability(p: np.ndarray, y: np.ndarray, edges=(0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)) -> dict:
    """Brier score and a reliability table: per bin of predicted probability, how many, the
    mean prediction and the observed frequency."""
    y = np.asarray(y, float)
    table = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
        if m.any():
            table.append({"bin": f"{lo:g}-{hi:g}", "n": int(m.sum()), "predicted": round(float(p[m].mean()), 4),
                          "observed": round(float(y[m].mean()), 4)})
    base = float(y.mean()) if len(y) else 0.0
    return {"n": int(len(y)), "positives": int(y.sum()), "brier": round(float(np.mean((p - y) ** 2)), 6),
            "brier_of_base_rate": round(float(np.mean((base - y) ** 2)), 6), "table": table}
