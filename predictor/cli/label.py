"""`predictor label`: failures.parquet derived from a trace's or a Prometheus window's telemetry.

`write_labelled()` is shared with `predictor calibrate --derive-labels`: a labelled trace
directory is the source's files (linked, or the Prometheus window written there) plus the
derived failures.parquet, which train, eval and calibrate read like any labelled trace.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from predictor.cli.history import history_trace, prometheus_options

_LINKED = ("telemetry.parquet", "xid.parquet", "trace.json")


def write_labelled(source: Path, out: Path, merge_csv: Path | None = None) -> tuple:
    """Derive labels from `source`'s telemetry and write them to `out`/failures.parquet, with
    links to `source`'s files unless `out` is `source`; (labels, the merge's counts or None).
    No failures.parquet is written when the labels cannot be derived (a bad operator CSV)."""
    import pyarrow.parquet as pq

    from predictor.model import labels
    try:
        samples, xids = labels.load_trace(source)
        derived = labels.derive(samples, xids)
        merged = None
        if merge_csv:
            derived, merged = labels.merge(derived, labels.read_operator_csv(merge_csv))
    except (labels.LabelError, OSError) as e:
        raise click.ClickException(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != source.resolve():
        for name in _LINKED:
            if (source / name).exists() and not (out / name).exists():
                (out / name).symlink_to((source / name).resolve())
    pq.write_table(derived, out / "failures.parquet")
    return derived, merged


@click.command()
@click.option("--trace", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="trace directory to label (telemetry, xid)")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory to write: failures.parquet plus the trace's files (links to --trace's, or the "
                   "--prometheus window read into it), a labelled trace that train, eval and calibrate read")
@click.option("--merge", "merge_csv", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="operator's failure record to merge: CSV with header node,gpu,time,cause[,xid] "
                   "(cause maintenance or none removes the derived label it matches)")
@click.option("--against", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a true failures.parquet (a simulator's) to measure the labels against")
@click.option("--json", "as_json", is_flag=True)
@prometheus_options
def label(trace: Path | None, out: Path, merge_csv: Path | None, against: Path | None, as_json: bool,
          history: dict) -> None:
    """Derive failure labels from the telemetry: critical XIDs, vanished and replaced GPUs."""
    import pyarrow.parquet as pq

    from predictor.model import labels
    if (out / "failures.parquet").exists():
        raise click.ClickException(f"{out / 'failures.parquet'} exists: pick another --out")
    if history["prom_url"] and history["save_trace"] is None:
        history = {**history, "save_trace": out}     # the window is the labelled trace's telemetry
    with history_trace(trace, history) as source:
        derived, merged = write_labelled(source, out, merge_csv)
    res = {"out": str(out), **labels.summary(derived)}
    if merged is not None:
        res["merged"] = merged
    if against:
        res["against"] = labels.agreement(derived, pq.read_table(against))
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    click.echo(f"{res['failures']} failures -> {out / 'failures.parquet'} by source {res['by_source']}"
               + (f", operator record: {merged}" if merged is not None else ""))
    if against:
        a = res["against"]
        click.echo(f"against {against}: precision {a['precision']}, recall {a['recall']} ({a['matched']} of "
                   f"{a['true_failures']}), time offset median {a['offset_s_median']} s, by mode {a['recall_by_mode']}")
