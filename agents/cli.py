"""`agents` command line: `agents run` (the node agent) and `agents simulate` (labelled traces)."""
from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime, timezone

import click

from agents.fleetsim.config import PROFILES, FleetConfig, ScheduledFailure
from telemetry.cli_group import role_group


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
        raise click.BadParameter(f"{text!r}: expected e.g. hbm=0.45,nvlink=0.2,pcie=0.2,thermal=0.15",
                                 param_hint="--mode-weights") from None


def _parse_start(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time", param_hint="--start") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def fleet_options(f):
    """Options shared by `simulate` and `run --source sim` (ignored by other sources): one model, one set of knobs."""
    opts = [
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed: same seed, same fleet."),
        click.option("--gpus-per-node", type=click.IntRange(1, 64), default=8, show_default=True),
        click.option("--gpu-model", type=click.Choice(sorted(PROFILES)), default="h100", show_default=True),
        click.option("--temp-offset", type=float, default=0.0, show_default=True,
                     help="Fleet-wide inlet temperature offset in °C (4 = a fleet running 4 °C warmer)."),
        click.option("--failure-rate", type=click.FloatRange(min=0), default=0.05, show_default=True,
                     help="GPU failures per GPU-day (enriched; a real fleet is ~100x lower)."),
        click.option("--sudden-share", type=click.FloatRange(0, 1), default=1 / 3, show_default="1/3",
                     help="Share of failures with no precursor."),
        click.option("--mode-weights", default=None,
                     help="Mix of precursor modes, e.g. hbm=0.45,nvlink=0.2,pcie=0.2,thermal=0.15."),
        click.option("--fail", "fail", multiple=True, metavar="NODE/gpuN/MODE@+OFFSET",
                     help="Schedule a failure, e.g. node0003/gpu2/hbm@+10m (repeatable)."),
        click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                     help="Run the fleet's processes this many times faster than the clock."),
        click.option("--start", default=None,
                     help="Trace start time, ISO 8601, UTC if no zone (a live run starts now)."),
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


@click.group(cls=role_group("agent"), context_settings={"help_option_names": ["-h", "--help"]})
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


TOKEN_ENV = "CKPT_GUARD_AGENT_TOKEN"
#: /metrics port: not dcgm-exporter's 9400 (both run on GPU-Operator nodes), nor node_exporter's
#: 9100 or the predictor's 9410.
DEFAULT_METRICS_PORT = 9412


def _read_token(token_file: str | None) -> str:
    """The agent token, from a file or the environment (never argv: other users can read it there)."""
    if token_file:
        with open(token_file) as fh:
            token = fh.read().strip()
        if not token:
            raise click.UsageError(f"token file {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise click.UsageError(f"--predictor needs a token: --token-file PATH or ${TOKEN_ENV}")
    return token


def _default_spool_dir(node: str) -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "ckpt-guard", f"agent-spool-{node}")


def _make_source(source, interval, node_name, trace, speed, replay_nodes, retime, fleet, model_clock=False,
                 dcgm=None):
    if source == "dcgm-exporter":
        from urllib.parse import urlsplit

        from agents.sources.dcgm_exporter import DcgmExporterSource

        try:
            src = DcgmExporterSource(dcgm["urls"], node_label=dcgm["node_label"], default_node=node_name,
                                     timeout_s=dcgm["timeout"], max_bytes=int(dcgm["max_mb"] * (1 << 20)))
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return src, node_name or urlsplit(src.urls[0]).hostname
    if source == "nvml":
        from agents.sources.nvml import NvmlSource, NvmlUnavailable

        try:
            src = NvmlSource(node_name)
        except NvmlUnavailable as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        return src, src.node
    if source == "sim":
        from agents.sources.sim import SimSource

        name = node_name or default_node_name()
        cfg = fleet_config(nodes=1, days=None, interval=interval, node_names=(name,), **fleet)
        return SimSource(cfg, model_clock=model_clock), name
    if not trace:
        raise click.UsageError("--source replay needs --trace DIR")
    from agents.sources.replay import ReplaySource

    try:
        src = ReplaySource(trace, speed=speed, nodes=list(replay_nodes) or None, retime=retime)
    except (OSError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    return src, node_name or (replay_nodes[0] if len(replay_nodes) == 1 else "replay")


@main.command()
@click.option("--source", type=click.Choice(["nvml", "sim", "replay", "dcgm-exporter"]), default="nvml",
              show_default=True)
@click.option("--predictor", default=None, metavar="URL",
              help="Predictor base URL; without it only /metrics is served.")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help=f"File holding the agent token (or set ${TOKEN_ENV}).")
@click.option("--token", "token_argv", hidden=True,
              help="Refused: a token on the command line is visible to every user.")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds between samples.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=DEFAULT_METRICS_PORT, show_default=True,
              help="Port of /metrics (not dcgm-exporter's 9400); 0 turns it off.")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True,
              help="Address /metrics binds (0.0.0.0 for a remote Prometheus).")
@click.option("--node-name", default=None, help="Node name to report (default: this host's short name).")
@click.option("--spool-dir", type=click.Path(file_okay=False), default=None,
              help="Spool directory (default under $XDG_STATE_HOME).")
@click.option("--spool-max-mb", type=click.FloatRange(min=0, min_open=True), default=256.0, show_default=True)
@click.option("--batch-seconds", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Samples per batch, in seconds.")
@click.option("--trace", type=click.Path(exists=True, file_okay=False), default=None,
              help="Replay: the trace directory.")
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Replay: N x recorded pace.")
@click.option("--replay-node", "replay_nodes", multiple=True, help="Replay: only this node (repeatable).")
@click.option("--retime", is_flag=True, help="Replay: stamp samples with the wall clock instead of the recorded time.")
@click.option("--model-clock", is_flag=True,
              help="Sim: stamp samples with the simulated clock, --time-scale times faster "
              "than the wall clock, so a predictor sees sped-up precursors at their natural pace (demos).")
@click.option("--dcgm-url", "dcgm_urls", multiple=True, metavar="URL",
              help="dcgm-exporter: a page to scrape, e.g. http://gpu-node-1:9400/metrics (repeatable).")
@click.option("--dcgm-node-label", default="Hostname", show_default=True,
              help="dcgm-exporter: the label that names the node (--node-name, else the URL's host, where absent).")
@click.option("--dcgm-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="dcgm-exporter: seconds a scrape may take in all.")
@click.option("--dcgm-max-mb", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True,
              help="dcgm-exporter: largest page accepted, in MiB.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds.")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="At exit, how long to keep sending the spool.")
@click.option("--shm-dir", default="/dev/shm", show_default=True,
              help="Where checkpoint jobs keep shared memory: reported on /metrics, reclaimed when their job is gone.")
@click.option("--reclaim-shm-every", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds between reclaims of the shared memory of jobs gone, once durable (0: report only).")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's counters as JSON at exit.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@fleet_options
def run(source, predictor, token_file, token_argv, interval, metrics_port, metrics_addr, node_name, spool_dir,
        spool_max_mb, batch_seconds, trace, speed, replay_nodes, retime, model_clock, dcgm_urls, dcgm_node_label,
        dcgm_timeout, dcgm_max_mb, duration, drain_seconds, shm_dir, reclaim_shm_every, as_json, log_level,
        **fleet) -> None:
    """Run the node agent: sample GPUs, stream to the predictor, serve /metrics."""
    import logging
    import signal

    from agents.agent import Agent

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":
        logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one line per tick otherwise
    if token_argv is not None:
        raise click.UsageError(f"--token is refused: a token in argv is visible to every user (ps); "
                               f"use --token-file PATH or ${TOKEN_ENV}")
    token = _read_token(token_file) if predictor else None
    if dcgm_urls and source != "dcgm-exporter":
        raise click.UsageError("--dcgm-url is for --source dcgm-exporter")
    dcgm = {"urls": dcgm_urls, "node_label": dcgm_node_label, "timeout": dcgm_timeout, "max_mb": dcgm_max_mb}
    src, node = _make_source(source, interval, node_name, trace, speed, replay_nodes, retime, fleet, model_clock,
                             dcgm)
    from tqdm import tqdm

    # a replay has an end: show how far it got, on a terminal only
    bar = tqdm(total=getattr(src, "total_samples", None), unit="sample", desc="replay", file=sys.stderr,
               disable=True if source != "replay" else None)
    try:
        agent = Agent(src, interval, predictor=predictor, token=token, spool_dir=spool_dir or _default_spool_dir(node),
                      spool_max_bytes=int(spool_max_mb * (1 << 20)), batch_s=batch_seconds,
                      metrics_port=metrics_port or None, metrics_addr=metrics_addr,
                      sinks=(lambda samples, xids: bar.update(len(samples)),), shm_dir=shm_dir,
                      reclaim_shm_s=reclaim_shm_every)
    except (OSError, ValueError) as e:
        src.close()
        raise click.UsageError(str(e)) from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    log = logging.getLogger("agents")
    log.info("agent for node %s: %s source every %gs%s", node, source, interval,
             f" to {predictor}" if predictor else "")
    if agent.metrics_port:
        log.info("serving /metrics on http://%s:%d/metrics", metrics_addr, agent.metrics_port)
    counters = agent.run(duration, drain_seconds)
    bar.close()
    if as_json:
        click.echo(json.dumps(counters, indent=1))


if __name__ == "__main__":
    main()
