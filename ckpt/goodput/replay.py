"""A job of N nodes and S warm spares played through a fleet's fault history, and the
Poisson process fitted to the same history to compare with.

The job holds N nodes and a pool of S spares, both drawn from the fleet (``place``). A job
node whose outage begins leaves the job: a spare takes its place while the pool has one;
when the pool is empty the job is short until a node of its own comes back from repair
(a repaired node rejoins a short job, or else the pool). Short, the job either waits
(``wait``: stopped) or runs on fewer nodes (``shrink``). An outage that stops a job
(``trace.Outage.interrupts``) counts as an interruption only while the job runs; a planned
or test outage takes its node away without one (``planned``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from telemetry.faults import Outage, Trace

WHEN_SHORT = ("wait", "shrink")
PLACEMENTS = ("random", "fixed", "fleet")


@dataclass
class Played:
    """One replay: what happened to the job over ``days``."""

    days: float
    job_nodes: int
    interruptions: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0})
    planned: int = 0
    short_days: float = 0.0  # below full size (stopped, under ``wait``)
    missing_node_days: float = 0.0  # the shortfall's integral (nodes x days)
    stopped_days: float = 0.0

    @property
    def full_share(self) -> float:
        return 1.0 - self.short_days / self.days

    @property
    def interrupted(self) -> int:
        return sum(self.interruptions.values())


def replay(trace: Trace, job: list[str], spares: list[str], when_short: str = "wait") -> Played:
    """Play ``trace`` against a job on ``job`` with ``spares`` in its pool."""
    role = {n: "job" for n in job} | {n: "spare" for n in spares}
    pool = list(spares)
    events: list[tuple[float, int, Outage]] = []
    for n in role:
        for o in trace.outages.get(n, ()):
            if o.start < trace.days:
                events.append((o.start, 1, o))
                if o.end < trace.days:
                    events.append((o.end, 0, o))  # at a tie a repair comes first
    events.sort(key=lambda e: (e[0], e[1], e[2].node))
    out = Played(trace.days, len(job))
    short, since = 0, 0.0

    def advance(t: float) -> None:
        nonlocal since
        if short:
            out.short_days += t - since
            out.missing_node_days += short * (t - since)
            if when_short == "wait":
                out.stopped_days += t - since
        since = t

    for t, starts, o in events:
        advance(t)
        n = o.node
        if not starts:
            if short:
                role[n], short = "job", short - 1
            else:
                role[n] = "spare"
                pool.append(n)
        elif role[n] == "spare":
            pool.remove(n)
            role[n] = "down"
        elif role[n] == "job":
            running = short == 0 or (when_short == "shrink" and short < len(job))
            if running and o.interrupts:
                out.interruptions[o.cls] += 1
            elif running:
                out.planned += 1
            role[n] = "down"
            if pool:
                role[pool.pop(0)] = "job"
            else:
                short += 1
    advance(trace.days)
    return out


def place(trace: Trace, job_nodes: int, spares: int, mode: str, rng: random.Random,
          fixed: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(job nodes, spares): ``random`` draws them from the fleet; ``fixed`` takes the listed
    nodes in order (default: the fleet sorted by name), the job's first; ``fleet``: every node
    not a spare is in the job."""
    if mode == "random":
        nodes = rng.sample(trace.nodes, job_nodes + spares)
    elif mode == "fixed":
        nodes = (fixed or trace.nodes)[: job_nodes + spares]
    else:
        nodes = rng.sample(trace.nodes, len(trace.nodes))
        job_nodes = len(nodes) - spares
    return nodes[:job_nodes], nodes[job_nodes:job_nodes + spares]


def achievable(trace: Trace, job_nodes: int, spares: int) -> str | None:
    """Why the job cannot be placed on this fleet, or None."""
    if job_nodes + spares > len(trace.nodes):
        return (f"not achievable: {job_nodes} job nodes + {spares} spares > the fleet's {len(trace.nodes)} nodes")
    return None


@dataclass(frozen=True)
class PoissonFit:
    """Every node faults at one rate while up (outages per node-day of uptime), each fault's
    class drawn from the trace's mix, each repair from the trace's closed repairs
    (``empirical``) or exponential with their mean."""

    rate_per_node_day: float
    class_share: dict[str, float]
    repairs_days: tuple[float, ...]
    repair: str = "empirical"

    @classmethod
    def of(cls, trace: Trace, repair: str = "empirical") -> PoissonFit:
        outages = trace.all_outages
        down = sum(min(o.end, trace.days) - o.start for o in outages)
        up = len(trace.nodes) * trace.days - down
        counts: dict[str, int] = {}
        for o in outages:
            counts[o.cls] = counts.get(o.cls, 0) + 1
        closed = tuple(sorted(o.end - o.start for o in outages if math.isfinite(o.end)))
        return cls(len(outages) / up, {k: v / len(outages) for k, v in counts.items()}, closed, repair)

    @property
    def mean_repair_days(self) -> float:
        return sum(self.repairs_days) / len(self.repairs_days)

    def sample(self, nodes: list[str], days: float, rng: random.Random) -> Trace:
        """One realisation over ``nodes``: up Exp(rate), down one repair, up again, ..."""
        classes, weights = zip(*self.class_share.items())
        outages: dict[str, list[Outage]] = {}
        for n in nodes:
            t = rng.expovariate(self.rate_per_node_day)
            while t < days:
                cls = rng.choices(classes, weights)[0]
                d = rng.choice(self.repairs_days) if self.repair == "empirical" else \
                    rng.expovariate(1.0 / self.mean_repair_days)
                outages.setdefault(n, []).append(Outage(n, t, t + d, cls, cls))
                t += d + rng.expovariate(self.rate_per_node_day)
        return Trace(outages, nodes, days, "poisson")
