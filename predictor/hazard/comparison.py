"""Every model (and the hand-made score) on landmark splits before the cut, with intervals."""
from __future__ import annotations

from typing import Callable

from predictor.hazard import evaluation, training
from predictor.hazard.features import label_within, outcome, snapshot
from predictor.hazard.history import History
from predictor.hazard.models import handmade_score


def compare_models(h: History, as_of: dict[str, float], horizon_days: float, resamples: int = 200,
                   progress: Callable[[str], None] = lambda _: None) -> dict:
    """Train each kind on what was known at each as-of time; judge on the ``horizon_days`` after it."""
    splits = []
    for name, t in as_of.items():
        data = training.landmark_set(h, t, horizon_days)
        snap = snapshot(h, t)
        days, event = outcome(h, snap)
        scores = {"handmade": handmade_score(snap.x)}
        for kind in training.MODEL_KINDS:
            progress(f"as of {name}: fitting {kind} on {len(data.x)} rows")
            scores[kind] = training.fit(kind, data, horizon_days).probability(snap.x, horizon_days)
        y = label_within(days, event, horizon_days)
        splits.append({
            "as_of": name, "gpus": snap.n, "events": int(y.sum()),
            "base_rate": float(y.mean()), "train_rows": len(data.x), "train_landmarks": data.landmarks,
            "models": {k: evaluation.with_intervals(days, event, s, horizon_days, resamples)
                       for k, s in scores.items()},
        })
    return {"horizon_days": horizon_days, "resamples": resamples,
            "metrics": {"concordance": "Harrell's C on the time to the next DBE/OTB (censored at a healthy removal)",
                        "td_auc": "cumulative/dynamic AUC at the horizon (healthy removals before it left out)",
                        "auc": "AUC of 'DBE/OTB within the horizon' over every GPU in service (the held-out task)",
                        "precision_top5": "share of the top 5 % by score with a DBE/OTB within the horizon"},
            "splits": splits}
