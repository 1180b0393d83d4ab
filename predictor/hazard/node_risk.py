"""Node risk from a fleet's fault history: the probability that each node faults within H
days of a day, learned only from what was recorded before that day.

The history is ``ckpt simulate --fault-trace``'s (the InfiniteHBD JSON or the CSV
``node,start,end,kind``; one reader, ``telemetry.faults``). ``rank`` cuts the history at
``at`` first and never looks past it: landmarks every ``STEP_DAYS`` up to ``at − H`` give each
node's features as of the landmark and whether it faulted within the H days after it (all
inside the known history), as the Titan hazard model trains (``training.landmark_set``). A
logistic regression on a few counts and recencies answers; a node with no recorded fault
scores what a fault-free node of the fleet scores (``absent_probability``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from telemetry.faults import Trace

STEP_DAYS = 7.0
FIRST_DAY = 14.0  # the first landmark: a fortnight of history
FEATURES = ("log_faults", "had_fault", "faults_30d", "faults_90d", "log_days_since_fault", "log_days_since_repair",
            "down_now", "log_down_days", "stress_tests", "rate_per_100d", "decay_7d", "decay_30d", "log_open_days")


TERMS = ("fault_last_7d", "fault_7_30d_ago", "fault_30_90d_ago", "fault_over_90d_ago", "one_fault", "two_faults",
         "three_to_five_faults", "six_faults_or_more", "repaired_last_7d", "repaired_7_30d_ago", "down_under_7d",
         "down_7d_or_more", "had_stress_test")


def design(x: np.ndarray) -> np.ndarray:
    """The model's terms (``TERMS``, 0/1) from the features."""
    c = lambda name: x[:, FEATURES.index(name)]  # noqa: E731
    since, n, rep = np.expm1(c("log_days_since_fault")), np.expm1(c("log_faults")).round(), \
        np.expm1(c("log_days_since_repair"))
    up, down_for = c("down_now") == 0, np.expm1(c("log_open_days"))
    return np.column_stack([
        since < 7, (since >= 7) & (since < 30), (since >= 30) & (since < 90), (since >= 90) & (n > 0),
        n == 1, n == 2, (n >= 3) & (n < 6), n >= 6, (rep < 7) & up, (rep >= 7) & (rep < 30) & up,
        ~up & (down_for < 7), ~up & (down_for >= 7), c("stress_tests") > 0]).astype(float)


def features(known: Trace, nodes: list[str], t: float) -> np.ndarray:
    """Each node's history as of ``t`` (faults begun before ``t`` only)."""
    rows = []
    for n in nodes:
        fs = [f for f in known.faults.get(n, ()) if f.start < t]
        starts = [f.start for f in fs]
        ends = [f.end for f in fs if f.end < t]
        down = sum(min(f.end, t) - f.start for f in fs)
        since = t - max(starts) if starts else t + 365.0
        since_repair = t - max(ends) if ends else t + 365.0
        rows.append([math.log1p(len(fs)), float(bool(fs)), sum(s >= t - 30 for s in starts),
                     sum(s >= t - 90 for s in starts), math.log1p(since), math.log1p(since_repair),
                     float(any(f.start < t < f.end for f in fs)), math.log1p(down),
                     sum(f.cls == "test" for f in fs), 100.0 * len(fs) / max(t, 1.0),
                     sum(math.exp(-(t - s) / 7.0) for s in starts), sum(math.exp(-(t - s) / 30.0) for s in starts),
                     math.log1p(max([t - f.start for f in fs if f.end > t], default=0.0))])
    return np.asarray(rows, dtype=float).reshape(len(nodes), len(FEATURES))


def faulted(known: Trace, nodes: list[str], t: float, horizon_days: float) -> np.ndarray:
    """1 where the node's next fault begins in [t, t + horizon)."""
    return np.array([any(t <= f.start < t + horizon_days for f in known.faults.get(n, ())) for n in nodes], int)


def landmark_set(known: Trace, horizon_days: float, step_days: float = STEP_DAYS) -> tuple[np.ndarray, np.ndarray]:
    """Stacked (features, label) at landmarks FIRST_DAY, +step, ... while the horizon after
    the landmark ends within the known history."""
    xs, ys = [], []
    t = FIRST_DAY
    while t + horizon_days <= known.days:
        xs.append(features(known, known.nodes, t))
        ys.append(faulted(known, known.nodes, t, horizon_days))
        t += step_days
    if not xs:
        raise ValueError(f"the history before day {known.days:g} is too short for a {horizon_days:g}-day horizon: "
                         f"training needs {FIRST_DAY:g} + {horizon_days:g} days")
    return np.vstack(xs), np.concatenate(ys)


@dataclass
class NodeRisk:
    """P(a fault within ``horizon_days``) per node as of ``at``; ``absent_probability``: a node
    the history never names (no fault recorded)."""

    at: float
    horizon_days: float
    nodes: list[str]
    probability: np.ndarray
    absent_probability: float
    train_rows: int
    train_events: int

    def order(self) -> np.ndarray:
        return np.argsort(-self.probability, kind="stable")

    def of(self, nodes: list[str]) -> np.ndarray:
        """The probability of each of ``nodes``: a node not in the fleet at ``at`` (first named
        later) had no fault by then, and scores ``absent_probability``."""
        known = dict(zip(self.nodes, self.probability))
        return np.array([known.get(n, self.absent_probability) for n in nodes], float)


def rank(trace: Trace, at: float, horizon_days: float, step_days: float = STEP_DAYS) -> NodeRisk:
    """Fit on the history before ``at`` and score every node of the fleet as of ``at``."""
    known = trace.before(at)
    x, y = landmark_set(known, horizon_days, step_days)
    if y.sum() < 5 or y.sum() == len(y):
        raise ValueError(f"{int(y.sum())} of {len(y)} landmark rows had a fault within {horizon_days:g} days: "
                         "too few to fit")
    model = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=3000))
    model.fit(design(x), y)
    nodes = known.nodes
    p = model.predict_proba(design(features(known, nodes, at)))[:, 1]
    absent = float(model.predict_proba(design(features(known, ["(absent)"], at)))[:, 1][0])
    return NodeRisk(at, horizon_days, nodes, p, absent, len(y), int(y.sum()))


def baselines(trace: Trace, nodes: list[str], at: float) -> dict[str, np.ndarray]:
    """The simple rankings to beat, as of ``at``: the count of past faults, and the recency
    of the last one (the more recent, the higher; never: lowest)."""
    x = features(trace.before(at), nodes, at)
    return {"past_faults": np.expm1(x[:, FEATURES.index("log_faults")]),
            "recency": -x[:, FEATURES.index("log_days_since_fault")]}
