"""`predictor hazard train / score / compare / drain`: fleet hazard from a service history."""
from __future__ import annotations

import json
import logging
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

# numpy, scikit-learn and skops are imported inside the commands: `--help` answers at once.

_history_opt = click.option("--history", "history_path", required=True,
                            type=click.Path(exists=True, path_type=Path),
                            help="service history CSV (SN, location, insert, remove, duration, out, event), "
                                 "or a telemetry trace directory (DBE counter, XID 48/79)")
_tz_opt = click.option("--tz", help="zone of the history's times and of --at/--as-of "
                                   "(default: America/New_York for a CSV, whose times carry none; UTC for a trace)")
_horizon_opt = click.option("--horizon-days", default=180.0, show_default=True, type=click.FloatRange(min=1))
_json_opt = click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")


class BadInput(click.ClickException):
    """Malformed input: one message, exit code 2."""

    exit_code = 2


def _zone(history_path: Path, tz: str | None) -> str:
    """The zone to read times in: the one given, else Titan's local time for a CSV, UTC for a trace."""
    from predictor.hazard.history import DEFAULT_TZ
    return tz or ("UTC" if history_path.is_dir() else DEFAULT_TZ)


def _read(path: Path, tz: str):
    from predictor.hazard.history import HistoryError, read_history
    from predictor.hazard.trace_history import read_trace_history
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return read_trace_history(path) if path.is_dir() else read_history(path, tz=tz)
    except HistoryError as e:
        raise BadInput(str(e)) from None


def _time(text: str | None, tz: str, default: float) -> float:
    from predictor.hazard.history import parse_time
    if text is None:
        return default
    try:
        return parse_time(text, tz)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a time like 2018-01-01 or 2018-01-01T00:00:00") from None


def _emit(summary: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        for k, v in summary.items():
            click.echo(f"{k}: {v}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def hazard() -> None:
    """Which GPUs will fail in the coming months, learned from the fleet's service history."""


@hazard.command()
@_history_opt
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="model file to write")
@click.option("--kind", default="boosted", show_default=True, type=click.Choice(["boosted", "cox", "weibull"]),
              help="boosted: the best on the landmark splits (docs/hazard.md)")
@click.option("--as-of", "as_of", help="train on what was known then (default: the history's end)")
@click.option("--step-days", default=30.0, show_default=True, type=click.FloatRange(min=1),
              help="days between landmarks")
@click.option("--seed", default=0, show_default=True)
@_horizon_opt
@_tz_opt
@_json_opt
def train(history_path: Path, out: Path, kind: str, as_of: str | None, step_days: float, seed: int,
          horizon_days: float, tz: str | None, as_json: bool) -> None:
    """Fit a model of the time to each GPU's next DBE or OTB on landmark windows of its history."""
    from predictor.hazard import store, training
    tz = _zone(history_path, tz)
    h = _read(history_path, tz)
    until = _time(as_of, tz, h.end_t)
    try:
        data = training.landmark_set(h, until, horizon_days, step_days)
        click.echo(f"fitting {kind} on {len(data.x)} GPU-landmarks ({data.landmarks} landmarks, "
                   f"{int(data.event.sum())} events within {horizon_days:g} days)", err=True)
        model = training.fit(kind, data, horizon_days, seed=seed)
    except ValueError as e:
        raise BadInput(str(e)) from None
    info = {"history": str(history_path), "as_of": until, "landmarks": data.landmarks, "rows": len(data.x),
            "events": int(data.event.sum()), "step_days": step_days, "seed": seed}
    store.save(store.HazardModel(model, horizon_days, info), out)
    _emit({"model": str(out), "kind": kind, "horizon_days": horizon_days, **info}, as_json)


def _scores(model_path: Path, history_path: Path, at: str | None, horizon_days: float, tz: str | None):
    from predictor.hazard import scoring, store
    try:
        hm = store.load(model_path)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot load model: {e}") from None
    tz = _zone(history_path, tz)
    h = _read(history_path, tz)
    t = _time(at, tz, h.end_t)
    first = float(h.stay_in.min())
    if not first <= t <= h.end_t:
        raise BadInput(f"--at {at} is outside the history ({_day(first)} to {_day(h.end_t)}): nothing to score")
    s = scoring.score(hm, h, t, horizon_days)
    if not len(s.probability):
        raise BadInput(f"no GPU is in service at {at or _day(t)} in {history_path}: nothing to score")
    return s, t


def _day(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d")


_model_opt = click.option("--model", "model_path", required=True,
                          type=click.Path(exists=True, dir_okay=False, path_type=Path))
_at_opt = click.option("--at", help="score the GPUs in service at this time (default: the history's end)")


@hazard.command()
@_model_opt
@_history_opt
@_at_opt
@_horizon_opt
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="scores CSV to write")
@click.option("--prom", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the ckpt_guard_gpu_hazard gauge here (node-exporter textfile)")
@_tz_opt
@_json_opt
def score(model_path: Path, history_path: Path, at: str | None, horizon_days: float, out: Path,
          prom: Path | None, tz: str | None, as_json: bool) -> None:
    """Write, for every GPU in service at --at, the probability of a DBE or OTB within the horizon."""
    from predictor.hazard import scoring
    s, t = _scores(model_path, history_path, at, horizon_days, tz)
    scoring.write_csv(s, out)
    if prom:
        scoring.write_gauge(s, prom, horizon_days)
    top = s.order()[: max(1, len(s.probability) // 20)]
    _emit({"scores": str(out), "gpus": len(s.probability), "at": t, "horizon_days": horizon_days,
           "mean_probability": float(s.probability.mean()) if len(top) else 0.0,
           "expected_failures": float(s.probability.sum()),
           "top5pct_mean_probability": float(s.probability[top].mean()) if len(top) else 0.0}, as_json)


@hazard.command()
@_model_opt
@_history_opt
@_at_opt
@_horizon_opt
@click.option("--top", default=20, show_default=True, type=click.IntRange(min=1))
@_tz_opt
@_json_opt
def drain(model_path: Path, history_path: Path, at: str | None, horizon_days: float, top: int, tz: str | None,
          as_json: bool) -> None:
    """The GPUs and blades to pull first, each with its probability and reasons."""
    from predictor.hazard.drain import drain_list
    s, _ = _scores(model_path, history_path, at, horizon_days, tz)
    d = drain_list(s, top)
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    click.echo(f"{d['fleet_gpus']} GPUs in service, mean probability {d['fleet_mean_probability']:.2%} "
               f"within {horizon_days:g} days")
    for g in d["gpus"]:
        click.echo(f"{g['SN']}  {g['location']:<14} {g['probability']:7.2%}  "
                   f"x{g['times_fleet_mean']:<5} {g['reasons']}")
    click.echo("blades (any GPU fails):")
    for b in d["blades"]:
        click.echo(f"{b['blade']:<12} {b['probability_any']:7.2%}  worst {b['worst']}")


@hazard.command()
@_history_opt
@click.option("--as-of", "as_of", multiple=True, default=["2017-07-01", "2017-01-01"], show_default=True,
              help="landmark split: train on what was known then, judge on the horizon after (repeatable)")
@click.option("--resamples", default=200, show_default=True, type=click.IntRange(min=10))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="results JSON to write")
@_horizon_opt
@_tz_opt
@_json_opt
def compare(history_path: Path, as_of: tuple[str, ...], resamples: int, out: Path | None, horizon_days: float,
            tz: str | None, as_json: bool) -> None:
    """Compare the models (and the hand-made score) on landmark splits, with 95 % bootstrap intervals."""
    from predictor.hazard.comparison import compare_models
    tz = _zone(history_path, tz)
    h = _read(history_path, tz)
    res = compare_models(h, {a: _time(a, tz, h.end_t) for a in as_of}, horizon_days, resamples,
                         progress=lambda msg: click.echo(msg, err=True))
    res["run"] = {"command": " ".join(["predictor", *sys.argv[1:]]), "machine": f"{platform.machine()}, "
                  f"{os.cpu_count()} CPUs", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "load_1m": os.getloadavg()[0]}
    if out:
        out.write_text(json.dumps(res, indent=1))
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    for split in res["splits"]:
        click.echo(f"as of {split['as_of']}: {split['gpus']} GPUs, {split['events']} with an event within "
                   f"{horizon_days:g} days")
        for name, m in split["models"].items():
            click.echo(f"  {name:<9} " + "  ".join(f"{k} {v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" for k, v in m.items()))


@hazard.command()
@_history_opt
@click.option("--out-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="where the Kaplan-Meier PNGs and hazard_ratios.json go")
@click.option("--service-nodes", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="titan.service.txt: service nodes, left out as in the paper")
@_tz_opt
@_json_opt
def paper(history_path: Path, out_dir: Path, service_nodes: Path | None, tz: str | None, as_json: bool) -> None:
    """The SC20 paper's findings from the history: survival by batch, cage and node; Cox hazard ratios."""
    from predictor.hazard import paper as sc20
    h = _read(history_path, _zone(history_path, tz))
    life = sc20.lifetimes(h, sc20.service_locations(service_nodes) if service_nodes else set())
    out_dir.mkdir(parents=True, exist_ok=True)
    hr = sc20.hazard_ratios(life)
    summary = {"gpus": int(len(life["days"])), "events": int(life["event"].sum()),
               "old_gpus": int(life["old"].sum()), "hazard_ratios": {k: round(v, 3) for k, v in hr.items()},
               "old_vs_new_per_gpu_year": sc20.batch_rates(life),
               "plots": [str(p) for p in sc20.plot(life, out_dir)]}
    (out_dir / "hazard_ratios.json").write_text(json.dumps(summary, indent=1))
    _emit(summary, as_json)
