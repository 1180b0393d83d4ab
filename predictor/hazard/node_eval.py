"""How well ``node_risk.rank`` foretells a node's next fault, on cuts of the history it has:
at each cut the model learns from what came before it and is judged on the H days after,
beside the two simple rankings (past faults, recency of the last one).

AUC and precision among the top ``TOP_SHARE`` of nodes, per cut and pooled over the cuts,
each with a 95 % percentile bootstrap over nodes (a resampled node brings its rows at every cut).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from predictor.hazard.evaluation import auc, precision_at_top
from predictor.hazard.node_risk import baselines, faulted, rank
from telemetry.faults import Trace

TOP_SHARE = 0.10
RANKINGS = ("model", "past_faults", "recency")


def _metrics(y: np.ndarray, score: np.ndarray, cut: np.ndarray) -> tuple[float, float]:
    """AUC over the rows, and precision at the top share taken per cut, averaged over cuts."""
    prec = [precision_at_top(y[cut == c], score[cut == c], TOP_SHARE) for c in np.unique(cut)]
    return auc(y, score), float(np.mean(prec))


def _with_intervals(y: np.ndarray, score: np.ndarray, cut: np.ndarray, node: np.ndarray, resamples: int,
                    seed: int) -> dict[str, list[float]]:
    point = _metrics(y, score, cut)
    rng = np.random.default_rng(seed)
    nodes = np.unique(node)
    rows = {n: np.flatnonzero(node == n) for n in nodes}
    draws = []
    for _ in range(resamples):
        i = np.concatenate([rows[n] for n in rng.choice(nodes, len(nodes))])
        draws.append(_metrics(y[i], score[i], cut[i]))
    lo, hi = np.nanpercentile(np.array(draws), [2.5, 97.5], axis=0)
    return {"auc": [point[0], lo[0], hi[0]], f"precision_top{TOP_SHARE:.0%}": [point[1], lo[1], hi[1]]}


def evaluate(trace: Trace, cuts: list[float], horizon_days: float, resamples: int = 200, seed: int = 0,
             progress: Callable[[str], None] = lambda _: None) -> dict:
    """Per cut and pooled: each ranking's AUC and top-decile precision with intervals."""
    if not cuts:
        raise ValueError(f"no cut from day 90 leaves {horizon_days:g} days to judge on before the history's end "
                         f"({trace.days:g})")
    rows: dict[str, list] = {k: [] for k in (*RANKINGS, "y", "cut", "node")}
    splits = []
    for at in cuts:
        if at + horizon_days > trace.days:
            raise ValueError(f"cut {at:g} + {horizon_days:g} days passes the history's end ({trace.days:g})")
        progress(f"cut at day {at:g}: fitting")
        risk = rank(trace, at, horizon_days)
        nodes = trace.nodes  # the whole fleet: a node first named after the cut is one fault-free at it
        y = faulted(trace, nodes, at, horizon_days)
        scores = {"model": risk.of(nodes), **baselines(trace, nodes, at)}
        cut, node = np.full(len(y), at), np.arange(len(y))
        splits.append({"at": at, "nodes": len(y), "faulted": int(y.sum()), "base_rate": float(y.mean()),
                       "train_rows": risk.train_rows, "mean_probability": float(scores["model"].mean()),
                       "rankings": {k: _with_intervals(y, s, cut, node, resamples, seed) for k, s in scores.items()}})
        for k, s in scores.items():
            rows[k].append(s)
        rows["y"].append(y)
        rows["cut"].append(cut)
        rows["node"].append(node)
    pooled = {k: np.concatenate(v) for k, v in rows.items()}
    return {"horizon_days": horizon_days, "resamples": resamples, "top_share": TOP_SHARE, "splits": splits,
            "pooled": {k: _with_intervals(pooled["y"], pooled[k], pooled["cut"], pooled["node"], resamples, seed)
                       for k in RANKINGS}}


def table(res: dict) -> str:
    """The pooled and per-cut figures as a Markdown table."""
    key = f"precision_top{res['top_share']:.0%}"
    head = ["| cut (day) | nodes faulted | " + " | ".join(f"{k} AUC | {k} top {res['top_share']:.0%}"
                                                         for k in RANKINGS) + " |",
            "|---|---:|" + "---:|" * (2 * len(RANKINGS))]

    def cells(m: dict) -> str:
        return " | ".join(f"{m[k]['auc'][0]:.3f} [{m[k]['auc'][1]:.2f}, {m[k]['auc'][2]:.2f}] | "
                          f"{m[k][key][0]:.1%} [{m[k][key][1]:.0%}, {m[k][key][2]:.0%}]" for k in RANKINGS)

    lines = [f"| {s['at']:g} | {s['faulted']} of {s['nodes']} | {cells(s['rankings'])} |" for s in res["splits"]]
    base = np.mean([s["base_rate"] for s in res["splits"]])
    lines.append(f"| pooled | base rate {base:.1%} | {cells(res['pooled'])} |")
    return "\n".join(head + lines)
