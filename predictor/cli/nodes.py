"""`predictor nodes rank / evaluate / drain`: node risk from a fault history (docs/fault-trace.md); the
work is in ``predictor.hazard.node_risk`` and ``node_eval``."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import click

# numpy, scikit-learn and the trace reader are imported inside the commands: `--help` answers at once.

_faults_opt = click.option("--faults", "faults_path", required=True, type=click.Path(exists=True, dir_okay=False),
                           help="fault history: the InfiniteHBD JSON, or CSV node,start,end,kind")
_fleet_opt = click.option("--fleet-size", type=click.IntRange(min=1), default=None,
                          help="nodes in the fleet, fault-free ones included (default: the JSON's 400; a CSV's named)")
_horizon_opt = click.option("--horizon-days", default=30.0, show_default=True, type=click.FloatRange(min=1))
_json_opt = click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")


class BadInput(click.ClickException):
    """Malformed input: one message, exit code 2."""

    exit_code = 2


def _trace(path: str, fleet: int | None, days: float | None = None):
    from telemetry.faults import TraceError, read_trace
    try:
        return read_trace(path, fleet, days)
    except TraceError as e:
        raise BadInput(str(e)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def nodes() -> None:
    """Which nodes will fault next, learned from the fleet's fault history."""


@nodes.command()
@_faults_opt
@click.option("--at", "at", required=True, type=click.FloatRange(min=0), help="rank as of this day; only events "
              "before it are read")
@_horizon_opt
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="scores CSV to write (node_id,probability, riskiest first)")
@click.option("--nodes", "nodes_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the fleet's node ids, one per line: those absent from the history get a row too")
@_fleet_opt
@_json_opt
def rank(faults_path: str, at: float, horizon_days: float, out: Path, nodes_path: Path | None, fleet_size: int | None,
         as_json: bool) -> None:
    """Write, for every node, the probability that it faults within the horizon after --at."""
    from predictor.hazard.node_risk import rank as fit_rank
    trace = _trace(faults_path, fleet_size)
    try:
        risk = fit_rank(trace, at, horizon_days)
    except ValueError as e:
        raise BadInput(str(e)) from None
    named = set(trace.named_nodes)
    rows = [(risk.nodes[i], float(risk.probability[i])) for i in risk.order() if risk.nodes[i] in named]
    listed = [n.strip() for n in nodes_path.read_text().splitlines() if n.strip()] if nodes_path else []
    rows += [(n, risk.absent_probability) for n in listed if n not in named]
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["node_id", "probability"])
        w.writerows((n, f"{p:.6f}") for n, p in rows)
    summary = {"scores": str(out), "at": at, "horizon_days": horizon_days, "nodes_written": len(rows),
               "fleet": len(risk.nodes), "expected_faulting_nodes": float(risk.probability.sum()),
               "absent_node_probability": risk.absent_probability, "train_rows": risk.train_rows,
               "train_events": risk.train_events}
    click.echo(json.dumps(summary, indent=1) if as_json else "\n".join(f"{k}: {v}" for k, v in summary.items()))


@nodes.command()
@_faults_opt
@click.option("--at", "cuts", multiple=True, type=float, help="cuts: learn before each, judge on the horizon after "
              "(repeatable; default: day 90, then every 30 days while the horizon fits, and the last that fits)")
@_horizon_opt
@click.option("--resamples", default=200, show_default=True, type=click.IntRange(min=10))
@_fleet_opt
@_json_opt
def evaluate(faults_path: str, cuts: tuple[float, ...], horizon_days: float, resamples: int, fleet_size: int | None,
             as_json: bool) -> None:
    """The ranking against past-fault counts and recency on earlier cuts: AUC, top-10 % precision, intervals."""
    from predictor.hazard import node_eval
    trace = _trace(faults_path, fleet_size)
    if not cuts:
        last = math.floor(trace.days - horizon_days)
        cuts = tuple(range(90, last, 30)) + ((last,) if last >= 90 else ())
    try:
        res = node_eval.evaluate(trace, [float(c) for c in cuts], horizon_days, resamples,
                                 progress=lambda m: click.echo(m, err=True))
    except ValueError as e:
        raise BadInput(str(e)) from None
    click.echo(json.dumps(res, indent=1) if as_json else node_eval.table(res))


@nodes.command()
@click.option("--scores", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a `predictor nodes rank` CSV")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1))
@_json_opt
def drain(scores: Path, top: int, as_json: bool) -> None:
    """The drain list from a ranking: its top nodes, riskiest first (feed them to `predictor act drain`)."""
    from telemetry.faults import ranked
    try:
        picked = [{"node": n, "probability": p} for n, p in ranked(scores, top).items()]
    except ValueError as e:
        raise BadInput(str(e)) from None
    click.echo(json.dumps({"nodes": picked}, indent=1) if as_json else
               "\n".join(f"{d['node']}  {d['probability']:.2%}" for d in picked))
