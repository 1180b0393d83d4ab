"""What a replayed job's history costs under each strategy: ETTR from the replay's
interruptions (``replay.Played``), its time short of nodes and its planned swaps.

Per replay, the interruptions that came while the job ran set its failure rate and kind mix;
the strategy's first-order waste at that rate (``model.analytic``: saves, lost work, each
restart's phases) applies to the time it ran. A planned swap costs a restart without its
detection or lost work (the job saves first). Time short costs all of it under ``wait``
(the job is stopped) and the missing nodes' share under ``shrink``.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from .model import Run, Strategy, analytic
from .replay import Played

Build = Callable[[Run], list[Strategy]]


def _run(p: Played, gpus_per_node: int, precursor_share: float) -> Run | None:
    running = p.days - p.stopped_days
    if not p.interrupted or running <= 0:
        return None
    i = p.interrupted
    return Run(p.job_nodes * gpus_per_node, running, i, p.interruptions["host"] / i, p.interruptions["gpu"] / i,
               precursor_share, gpus_per_node)


def ettr(p: Played, build: Build, gpus_per_node: int, precursor_share: float) -> dict[str, float]:
    """Strategy name -> ETTR of one replay."""
    run = _run(p, gpus_per_node, precursor_share)
    ref = run or Run(p.job_nodes * gpus_per_node, p.days, 1, 0.0, 1.0, precursor_share, gpus_per_node)
    out = {}
    for s in build(ref):
        waste = 0.0 if run is None else 1.0 - analytic(run, s).ettr
        swap = s.gpu
        swap_days = p.planned * (swap.replace_s + swap.relaunch_s + swap.inprocess_s + swap.restore_s) / 86400.0
        shrink = p.missing_node_days / p.job_nodes if p.stopped_days == 0 else 0.0
        out[s.name] = ((p.days - p.stopped_days) * (1.0 - waste) - swap_days - shrink) / p.days
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    """Mean and the 5th and 95th percentiles (over placements or realisations)."""
    if len(xs) == 1:
        return {"mean": xs[0], "p5": xs[0], "p95": xs[0]}
    q = statistics.quantiles(xs, n=20, method="inclusive")
    return {"mean": statistics.fmean(xs), "p5": q[0], "p95": q[-1]}


def summarise(plays: list[Played], build: Build, gpus_per_node: int, precursor_share: float) -> dict:
    """The replays' figures: interruptions, planned swaps, time at full size, days short,
    and each strategy's ETTR, each as mean and 5th-95th percentiles."""
    per = [ettr(p, build, gpus_per_node, precursor_share) for p in plays]
    return {"replays": len(plays), "days": plays[0].days,
            "interruptions": _spread([p.interrupted for p in plays]),
            "host_down_interruptions": _spread([p.interruptions["host"] for p in plays]),
            "planned_swaps": _spread([p.planned for p in plays]),
            "full_size_share": _spread([p.full_share for p in plays]),
            "short_days": _spread([p.short_days for p in plays]),
            "missing_node_days": _spread([p.missing_node_days for p in plays]),
            "ettr": {name: _spread([e[name] for e in per]) for name in per[0]}}


def side_by_side(real: dict, poisson: dict, labels: dict[str, str]) -> str:
    """The trace's figures beside the fitted Poisson process's, as a Markdown table."""
    def cell(x: dict, pct: bool) -> str:
        f = (lambda v: f"{v:.2%}") if pct else (lambda v: f"{v:.1f}")
        return f"{f(x['mean'])} [{f(x['p5'])}, {f(x['p95'])}]"

    rows = ["| figure (mean [5th, 95th percentile]) | trace replay | Poisson fitted to it |", "|---|---:|---:|"]
    for key, name, pct in (("interruptions", "interruptions of the job", False),
                           ("planned_swaps", "planned swaps", False),
                           ("full_size_share", "time at full size", True),
                           ("short_days", "days short of nodes", False),
                           ("missing_node_days", "node-days missing", False)):
        rows.append(f"| {name} | {cell(real[key], pct)} | {cell(poisson[key], pct)} |")
    for s, label in labels.items():
        rows.append(f"| ETTR {label} | {cell(real['ettr'][s], True)} | {cell(poisson['ettr'][s], True)} |")
    return "\n".join(rows)
