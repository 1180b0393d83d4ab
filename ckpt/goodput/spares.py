"""How many warm spares a job of N nodes needs to stay at full size, from a fault history
(``ckpt simulate --fault-trace FILE --spare-sizing``).

For each job size: the smallest pool that keeps the job at full size for at least
``TARGET`` of its time, averaged over random placements (the same placements for every
pool size, so the curve is monotone); its interval is a bootstrap over the fleet's servers
(each resample a fleet of as many servers drawn with replacement, each with its own fault
history), since one realisation of the trace cannot settle a figure at this level.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from telemetry.faults import Outage, Trace

from .replay import Played, replay

TARGET = 0.99
SIZES = (64, 128, 256)


@dataclass
class Sizing:
    """A job size's answer: ``spares`` (None: not achievable on this fleet), the bootstrap's
    interval on it, and the replays at that pool (for its ETTR)."""

    job_nodes: int
    spares: int | None
    low: int | None
    high: int | None
    full_share: float | None
    plays: list[Played]
    curve: dict[int, float]  # pool size -> mean time at full size (the point estimate's search)


def _full(trace: Trace, perms: list[list[str]], n: int, s: int, when_short: str) -> tuple[float, list[Played]]:
    plays = [replay(trace, p[:n], p[n:n + s], when_short) for p in perms]
    return statistics.fmean(p.full_share for p in plays), plays


def smallest_pool(trace: Trace, n: int, perms: list[list[str]], when_short: str = "wait",
                  target: float = TARGET) -> tuple[int | None, list[Played], dict[int, float]]:
    """Binary search for the smallest pool with mean full-size share ≥ ``target``."""
    lo, hi = 0, len(trace.nodes) - n
    if hi < 0:
        return None, [], {}
    curve: dict[int, float] = {}
    best: tuple[int, list[Played]] | None = None
    share, plays = _full(trace, perms, n, hi, when_short)
    curve[hi] = share
    if share < target:
        return None, plays, curve
    best = (hi, plays)
    while lo < hi:
        mid = (lo + hi) // 2
        share, plays = _full(trace, perms, n, mid, when_short)
        curve[mid] = share
        if share >= target:
            hi, best = mid, (mid, plays)
        else:
            lo = mid + 1
    return best[0], best[1], dict(sorted(curve.items()))


def resample_servers(trace: Trace, rng: random.Random) -> Trace:
    """A fleet of as many servers drawn with replacement, each copy renamed with its history."""
    outages, nodes = {}, []
    for i, n in enumerate(rng.choices(trace.nodes, k=len(trace.nodes))):
        name = f"{n}#{i}"
        nodes.append(name)
        if n in trace.outages:
            outages[name] = [Outage(name, o.start, o.end, o.kind, o.cls) for o in trace.outages[n]]
    return Trace(outages, nodes, trace.days, trace.source)


def size_pools(trace: Trace, sizes: tuple[int, ...], placements: int, resamples: int, seed: int,
               when_short: str = "wait", progress: Callable[[str], None] = lambda _: None) -> list[Sizing]:
    """For each job size, the smallest pool, its 95 % bootstrap interval over servers, and its replays."""
    out = []
    for n in sizes:
        rng = random.Random(seed)
        perms = [rng.sample(trace.nodes, len(trace.nodes)) for _ in range(placements)]
        spares, plays, curve = smallest_pool(trace, n, perms, when_short)
        draws = []
        for b in range(resamples):
            progress(f"{n} nodes: bootstrap {b + 1}/{resamples}")
            fleet = resample_servers(trace, rng)
            boot_perms = [rng.sample(fleet.nodes, len(fleet.nodes)) for _ in range(max(10, placements // 4))]
            s, _, _ = smallest_pool(fleet, n, boot_perms, when_short)
            draws.append(len(trace.nodes) if s is None else s)
        low = high = None
        if draws:
            q = statistics.quantiles(draws, n=40, method="inclusive")
            low, high = round(q[0]), round(q[-1])
        full = statistics.fmean(p.full_share for p in plays) if spares is not None else None
        out.append(Sizing(n, spares, low, high, full, plays, curve))
    return out


def plot(sizings: list[Sizing], trace: Trace, perms_seed: int, placements: int, path: str,
         when_short: str = "wait") -> None:
    """Time at full size against the pool, per job size, the target and each answer marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max([s.high or s.spares or 0 for s in sizings] + [4]) + 4
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in sizings:
        rng = random.Random(perms_seed)
        perms = [rng.sample(trace.nodes, len(trace.nodes)) for _ in range(placements)]
        pools = [k for k in range(0, top + 1, max(1, top // 24)) if s.job_nodes + k <= len(trace.nodes)]
        line = ax.plot(pools, [100 * _full(trace, perms, s.job_nodes, k, when_short)[0] for k in pools],
                       marker=".", label=f"{s.job_nodes} nodes")[0]
        if s.spares is not None:
            ax.axvline(s.spares, color=line.get_color(), linestyle=":", linewidth=1)
            if s.low is not None:
                ax.axvspan(s.low, s.high, color=line.get_color(), alpha=0.12)
    ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1, label=f"{TARGET:.0%} target")
    ax.set(xlabel="warm spares", ylabel="time at full size (%)", ylim=(max(0, ax.get_ylim()[0]), 100.5),
           title=f"Spares vs time at full size ({trace.source.rsplit('/', 1)[-1]}, {trace.days:.0f} days)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, "dotted: smallest pool; band: 95 % bootstrap over servers", fontsize=7, color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
