"""How well a ranking of GPUs foretells DBE/OTB: concordance, AUC, precision among the top 5 %, with intervals.

Intervals are percentile bootstraps over GPUs (resampled with replacement).
"""
from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score

TOP_SHARE = 0.05


def concordance(days: np.ndarray, event: np.ndarray, score: np.ndarray) -> float:
    """Harrell's C: among comparable pairs (one failed before the other left), the share the score orders right."""
    agree = ties = pairs = 0.0
    for i in np.flatnonzero(event):
        later = days > days[i]
        n = later.sum()
        if n == 0:
            continue
        pairs += n
        agree += (score[i] > score[later]).sum()
        ties += (score[i] == score[later]).sum()
    return (agree + 0.5 * ties) / pairs if pairs else float("nan")


def td_auc(days: np.ndarray, event: np.ndarray, score: np.ndarray, horizon_days: float) -> float:
    """Cumulative/dynamic AUC at the horizon: cases failed by it, controls still in service after it
    (GPUs removed healthy before it are neither)."""
    case = event & (days <= horizon_days)
    control = days > horizon_days
    keep = case | control
    if case.sum() == 0 or control.sum() == 0:
        return float("nan")
    return float(roc_auc_score(case[keep], score[keep]))


def auc(y: np.ndarray, score: np.ndarray) -> float:
    return float(roc_auc_score(y, score)) if 0 < y.sum() < len(y) else float("nan")


def precision_at_top(y: np.ndarray, score: np.ndarray, share: float = TOP_SHARE) -> float:
    """Share of the top ``share`` GPUs by score that had an event (ties broken by order, stably)."""
    k = max(1, int(round(share * len(score))))
    top = np.argsort(-score, kind="stable")[:k]
    return float(y[top].mean())


def metrics(days: np.ndarray, event: np.ndarray, score: np.ndarray, horizon_days: float) -> dict:
    y = (event & (days <= horizon_days)).astype(int)
    return {"concordance": concordance(days, event, score),
            "td_auc": td_auc(days, event, score, horizon_days),
            "auc": auc(y, score),
            "precision_top5": precision_at_top(y, score)}


def with_intervals(days: np.ndarray, event: np.ndarray, score: np.ndarray, horizon_days: float,
                   resamples: int = 200, seed: int = 0) -> dict:
    """Each metric with its 95 % bootstrap interval: {name: [value, low, high]}."""
    point = metrics(days, event, score, horizon_days)
    rng = np.random.default_rng(seed)
    draws = {k: [] for k in point}
    for _ in range(resamples):
        i = rng.integers(0, len(score), len(score))
        for k, v in metrics(days[i], event[i], score[i], horizon_days).items():
            draws[k].append(v)
    return {k: [point[k], *np.nanpercentile(draws[k], [2.5, 97.5]).tolist()] for k in point}
