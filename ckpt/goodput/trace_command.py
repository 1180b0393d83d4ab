"""``ckpt simulate --fault-trace FILE``: a job replayed through a real fault history beside the
Poisson process fitted to it; ``--spare-sizing``; ``--quarantine-top/--quarantine-days``.

``command.py`` hands over here when ``--fault-trace`` is given; the strategies are the
simulator's own ((a)-(f), built by its ``build``), at the job's size.
"""
from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

import click

from telemetry.faults import Trace, TraceError, read_trace

from . import drain_eval, spares
from .model import Run, Strategy, analytic
from .replay import PLACEMENTS, WHEN_SHORT, PoissonFit, achievable, place, replay
from .trace_ettr import side_by_side, summarise

SIZING_POLICIES = ("b", "f")  # the sizing table's ETTR: relaunch from our tiers, and all of ours in-process


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if any(x < 1 for x in out):
        raise click.BadParameter("each must be at least 1")
    return out


TRACE_OPTIONS = [
    click.option("--fault-trace", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Replay this node fault history (InfiniteHBD JSON, or CSV node,start,end,kind: "
                 "docs/fault-trace.md) instead of Poisson failures; --gpus/--days/--failures are then unused."),
    click.option("--fleet-size", type=click.IntRange(min=1), default=None,
                 help="Nodes in the fleet, fault-free ones included (default: the JSON trace's 400; a CSV's "
                 "named nodes)."),
    click.option("--trace-days", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Replay [0, this) days (default: to the trace's last event)."),
    click.option("--job-nodes", type=click.IntRange(min=1), default=128, show_default=True),
    click.option("--spares", type=click.IntRange(min=0), default=8, show_default=True,
                 help="Warm spares in the job's pool; a repaired node returns to it."),
    click.option("--placement", type=click.Choice(PLACEMENTS), default="random", show_default=True,
                 help="random: job and spares drawn from the fleet, --placements times; fixed: the --place "
                 "list's nodes in order (job first), or the fleet sorted by name; fleet: every node not a spare."),
    click.option("--place", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="fixed placement: node ids, one per line."),
    click.option("--placements", type=click.IntRange(min=1), default=200, show_default=True,
                 help="Random placements, and Poisson realisations, to average over."),
    click.option("--when-short", type=click.Choice(WHEN_SHORT), default="wait", show_default=True,
                 help="Out of spares: the job waits for a repair, or runs on fewer nodes."),
    click.option("--poisson-repair", type=click.Choice(("empirical", "exponential")), default="empirical",
                 show_default=True, help="The fitted Poisson model's repairs: drawn from the trace's, or "
                 "exponential with their mean."),
    click.option("--spare-sizing", is_flag=True, help="The smallest pool per job size for full size "
                 f">= {spares.TARGET:.0%} of the time, with a bootstrap interval over servers."),
    click.option("--sizes", type=_ints, default=",".join(map(str, spares.SIZES)), show_default=True,
                 help="--spare-sizing's job sizes, in nodes."),
    click.option("--resamples", type=click.IntRange(min=0), default=50, show_default=True,
                 help="--spare-sizing: bootstrap resamples of the fleet's servers."),
    click.option("--plot", type=click.Path(dir_okay=False), default=None,
                 help="--spare-sizing: also draw the curves to this PNG (matplotlib: pip install "
                 "ckpt-guard[hazard])."),
    click.option("--quarantine-top", type=_ints, default=None, help="Evaluate draining the top k nodes "
                 f"(comma-separated; default with --quarantine-days: {','.join(map(str, drain_eval.TOPS))})."),
    click.option("--quarantine-days", type=_ints, default=None, help="...for D days (comma-separated; default "
                 f"with --quarantine-top: {','.join(f'{d:g}' for d in drain_eval.DAYS)})."),
    click.option("--quarantine-rankings", type=click.Path(exists=True, file_okay=False), default=None,
                 help="Folder of `predictor nodes rank` outputs, at_<DAY>.csv per decision day (default: "
                 "rank by past faults)."),
]


TRACE_KEYS = ("fault_trace", "fleet_size", "trace_days", "job_nodes", "spares", "placement", "place", "placements",
              "when_short", "poisson_repair", "spare_sizing", "sizes", "resamples", "plot", "quarantine_top",
              "quarantine_days", "quarantine_rankings")


def trace_options(command: Callable) -> Callable:
    """``TRACE_OPTIONS`` on ``command``, in their order."""
    for option in reversed(TRACE_OPTIONS):
        command = option(command)
    return command


def _fixed(path: str | None) -> list[str] | None:
    return None if path is None else [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def interruption_cost_s(run: Run, s: Strategy) -> float:
    """What one interruption costs the job under ``s``: its restart and its lost work, in seconds."""
    o = analytic(run, s)
    return (o.lost + o.restart) * run.wall_s / run.failures


def run_trace(opts: dict, build: Callable[[Run], list[Strategy]], run: Run, seed: int, as_json: bool) -> None:
    """Load the trace and answer what was asked: the replay, the sizing, the drains."""
    if opts["plot"] and importlib.util.find_spec("matplotlib") is None:
        click.echo("error: --plot needs matplotlib: pip install 'ckpt-guard[hazard]'", err=True)
        sys.exit(1)
    try:
        trace = read_trace(opts["fault_trace"], opts["fleet_size"], opts["trace_days"])
        fixed = _fixed(opts["place"])
        unknown = sorted(set(fixed or ()) - set(trace.nodes))
        if unknown:
            raise TraceError(f"--place names nodes not in the fleet: {', '.join(unknown[:5])}")
        if fixed is not None and len(fixed) < opts["job_nodes"] + opts["spares"]:
            raise TraceError(f"--place lists {len(fixed)} nodes; the job and its spares need "
                             f"{opts['job_nodes'] + opts['spares']}")
    except (TraceError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    gpn, pre = run.gpus_per_node, run.precursor_share
    labels = {s.name: s.label for s in build(run)}
    fit = PoissonFit.of(trace, opts["poisson_repair"])
    n, s = opts["job_nodes"], opts["spares"]
    if opts["placement"] == "fleet":
        n = len(trace.nodes) - s
    payload: dict = {"trace": _describe(trace, fit), "job": {"nodes": n, "spares": s, "placement": opts["placement"],
                     "when_short": opts["when_short"], "gpus_per_node": gpn, "seed": seed}}
    lines = [_header(trace, fit)]
    why = achievable(trace, n, s) if n > 0 else f"not achievable: {s} spares leave no node for the job"
    if why:
        payload["replay"] = {"achievable": False, "why": why}
        lines += ["", why]
    else:
        rng = random.Random(seed)
        times = 1 if opts["placement"] == "fixed" else opts["placements"]
        placed = [place(trace, n, s, opts["placement"], rng, fixed) for _ in range(times)]
        real = [replay(trace, j, p, opts["when_short"]) for j, p in placed]
        poisson = [replay(fit.sample(trace.nodes, trace.days, rng), *place(trace, n, s, "random", rng),
                          opts["when_short"]) for _ in range(opts["placements"])]
        real_s, poisson_s = (summarise(x, build, gpn, pre) for x in (real, poisson))
        payload["replay"] = {"achievable": True, "trace": real_s, "poisson": poisson_s}
        lines += ["", f"A job of {n} nodes ({n * gpn} GPUs) with {s} warm spares, {opts['placement']} placement "
                  f"({times} replay{'s' * (times > 1)}; Poisson: {opts['placements']} realisations), "
                  f"{opts['when_short']} when short:", "", side_by_side(real_s, poisson_s, labels)]
    if opts["spare_sizing"]:
        lines += ["", *_sizing(trace, opts, build, gpn, pre, seed, payload)]
    if opts["quarantine_top"] or opts["quarantine_days"]:
        lines += ["", *_drains(trace, opts, build, run, n, seed, payload)]
    if as_json:
        click.echo(json.dumps(_finite(payload), indent=2))
    else:
        click.echo("\n".join(lines))


def _finite(x: object) -> object:
    """``x`` with every infinite or NaN float as None: strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _describe(trace: Trace, fit: PoissonFit) -> dict:
    return {"source": trace.source, "fleet": len(trace.nodes), "days": trace.days, "faults": trace.raw_faults,
            "outages": sum(trace.kinds.values()), "outages_by_class": trace.kinds,
            "burn_in_merged": trace.burn_in_merged,
            "poisson": {"rate_per_node_day": fit.rate_per_node_day, "class_share": fit.class_share,
                        "repair": fit.repair, "mean_repair_days": fit.mean_repair_days,
                        "closed_repairs": len(fit.repairs_days)}}


def _header(trace: Trace, fit: PoissonFit) -> str:
    k = trace.kinds
    return (f"{trace.source}: {len(trace.nodes)} nodes, {trace.days:.1f} days, {trace.raw_faults} faults -> "
            f"{sum(k.values())} outages ({trace.burn_in_merged} burn-in failures folded into the repair before "
            f"them): {k.get('gpu', 0) + k.get('host', 0)} stop a job ({k.get('host', 0)} host down), "
            f"{k.get('planned', 0)} planned, {k.get('test', 0)} stress tests. Poisson fit: "
            f"{fit.rate_per_node_day * 365:.2f} outages per node-year of uptime, repairs {fit.repair} "
            f"(mean {fit.mean_repair_days:.1f} days over {len(fit.repairs_days)} closed).")


def _sizing(trace: Trace, opts: dict, build: Callable, gpn: int, pre: float, seed: int, payload: dict) -> list[str]:
    progress = (lambda m: click.echo(m, err=True)) if sys.stderr.isatty() else (lambda _: None)
    sizes = spares.size_pools(trace, opts["sizes"], max(20, opts["placements"] // 2), opts["resamples"], seed,
                              opts["when_short"], progress)
    rows = ["| job nodes | smallest pool | 95 % interval (servers) | time at full size | "
            + " | ".join(f"ETTR ({p})" for p in SIZING_POLICIES) + " |", "|---:|---:|---:|---:|" + "---:|" *
            len(SIZING_POLICIES)]
    out = []
    for z in sizes:
        if z.spares is None:
            rows.append(f"| {z.job_nodes} | not achievable | | | " + " | " * (len(SIZING_POLICIES) - 1) + " |")
            out.append({"job_nodes": z.job_nodes, "spares": None, "achievable": False})
            continue
        ettr = summarise(z.plays, build, gpn, pre)["ettr"]
        rows.append(f"| {z.job_nodes} | {z.spares} | [{z.low}, {z.high}] | {z.full_share:.2%} | "
                    + " | ".join(f"{ettr[p]['mean']:.2%}" for p in SIZING_POLICIES) + " |")
        out.append({"job_nodes": z.job_nodes, "spares": z.spares, "interval": [z.low, z.high], "achievable": True,
                    "full_size_share": z.full_share, "curve": z.curve,
                    "ettr": {k: v["mean"] for k, v in ettr.items()}})
    payload["spare_sizing"] = {"target": spares.TARGET, "resamples": opts["resamples"], "sizes": out}
    lines = [f"Smallest warm-spare pool for full size >= {spares.TARGET:.0%} of the time ({opts['when_short']} "
             f"when short; {opts['resamples']} bootstrap resamples of the servers):", "", *rows]
    if opts["plot"]:
        spares.plot(sizes, trace, seed, max(20, opts["placements"] // 2), opts["plot"], opts["when_short"])
        lines += ["", f"plot: {opts['plot']}"]
        payload["spare_sizing"]["plot"] = opts["plot"]
    return lines


def _drains(trace: Trace, opts: dict, build: Callable, run: Run, job_nodes: int, seed: int,
            payload: dict) -> list[str]:
    tops = opts["quarantine_top"] or drain_eval.TOPS
    days = tuple(float(d) for d in (opts["quarantine_days"] or drain_eval.DAYS))
    rank = drain_eval.from_folder(Path(opts["quarantine_rankings"])) if opts["quarantine_rankings"] \
        else drain_eval.past_faults
    # one interruption of this job under (b), at the trace's own rate for a job this size
    rate = sum(trace.kinds.get(k, 0) for k in ("gpu", "host")) / len(trace.nodes) * max(job_nodes, 1)
    ref = Run(max(job_nodes, 1) * run.gpus_per_node, trace.days, max(1, round(rate)),
              run.host_down_share, run.gpu_failure_share, run.precursor_share, run.gpus_per_node)
    b = next(s for s in build(ref) if s.name == "b")
    cost = max(job_nodes, 1) * interruption_cost_s(ref, b) / 86400.0
    try:
        res = drain_eval.evaluate(trace, tops, days, rank, cost, seed=seed)
    except TraceError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    res["ranking"] = opts["quarantine_rankings"] or "past faults (baseline)"
    payload["quarantine"] = res
    sup = res["supported"]
    verdict = (f"supported: drain the top {sup['top']} for {sup['days']:g} days" if sup else
               "supported: none (no setting beats a random drain with confidence and saves more than it costs)")
    return [f"Draining the top k nodes for D days, decided every D days from day {res['start_day']:g} on the "
            f"history before each decision (ranking: {res['ranking']}); one interruption of the "
            f"{job_nodes}-node job costs {cost:.2f} node-days under (b):", "", drain_eval.table(res), "", verdict]
