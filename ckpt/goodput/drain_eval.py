"""Draining the riskiest nodes, judged on a fault history: faults avoided against the
capacity the drains cost (``ckpt simulate --fault-trace FILE --quarantine-top K --quarantine-days D``).

Every ``days`` from ``start``, the top ``k`` nodes in service by a ranking made from the
history before that day only are drained for ``days``: the faults that begin on them in
that window are faults no job sees; the node-days they were drained while healthy are
capacity lost. A ranking is either ``predictor nodes rank``'s CSV for that day
(``at_<DAY>.csv`` in a folder: ``node_id,probability``) or, without one, the count of the
node's past faults that stopped a job (ties: the latest first, then a seeded shuffle).
A random drain of as many nodes avoids ``k / nodes in service`` of the window's faults:
the lift is over that.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from telemetry.faults import Trace, TraceError, ranked

START_DAY = 60.0  # the first decision: enough history to rank on
TOPS = (5, 10, 20, 40)
DAYS = (7.0, 14.0, 28.0)  # multiples of a week: one set of weekly rankings serves all
Ranking = Callable[[Trace, float], dict[str, float]]


def past_faults(known: Trace, day: float) -> dict[str, float]:
    """The baseline ranking: faults that stopped a job, the latest breaking ties."""
    return {n: sum(o.interrupts for o in os_) + max(o.start for o in os_) / (10 * max(day, 1.0))
            for n, os_ in known.outages.items()}


def from_folder(folder: Path) -> Ranking:
    """Rankings read from ``folder/at_<DAY>.csv``, one per decision day."""
    def rank(known: Trace, day: float) -> dict[str, float]:
        path = folder / f"at_{day:g}.csv"
        if not path.exists():
            raise TraceError(f"{path} missing: make it with `predictor nodes rank --faults {known.source} "
                             f"--at {day:g} --out {path}`")
        try:
            return ranked(path)
        except ValueError as e:
            raise TraceError(str(e)) from None
    return rank


def _down(trace: Trace, node: str, a: float, b: float) -> float:
    return sum(max(0.0, min(o.end, b) - max(o.start, a)) for o in trace.outages.get(node, ()))


def windows(trace: Trace, top: int, days: float, rank: Ranking, start: float = START_DAY,
            seed: int = 0) -> list[dict]:
    """Per decision day: the window's faults, those avoided, a random drain's expectation,
    and the healthy node-days drained."""
    rng = random.Random(seed)
    out, t = [], start
    while t + days <= trace.days:
        known = trace.before(t)
        up = [n for n in trace.nodes if not any(o.start < t < o.end for o in known.outages.get(n, ()))]
        scores = rank(known, t)
        rng.shuffle(up)
        drained = set(sorted(up, key=lambda n: -scores.get(n, 0.0))[:top])
        hits = [o for n in up for o in trace.outages.get(n, ()) if t <= o.start < t + days and o.interrupts]
        avoided = sum(o.node in drained for o in hits)
        lost = sum(days - _down(trace, n, t, t + days) for n in drained)
        out.append({"day": t, "faults": len(hits), "avoided": avoided,
                    "random": len(hits) * len(drained) / max(len(up), 1), "node_days_lost": lost})
        t += days
    return out


def evaluate(trace: Trace, tops: tuple[int, ...], days: tuple[float, ...], rank: Ranking,
             cost_node_days: float, start: float = START_DAY, resamples: int = 200, seed: int = 0) -> dict:
    """Every (k, D): totals over the windows, the lift over a random drain with a bootstrap
    over windows, node-days per fault avoided, and the net node-days saved when one
    interruption costs a job ``cost_node_days``; ``supported``: the best setting whose
    lift's interval is above 1 and whose net is positive, or None."""
    rows = []
    for d in days:
        for k in tops:
            ws = windows(trace, k, d, rank, start, seed)
            if not ws:
                continue
            avoided, rand = sum(w["avoided"] for w in ws), sum(w["random"] for w in ws)
            lost = sum(w["node_days_lost"] for w in ws)
            rng = random.Random(seed)
            lifts = []
            for _ in range(resamples):
                pick = rng.choices(ws, k=len(ws))
                r = sum(w["random"] for w in pick)
                lifts.append(sum(w["avoided"] for w in pick) / r if r else math.nan)
            q = statistics.quantiles([x for x in lifts if not math.isnan(x)] or [math.nan], n=40, method="inclusive") \
                if len(lifts) > 1 else [math.nan, math.nan]
            rows.append({"top": k, "days": d, "windows": len(ws), "faults": sum(w["faults"] for w in ws),
                         "avoided": avoided, "random": rand, "lift": avoided / rand if rand else math.nan,
                         "lift_low": q[0], "lift_high": q[-1], "node_days_lost": lost,
                         "node_days_per_avoided": lost / avoided if avoided else math.inf,
                         "net_node_days": avoided * cost_node_days - lost})
    good = [r for r in rows if r["lift_low"] > 1 and r["net_node_days"] > 0]
    best = max(good, key=lambda r: r["net_node_days"]) if good else None
    return {"start_day": start, "cost_node_days_per_interruption": cost_node_days, "settings": rows,
            "supported": None if best is None else {"top": best["top"], "days": best["days"]}}


def table(res: dict) -> str:
    """``evaluate``'s settings as a Markdown table."""
    rows = ["| drain top k | for D days | windows | faults in them | avoided | random drain | lift [95 %] "
            "| healthy node-days drained | node-days per fault avoided | net node-days saved |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["settings"]:
        rows.append(f"| {r['top']} | {r['days']:g} | {r['windows']} | {r['faults']} | {r['avoided']} | "
                    f"{r['random']:.1f} | {r['lift']:.2f} [{r['lift_low']:.2f}, {r['lift_high']:.2f}] | "
                    f"{r['node_days_lost']:.0f} | {r['node_days_per_avoided']:.1f} | {r['net_node_days']:.0f} |")
    return "\n".join(rows)
