"""`predictor train / score / eval / serve / act`."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import tempfile
from pathlib import Path

import click

from predictor.cli.act import act
from predictor.cli.history import history_trace, prometheus_options
from predictor.cli.label import label, write_labelled
from predictor.cli.nodes import nodes
from predictor.hazard.cli import hazard
from predictor.ingest.auth import ENV_FILE, ENV_TOKENS, ROLES
from telemetry.cli_group import role_group

# scikit-learn, skops and pyarrow are imported inside the commands: `--help` and usage
# errors answer at once.


def _load_model(path: str | None):
    from predictor.model import model_io
    try:
        return model_io.load(path)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot load model: {e}") from e


def _threshold(model, which: str) -> float:
    if which in ("sensitive", "strict"):
        return getattr(model, which)
    try:
        return float(which)
    except ValueError:
        raise click.BadParameter("sensitive, strict or a number", param_hint="--threshold") from None


_trace_dir = click.Path(exists=True, file_okay=False, path_type=Path)
_model_opt = click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False),
                          help="model file (default: the packaged model)")
_failures_opt = click.option("--failures", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                             help="failures.parquet labelling the --prometheus window")
_threshold_opt = click.option("--threshold", default="sensitive", show_default=True,
                              help="sensitive, strict, or a risk between 0 and 1")


@click.group(cls=role_group("predictor"), context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Predict GPU failures from fleet telemetry."""


@main.command()
@click.option("--trace", "traces", multiple=True, type=_trace_dir,
              help="labelled trace directory (repeatable)")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="model file to write")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the model summary as JSON")
@_failures_opt
@prometheus_options
def train(traces: tuple[Path, ...], out: Path, seed: int, as_json: bool, failures: Path | None,
          history: dict) -> None:
    """Train a model on labelled traces (and/or a labelled Prometheus window) and pick its two thresholds."""
    for t in traces:
        if not (t / "failures.parquet").exists():
            raise click.ClickException(f"{t}: no failures.parquet, cannot train on an unlabelled trace")
    if history["prom_url"] and failures is None:
        raise click.UsageError("training on --prometheus needs its labels: --failures failures.parquet")
    if not traces and not history["prom_url"]:
        raise click.UsageError("give --trace (repeatable) and/or --prometheus")
    from predictor.model import training
    with contextlib.ExitStack() as stack:
        extra = [stack.enter_context(history_trace(None, history, failures))] if history["prom_url"] else []
        try:
            m = training.train(list(traces) + extra, seed=seed)
        except ValueError as e:
            raise click.ClickException(str(e)) from e
    m.save(out)
    summary = {"model": str(out), "sensitive": m.sensitive, "strict": m.strict, **m.info}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    ci = m.info["validation_ci95"]
    pages = "only the rules page operators" if m.strict >= 1.0 else "the model pages operators above it"
    click.echo(f"wrote {out}: sensitive {m.sensitive:.4g}, strict {m.strict:.4g} ({pages}); on "
               f"{m.info['validation_node_days']} validation node-days: recall of predictable "
               f"{m.info['validation_recall_of_predictable']} (95 %: {ci['recall_of_predictable'][0]}-"
               f"{ci['recall_of_predictable'][1]}), false alarms per 1000 node-days "
               f"{m.info['validation_false_alarms_per_1000_node_days']} (95 %: "
               f"{ci['false_alarms_per_1000_node_days'][0]}-{ci['false_alarms_per_1000_node_days'][1]})")


@main.command()
@_model_opt
@click.option("--trace", "traces", multiple=True, type=_trace_dir,
              help="labelled trace the model was not trained on (repeatable)")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="model file to write")
@click.option("--json", "as_json", is_flag=True)
@_failures_opt
@click.option("--derive-labels", is_flag=True,
              help="label the --prometheus window (or a --trace without failures.parquet) from its own telemetry, "
                   "as `predictor label` does")
@prometheus_options
def calibrate(model_path: str | None, traces: tuple[Path, ...], out: Path, as_json: bool, failures: Path | None,
              derive_labels: bool, history: dict) -> None:
    """Fit the node-probability map behind job-level risk on held-out labelled traces (and/or a
    Prometheus window); write the model with it (`train` does this on its validation nodes)."""
    if not traces and not history["prom_url"]:
        raise click.UsageError("give --trace (repeatable) and/or --prometheus")
    if failures is not None and not history["prom_url"]:
        raise click.UsageError("--failures goes with --prometheus (a trace directory has its own)")
    if history["prom_url"] and (failures is None) == (not derive_labels):
        raise click.UsageError("calibrating on --prometheus history needs its labels: --failures failures.parquet, "
                               "or --derive-labels to derive them from the window (as `predictor label` does)")
    for t in traces:
        if not (t / "failures.parquet").exists() and not derive_labels:
            raise click.ClickException(f"{t}: no failures.parquet, cannot calibrate on an unlabelled trace "
                                       "(--derive-labels labels it from its telemetry)")
    sources = [str(t) for t in traces] + ([f"{history['prom_url']} {history['prom_start']}..{history['prom_end']}"]
                                          if history["prom_url"] else [])
    with contextlib.ExitStack() as stack:
        labelled = []
        for t in traces:
            if not (t / "failures.parquet").exists():
                labelled.append(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="labelled-"))))
                write_labelled(t, labelled[-1])
            else:
                labelled.append(t)
        if history["prom_url"]:
            window = stack.enter_context(history_trace(None, history, failures))
            if derive_labels:
                derived, _ = write_labelled(window, window)
                click.echo(f"{derived.num_rows} failures derived from the window's telemetry", err=True)
            labelled.append(window)
        summary = _calibrate(model_path, labelled, sources, out)
    click.echo(json.dumps(summary, indent=1) if as_json else
               f"wrote {out}: {summary['breakpoints']} breakpoints, base rate {summary['base_rate_per_node_day']} "
               f"failures per node-day, in-sample Brier {summary['in_sample']['brier']} "
               f"(base rate alone {summary['in_sample']['brier_of_base_rate']})")


def _calibrate(model_path: str | None, traces: list[Path], sources: list[str], out: Path) -> dict:
    """Fit the node calibration on labelled `traces` (recorded as `sources`), write the model with it to `out`."""
    import numpy as np

    from predictor.model import job_risk
    m = _load_model(model_path)
    instants = [job_risk.node_instants(t, m) for t in traces]
    try:
        cal = job_risk.fit(instants)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    m.info[job_risk.INFO_KEY] = {**cal.to_info(), "traces": sources}
    m.save(out)
    fit_quality = job_risk.reliability(cal.probability(np.concatenate([i.score for i in instants])),
                                       np.concatenate([i.failed for i in instants]))
    return {"model": str(out), "base_rate_per_node_day": round(cal.base_rate_per_s * 86400, 5),
            "base_probability": round(cal.base_probability, 6), "breakpoints": len(cal.score),
            "in_sample": fit_quality}


def _alarms(model, trace: Path, threshold: str):
    from predictor.model.replay import score_trace
    from predictor.model.scoring import Scorer
    thr = _threshold(model, threshold)
    return score_trace(trace, Scorer(model, reasons_from=thr), threshold=thr)


@main.command()
@_model_opt
@click.option("--trace", type=_trace_dir)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="alarms.parquet to write")
@_threshold_opt
@click.option("--json", "as_json", is_flag=True)
@prometheus_options
def score(model_path: str | None, trace: Path | None, out: Path, threshold: str, as_json: bool,
          history: dict) -> None:
    """Replay a trace (or Prometheus history) through the online scorer; write its alarms
    (timestamp, node, gpu, score, reason)."""
    import pyarrow.parquet as pq
    model = _load_model(model_path)
    with history_trace(trace, history) as source:
        alarms = _alarms(model, source, threshold)
    pq.write_table(alarms, out)
    summary = {"alarms": alarms.num_rows, "out": str(out)}
    click.echo(json.dumps(summary) if as_json else f"{alarms.num_rows} alarms -> {out}")


@main.command("eval")
@_model_opt
@click.option("--trace", type=_trace_dir)
@_threshold_opt
@click.option("--alarms-out", type=click.Path(dir_okay=False, path_type=Path), help="also write the alarms")
@click.option("--json", "as_json", is_flag=True)
@_failures_opt
@prometheus_options
def eval_(model_path: str | None, trace: Path | None, threshold: str, alarms_out: Path | None, as_json: bool,
          failures: Path | None, history: dict) -> None:
    """Score a labelled trace (or Prometheus window with --failures) and print the EVAL.md metrics."""
    if trace is not None and not (trace / "failures.parquet").exists():
        raise click.ClickException(f"{trace}: no failures.parquet, nothing to evaluate against")
    if history["prom_url"] and failures is None:
        raise click.UsageError("evaluating --prometheus history needs its labels: --failures failures.parquet")
    import pyarrow.parquet as pq

    from predictor.model import evaluation
    m = _load_model(model_path)
    with history_trace(trace, history, failures) as source:
        alarms = _alarms(m, source, threshold)
        truth = evaluation.load_truth(source)
    if alarms_out:
        pq.write_table(alarms, alarms_out)
    res = evaluation.report(alarms, truth)
    if as_json:
        click.echo(json.dumps(res, indent=1, allow_nan=False))
        return
    for lvl, r in res.items():
        def v(metric: str, r: dict = r) -> str:
            why = r.get("why_missing", {})
            if metric in why:
                return f"n/a ({why[metric]})"
            lo_hi = r["ci95"].get(metric)
            return f"{r[metric]} (95 %: {lo_hi[0]}-{lo_hi[1]})" if lo_hi else str(r[metric])
        click.echo(f"[{lvl}] recall {v('recall')} ({r['caught']}/{r['failures']}), of predictable "
                   f"{v('recall_of_predictable')}, false alarms per 1000 node-days "
                   f"{v('false_alarms_per_1000_node_days')}, lead median {v('lead_s_median')} s, "
                   f"precision at real failure rate "
                   f"{v('precision_at_real_failure_rate')}, by mode {r['recall_by_mode']}")


@main.command()
@_model_opt
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9410, show_default=True)
@click.option("--tokens", "tokens_path", type=click.Path(exists=True, dir_okay=False),
              help=f"token file: one 'ROLE TOKEN' per line, ROLE {'|'.join(ROLES)} (default: ${ENV_FILE}, "
                   f"or {', '.join('$' + v for v in ENV_TOKENS.values())})")
@click.option("--no-auth", is_flag=True, help="accept requests without a token (loopback testing only)")
@click.option("--alertmanager", "alertmanager_url", help="Alertmanager base URL, e.g. http://127.0.0.1:9093")
@click.option("--webhook", "webhook_url", help="generic webhook URL for strict-threshold alerts")
@click.option("--max-body", default=16 * 2**20, show_default=True, help="batch size cap in bytes, decompressed")
@click.option("--max-ahead", "max_ahead_s", type=click.FloatRange(min=0),
              default=300.0, show_default=True,  # wire.MAX_AHEAD_S
              help="refuse samples stamped more than this many seconds ahead of this machine's clock "
                   "(a simulated clock that runs faster, as in the demo, needs more)")
@click.option("--max-nodes", type=click.IntRange(min=1), default=100_000, show_default=True,  # server.MAX_NODES
              help="distinct node names to keep state for (a few KB each); batches with more new ones get 429")
@click.option("--max-jobs-per-token", type=click.IntRange(min=1), default=16, show_default=True,  # jobs.JobLimits
              help="jobs registered at once with one token; past it POST /v1/jobs gets 429")
@click.option("--max-nodes-per-job", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="nodes one job may name (413 past it)")
@click.option("--max-job-nodes", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="node entries over all registered jobs (429 past it)")
def serve(model_path: str | None, host: str, port: int, tokens_path: str | None, no_auth: bool,
          alertmanager_url: str | None, webhook_url: str | None, max_body: int, max_ahead_s: float,
          max_nodes: int, max_jobs_per_token: int, max_nodes_per_job: int, max_job_nodes: int) -> None:
    """Run the HTTP service: ingest, risk, jobs + checkpoint stream, /metrics, alerts."""
    if no_auth and not _is_loopback(host):
        raise click.UsageError(f"--no-auth serves anyone who can reach {host}: use it with a loopback --host only")
    from predictor.ingest import auth
    try:  # before the server's imports (seconds: the model's libraries), so a missing token is said at once
        tokens = None if no_auth else auth.load_tokens(tokens_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    from predictor.serve import server
    from predictor.serve.jobs import JobLimits
    try:
        server.run(_load_model(model_path), host=host, port=port, tokens=tokens, max_body=max_body,
                   alertmanager_url=alertmanager_url, webhook_url=webhook_url, max_ahead_s=max_ahead_s,
                   max_nodes=max_nodes, job_limits=JobLimits(max_jobs_per_token, max_nodes_per_job, max_job_nodes))
    except server.CannotListen as e:
        raise click.ClickException(str(e)) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


main.add_command(label)
main.add_command(act)
main.add_command(hazard)
main.add_command(nodes)
