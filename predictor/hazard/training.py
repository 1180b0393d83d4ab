"""Landmark training sets: the fleet as of every ``step_days`` before a time, with what came next.

Each landmark's outcome is censored at ``until`` (the as-of time of the model), so a model
trained "as of 2017-07-01" has seen nothing after it; follow-up is cut at the horizon, so
the linear models fit the window the operator asks about.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.hazard.features import DAY, outcome, snapshot
from predictor.hazard.history import History
from predictor.hazard.models import BoostedModel, CoxModel, WeibullAFT

MODEL_KINDS = ("boosted", "cox", "weibull")
MIN_FLEET = 50  # landmarks with fewer GPUs in service say little about the fleet


@dataclass
class LandmarkSet:
    x: np.ndarray
    days: np.ndarray    # to the event or censoring, at most the horizon
    event: np.ndarray   # bool: an event within the horizon
    landmarks: int


def landmark_set(h: History, until: float, horizon_days: float, step_days: float = 30.0) -> LandmarkSet:
    """Stacked snapshots from ``until - horizon`` back every ``step_days`` to the record's start."""
    xs, ds, es = [], [], []
    start = float(h.stay_in.min())
    t = until - horizon_days * DAY
    while t > start:
        snap = snapshot(h, t)
        if snap.n >= MIN_FLEET:
            days, ev = outcome(h, snap, until=until)
            ev = ev & (days <= horizon_days)
            xs.append(snap.x)
            ds.append(np.minimum(days, horizon_days))
            es.append(ev)
        t -= step_days * DAY
    if not xs:
        raise ValueError(f"no landmark before {horizon_days:g} days ahead of the as-of time has {MIN_FLEET} GPUs "
                         "in service: the history is too short for this horizon")
    return LandmarkSet(np.vstack(xs), np.concatenate(ds), np.concatenate(es), len(xs))


def fit(kind: str, data: LandmarkSet, horizon_days: float, seed: int = 0):
    """One model of ``kind`` (boosted, cox, weibull) on a landmark set."""
    if data.event.sum() < 5:
        raise ValueError(f"only {int(data.event.sum())} events in the training windows: too few to fit a model")
    if kind == "boosted":
        return BoostedModel.fit(data.x, data.event.astype(int), horizon_days, seed=seed)
    if kind == "cox":
        return CoxModel.fit(data.x, np.maximum(data.days, 1e-3), data.event)
    if kind == "weibull":
        return WeibullAFT.fit(data.x, data.days, data.event)
    raise ValueError(f"model kind {kind!r} is not one of {MODEL_KINDS}")
