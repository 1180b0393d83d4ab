"""`agents` command line: `agents run` (the node agent) and `agents simulate` (labelled traces)."""
from __future__ import annotations

import json
import socket
import sys
from datetime import datetime, timezone

import click

from agents.fleetsim.config import PROFILES, FleetConfig, ScheduledFailure


def _parse_failures(specs: tuple[str, ...]) -> tuple[ScheduledFailure, ...]:
    try:
        return tuple(ScheduledFailure.parse(s) for s in specs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--fail") from None


def _parse_mode_weights(text: str | None) -> dict[str, float] | None:
    if not text:
        return None
    try:
        return {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected e.g. hbm=0.45,nvlink=0.2,pcie=0.2,thermal=0.15", param_hint="--mode-weights") from None


def _parse_start(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time", param_hint="--start") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def fleet_options(f):
    """Options shared by `simulate` and `run --source sim`: one model, one set of knobs."""
    opts = [
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed: same seed, same fleet."),
        click.option("--gpus-per-node", type=click.IntRange(1, 64), default=8, show_default=True),
        click.option("--gpu-model", type=click.Choice(sorted(PROFILES)), default="h100", show_default=True),
        click.option("--temp-offset", type=float, default=0.0, show_default=True,
                     help="Fleet-wide inlet temperature offset in °C (4 = a fleet running 4 °C warmer)."),
        click.option("--failure-rate", type=click.FloatRange(min=0), default=0.05, show_default=True,
                     help="GPU failures per GPU-day (enriched; a real fleet is ~100x lower)."),
        click.option("--sudden-share", type=click.FloatRange(0, 1), default=1 / 3, show_default=True,
                     help="Share of failures with no precursor."),
        click.option("--mode-weights", default=None, help="Mix of precursor modes, e.g. hbm=0.45,nvlink=0.2,pcie=0.2,thermal=0.15."),
        click.option("--fail", "fail", multiple=True, metavar="NODE/gpuN/MODE@+OFFSET",
                     help="Schedule a failure, e.g. node0003/gpu2/hbm@+10m (repeatable)."),
        click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                     help="Run the fleet's processes this many times faster than the clock."),
        click.option("--start", default=None, help="Start time (ISO 8601, UTC if no zone)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def fleet_config(*, nodes: int, days: float | None, interval: float, node_names=None, **kw) -> FleetConfig:
    """Build a FleetConfig from the shared options; model errors become usage errors."""
    extra = {}
    if (w := _parse_mode_weights(kw["mode_weights"])) is not None:
        extra["mode_weights"] = w
    if (s := _parse_start(kw["start"])) is not None:
        extra["start"] = s
    try:
        return FleetConfig(
            nodes=nodes, days=days, interval_s=interval, node_names=node_names, seed=kw["seed"],
            gpus_per_node=kw["gpus_per_node"], gpu_model=kw["gpu_model"], temp_offset_c=kw["temp_offset"],
            failure_rate_per_gpu_day=kw["failure_rate"], sudden_share=kw["sudden_share"],
            scheduled=_parse_failures(kw["fail"]), time_scale=kw["time_scale"], **extra,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group()
def main() -> None:
    """ckpt-guard node agents: GPU telemetry to the predictor and to Prometheus."""


@main.command()
@click.option("--nodes", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--days", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True)
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds between samples (10, 30 and 60 are typical).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Trace directory to write.")
@click.option("--json", "as_json", is_flag=True, help="Print the trace summary as JSON.")
@fleet_options
def simulate(nodes, days, interval, out_dir, as_json, **kw) -> None:
    """Write a labelled fleet trace (telemetry, xid, failures, trace.json) per SCHEMA.md."""
    from tqdm import tqdm

    from agents.fleetsim.trace import node_chunks, write_trace

    cfg = fleet_config(nodes=nodes, days=days, interval=interval, **kw)
    with tqdm(total=node_chunks(cfg), unit="node-chunk", desc="simulate", disable=None, file=sys.stderr) as bar:
        summary = write_trace(cfg, out_dir, progress=bar.update)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        click.echo(f"{out_dir}: {summary['nodes']} nodes x {summary['gpus_per_node']} GPUs, {summary['days']} days "
                   f"@ {summary['interval_s']:g} s: {summary['rows']} samples, {summary['xid_events']} XID events, "
                   f"{summary['failures']} failures {summary['failures_by_mode']}")


def default_node_name() -> str:
    return socket.gethostname().split(".")[0]


if __name__ == "__main__":
    main()
