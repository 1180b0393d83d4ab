"""Scores of the GPUs in service at a time, with the reasons an operator needs, as CSV and a Prometheus gauge.

A reason is what the model would take off a GPU's probability if that one feature were the
fleet's typical value (its median at the time): it works for every model kind alike.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictor.hazard.features import FEATURE_NAMES, snapshot
from predictor.hazard.history import History
from predictor.hazard.store import HazardModel

GAUGE = "ckpt_guard_gpu_hazard"
COLUMNS = ("SN", "probability", "location", "col", "row", "cage", "slot", "node", "reasons")


@dataclass
class Scores:
    serial: np.ndarray
    location: np.ndarray
    probability: np.ndarray
    x: np.ndarray
    reasons: list[str]

    def order(self) -> np.ndarray:
        return np.argsort(-self.probability, kind="stable")


def reasons(hm: HazardModel, x: np.ndarray, p: np.ndarray, horizon_days: float, top: int = 2) -> list[str]:
    """The ``top`` features that raise each GPU's probability most above the fleet's typical value."""
    typical = np.median(x, axis=0)
    lift = np.empty_like(x)
    for j in range(x.shape[1]):
        xt = x.copy()
        xt[:, j] = typical[j]
        lift[:, j] = p - hm.probability(xt, horizon_days)
    out = []
    for row, lr in zip(x, lift):
        idx = [j for j in np.argsort(-lr)[:top] if lr[j] > 0]
        out.append("; ".join(f"{FEATURE_NAMES[j]}={row[j]:.4g} (+{100 * lr[j]:.1f} pts)" for j in idx))
    return out


def score(hm: HazardModel, h: History, t: float, horizon_days: float) -> Scores:
    snap = snapshot(h, t)
    p = hm.probability(snap.x, horizon_days)
    return Scores(h.serials[snap.gpu], h.stay_location[snap.stay], p, snap.x,
                  reasons(hm, snap.x, p, horizon_days) if snap.n else [])


def write_csv(s: Scores, path: str | Path) -> None:
    loc_cols = [FEATURE_NAMES.index(c) for c in ("col", "row", "cage", "slot", "node")]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for i in s.order():
            w.writerow([s.serial[i], f"{s.probability[i]:.6f}", s.location[i],
                        *(int(s.x[i, c]) for c in loc_cols), s.reasons[i]])


def write_gauge(s: Scores, path: str | Path, horizon_days: float) -> None:
    """Node-exporter textfile: one ``ckpt_guard_gpu_hazard{serial,location,horizon_days}`` per GPU."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
    reg = CollectorRegistry()
    g = Gauge(GAUGE, "Probability of a DBE or OTB within the horizon, from the fleet's service history",
              ["serial", "location", "horizon_days"], registry=reg)
    for sn, loc, p in zip(s.serial, s.location, s.probability):
        g.labels(str(sn), str(loc), f"{horizon_days:g}").set(float(p))
    write_to_textfile(str(path), reg)
