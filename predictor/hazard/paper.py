"""The SC20 paper's main findings (Ostrouchov et al., GPU Lifetimes on Titan) from the history, as a check.

Each GPU's life runs from its first insert to its first DBE or OTB, censored when it leaves
service healthy or at the record's end. Kaplan-Meier curves by batch (old: first insert
before 2016), by cage and by node in the blade; Cox hazard ratios of the same terms.
Service nodes (the paper leaves them out) are dropped when their list is given.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from predictor.hazard.history import History, parse_time
from predictor.hazard.models import fit_cox

DAY = 86400.0
NEW_BATCH_FROM = "2016-01-01"
MIN_AT_RISK = 100   # a curve stops where fewer GPUs are followed: its last steps would be noise


def lifetimes(h: History, service_locations: set[str] = frozenset()) -> dict[str, np.ndarray]:
    """Per GPU: days from first insert to its first event or censoring, the event flag, batch, first cage and node."""
    first = h.first_insert()
    first_stay = np.full(len(h.serials), -1)
    for i in np.argsort(-h.stay_in):
        first_stay[h.stay_gpu[i]] = i
    seen = first_stay >= 0
    ev_t = np.full(len(h.serials), np.inf)
    np.minimum.at(ev_t, h.event_gpu, h.event_t)
    last = np.full(len(h.serials), -np.inf)
    np.maximum.at(last, h.stay_gpu, h.stay_out_t)
    keep = seen & ~np.isin(h.stay_location[np.maximum(first_stay, 0)], list(service_locations))
    event = np.isfinite(ev_t)
    end = np.where(event, ev_t, last)
    loc = h.stay_loc[first_stay[keep]]
    return {"days": np.maximum((end - first)[keep] / DAY, 0.0), "event": event[keep], "start": first[keep],
            "old": first[keep] < parse_time(NEW_BATCH_FROM), "cage": loc[:, 2], "node": loc[:, 4]}


def service_locations(path: str | Path) -> set[str]:
    """Locations of service nodes from Titan's titan.service.txt (the third column)."""
    return {parts[2] for parts in (line.split() for line in Path(path).read_text().splitlines()) if len(parts) > 2}


def kaplan_meier(days: np.ndarray, event: np.ndarray, min_at_risk: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(event times, survival just after each), while at least ``min_at_risk`` GPUs are still followed."""
    t, inv = np.unique(days, return_inverse=True)
    d = np.bincount(inv, weights=event.astype(float))
    n = len(days) - np.r_[0, np.cumsum(np.bincount(inv))[:-1]]
    s = np.cumprod(1.0 - d / n)
    keep = (d > 0) & (n >= min_at_risk)
    return t[keep], s[keep]


def hazard_ratios(life: dict[str, np.ndarray]) -> dict[str, float]:
    """Cox hazard ratios: old batch vs new, cage 1 and 2 vs 0, node 1-3 vs 0 (one model, all terms)."""
    z = np.column_stack([life["old"], life["cage"] == 1, life["cage"] == 2,
                         life["node"] == 1, life["node"] == 2, life["node"] == 3]).astype(float)
    names = ("old_batch", "cage1", "cage2", "node1", "node2", "node3")
    coef, std, _, _ = fit_cox(z, np.maximum(life["days"], 1e-3), life["event"], ridge=1e-3)
    return {n: float(np.exp(c / s)) for n, c, s in zip(names, coef, std.scale)}


def _rate(days_in: np.ndarray, event_in: np.ndarray) -> tuple[int, float]:
    """(events, GPU-years) of a group."""
    return int(event_in.sum()), float(days_in.sum() / 365.25)


def batch_rates(life: dict[str, np.ndarray], age_years: int = 2) -> dict[str, dict]:
    """Old vs new batch failures per GPU-year, where the two can be compared at all.

    At equal age: each of the first ``age_years`` years since first insert (the new batch is
    followed less than two). In the same months: a Mantel-Haenszel rate ratio over calendar
    quarters x cage from 2016 on, when both batches were in service side by side."""
    days, event, old, start = life["days"], life["event"], life["old"], life["start"]
    out: dict[str, dict] = {}
    for k in range(age_years):
        lo, hi = k * 365.25, (k + 1) * 365.25
        exposure = np.clip(np.minimum(days, hi) - lo, 0, None)
        hit = event & (days >= lo) & (days < hi)
        (eo, yo), (en, yn) = _rate(exposure[old], hit[old]), _rate(exposure[~old], hit[~old])
        out[f"age_year_{k}"] = {"old": [eo, round(yo)], "new": [en, round(yn)],
                                "ratio": round((eo / yo) / (en / yn), 3) if eo and en else None}
    end = start + days * DAY
    bounds = [parse_time(f"{y}-{m:02d}-01") for y in range(2016, 2030) for m in (1, 4, 7, 10)]
    bounds = [b for b in bounds if b < end.max()] + [float(end.max()) + 1]
    num = den = 0.0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        exposure = np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0, None) / DAY
        hit = event & (end >= lo) & (end < hi)
        for c in np.unique(life["cage"]):
            m = life["cage"] == c
            t_old, t_new = exposure[m & old].sum(), exposure[m & ~old].sum()
            if t_old + t_new > 0:
                num += hit[m & old].sum() * t_new / (t_old + t_new)
                den += hit[m & ~old].sum() * t_old / (t_old + t_new)
    out["same_quarters_by_cage"] = {"ratio": round(num / den, 2) if den else None}
    return out


def plot(life: dict[str, np.ndarray], out_dir: Path) -> list[Path]:
    """One PNG of Kaplan-Meier curves per grouping (batch, cage, node)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = {"batch": {"old (first insert before 2016)": life["old"], "new": ~life["old"]},
              "cage": {f"cage {c}": life["cage"] == c for c in range(3)},
              "node": {f"node {n}": life["node"] == n for n in range(4)}}
    out = []
    for name, masks in groups.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, m in masks.items():
            t, s = kaplan_meier(life["days"][m], life["event"][m], min_at_risk=MIN_AT_RISK)
            ax.step(np.r_[0, t] / 365.25, np.r_[1, s], where="post", label=f"{label} ({int(m.sum())} GPUs)")
        ax.set_xlabel("years since first insert")
        ax.set_ylabel("share without a DBE or OTB")
        ax.set_title(f"Titan K20X survival by {name} (Kaplan-Meier)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        path = out_dir / f"km_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)
    return out
