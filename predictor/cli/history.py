"""The `--prometheus` options of `predictor score|eval|train`: where the history comes from.

`history_trace()` turns the options into a trace directory: the `--trace` given, or
the Prometheus window read into `--save-trace DIR` (or a temporary directory that
lives as long as the command).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import click

TOKEN_ENV = "CKPT_GUARD_PROMETHEUS_TOKEN"
PASSWORD_ENV = "CKPT_GUARD_PROMETHEUS_PASSWORD"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration_s(text: str, param: str) -> float:
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r}: a duration such as 600, 10m, 2h", param_hint=param)
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _time_ms(text: str, param: str) -> int:
    """RFC 3339 / ISO 8601 (UTC if no zone), epoch seconds, `now`, or `now-2d`."""
    text = text.strip()
    if text.startswith("now"):
        rest = text[3:]
        ago = _duration_s(rest[1:], param) if rest.startswith("-") else 0.0
        if rest and not rest.startswith("-"):
            raise click.BadParameter(f"{text!r}: now or now-DURATION", param_hint=param)
        return int((time.time() - ago) * 1000)
    try:
        return int(float(text) * 1000)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: ISO 8601, epoch seconds, now or now-2d", param_hint=param) from None
    return int((dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp() * 1000)


def _window_failures(src: Path, dst: Path, start_ms: int, end_ms: int) -> None:
    """The failures inside the window (recall counts every failure of the labels it is given)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from predictor.ingest.wire import timestamps_ms
    table = pq.read_table(src)
    if "timestamp" not in table.column_names:
        raise click.ClickException(f"{src}: not a failures.parquet (no timestamp column)")
    t = timestamps_ms(table.column("timestamp"))
    pq.write_table(table.filter(pc.and_(pc.greater_equal(t, start_ms), pc.less_equal(t, end_ms))), dst)


def _secret(path: str | None, env: str) -> str | None:
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(env) or None


_OPTIONS = [
    click.option("--prometheus", "prom_url", metavar="URL",
                 help="read DCGM history from this Prometheus instead of --trace"),
    click.option("--start", "prom_start", metavar="TIME", help="window start: ISO 8601 (UTC if no zone), "
                 "epoch seconds, now-7d"),
    click.option("--end", "prom_end", metavar="TIME", default="now", show_default=True, help="window end"),
    click.option("--match", "prom_match", default="", metavar="SELECTOR",
                 help='label matchers for the DCGM series, e.g. \'job="dcgm",Hostname=~"gpu-a.*"\''),
    click.option("--node-label", default="Hostname", show_default=True, help="the label that names the node"),
    click.option("--chunk", "prom_chunk", default="10m", show_default=True,
                 help="time per query (each query returns that much raw history)"),
    click.option("--max-series", default=50_000, show_default=True, type=click.IntRange(min=1),
                 help="refuse a chunk with more series"),
    click.option("--max-samples", default=5_000_000, show_default=True, type=click.IntRange(min=1),
                 help="refuse a chunk with more samples"),
    click.option("--prometheus-timeout", "prom_timeout", default=60.0, show_default=True,
                 type=click.FloatRange(min=0, min_open=True), help="seconds for each query's whole answer"),
    click.option("--prometheus-token-file", "prom_token_file", type=click.Path(exists=True, dir_okay=False),
                 help=f"bearer token (default: ${TOKEN_ENV})"),
    click.option("--prometheus-user", "prom_user",
                 help=f"basic-auth user; the password from --prometheus-password-file or ${PASSWORD_ENV}"),
    click.option("--prometheus-password-file", "prom_password_file", type=click.Path(exists=True, dir_okay=False)),
    click.option("--save-trace", type=click.Path(file_okay=False, path_type=Path),
                 help="keep the history read from Prometheus as a trace directory here"),
]
_KEYS = ("prom_url", "prom_start", "prom_end", "prom_match", "node_label", "prom_chunk", "max_series",
         "max_samples", "prom_timeout", "prom_token_file", "prom_user", "prom_password_file", "save_trace")


def prometheus_options(fn: Callable) -> Callable:
    """Add the options; the command receives them as one dict, `history`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["history"] = {k: kwargs.pop(k) for k in _KEYS}
        return fn(*args, **kwargs)
    for opt in reversed(_OPTIONS):
        wrapper = opt(wrapper)
    return wrapper


@contextlib.contextmanager
def history_trace(trace: Path | None, history: dict, failures: Path | None = None) -> Iterator[Path]:
    """The trace directory to read: `trace`, or the Prometheus window (with `failures` copied in
    as its labels, for eval and train)."""
    if (trace is None) == (history["prom_url"] is None):
        raise click.UsageError("give either --trace or --prometheus")
    if trace is not None:
        if failures is not None:
            raise click.UsageError("--failures goes with --prometheus (a trace directory has its own)")
        yield trace
        return
    if not history["prom_start"]:
        raise click.UsageError("--prometheus needs --start")
    from predictor.ingest.prometheus_source import HistoryQuery, PrometheusError, PrometheusHistory
    user = history["prom_user"]
    password = _secret(history["prom_password_file"], PASSWORD_ENV)
    if user and password is None:
        raise click.UsageError(f"--prometheus-user needs --prometheus-password-file or ${PASSWORD_ENV}")
    try:
        query = HistoryQuery(
            history["prom_url"], _time_ms(history["prom_start"], "--start"), _time_ms(history["prom_end"], "--end"),
            match=history["prom_match"], node_label=history["node_label"],
            chunk_s=_duration_s(history["prom_chunk"], "--chunk"), max_series=history["max_series"],
            max_samples=history["max_samples"], timeout_s=history["prom_timeout"],
            token=_secret(history["prom_token_file"], TOKEN_ENV), basic_auth=(user, password) if user else None)
    except PrometheusError as e:
        raise click.UsageError(str(e)) from None
    with contextlib.ExitStack() as stack:
        out = history["save_trace"] or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prom-trace-")))
        try:
            summary = PrometheusHistory(query).write_trace(out)
        except PrometheusError as e:
            raise click.ClickException(str(e)) from None
        if failures is not None:
            _window_failures(failures, out / "failures.parquet", query.start_ms, query.end_ms)
        click.echo(f"read {summary['samples']} samples of {summary['nodes']} nodes and {summary['xid_events']} XID "
                   f"events from {query.url} in {summary['chunks']} queries"
                   + (f"; no series for {', '.join(summary['missing_metrics'])}" if summary["missing_metrics"]
                      else ""), err=True)
        yield out
