"""``ckpt simulate``: ETTR and the waste split of six recovery policies over a run.

Runs with no inputs on the packaged measurements (``data/``, read by ``inputs.py``);
exit 0 ok, 1 for an unreadable input file, 2 usage. ``ckpt/simulate_cli.py`` loads this
module only when the command runs.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, fields

import click
from click.core import ParameterSource

from . import inputs
from .inprocess import InProcessCosts
from .model import Run, analytic, monte_carlo
from .report import inprocess_table, phases_table, reads_table, restart_phases, table
from .restart import RestartCosts
from .scaling import fitted
from .sensitivity import best_over_a, grid_tables, grids, inprocess_grids, inprocess_tables
from .trace_command import TRACE_KEYS, run_trace, trace_options

TARGET = 0.5  # issue 7: (c)'s waste at most half of (a)'s
BEST_TARGET = 0.4  # issue 17: the best checkpoint policy's waste at most 0.4 of (a)'s, at --objstore-gbps 1
INPROCESS_TARGET = 0.98  # issue 33: (f)'s ETTR at least this, at the defaults with --objstore-gbps 1
_defaults = Run()
_file = dict(type=click.Path(exists=True, dir_okay=False), default=None)
_seconds = click.FloatRange(min=0)
# the restart's phases (restart.RestartCosts; sources in docs/research/goodput-model.md)
_RESTART_OPTIONS = [
    ("--gpu-hang-share", click.FloatRange(0, 1), "Share of GPU failures that leave the rank alive and silent "
     "(off the bus, hung kernel, stuck collective) rather than crash it."),
    ("--collective-timeout-s", _seconds, "How long a hung rank holds the job without fail-fast."),
    ("--hang-deadline-s", _seconds, "With fail-fast: the hang detector's deadline (5 x the median step)."),
    ("--xid-share", click.FloatRange(0, 1), "With fail-fast: share of hangs whose fault posts a critical XID."),
    ("--xid-reaction-s", _seconds, "With fail-fast: critical XID -> every rank exits."),
    ("--host-detect-s", _seconds, "A host down: until the job's survivors give up on it."),
    ("--frozen-detect-s", _seconds, "With fail-fast: a rank whose beats stopped (a host down) -> declared frozen."),
    ("--replace-s", _seconds, "A spare node joining, for a node taken out of the job (GPU failure, host down)."),
    ("--relaunch-s", _seconds, "Process exit, relaunch, rendezvous, process-group init, setup."),
]
# (f)'s in-process recovery (inprocess.InProcessCosts; sources in data/inprocess_nvrx.json, or measured by our own
# benchmark at the run's size: inputs.MEASURED_INPROCESS)
_INPROCESS_OPTIONS = [
    ("relaunch_share", click.FloatRange(0, 1), "(f): share of failures the in-process path cannot take "
     "(they relaunch as under (e))."),
    ("abort_s", _seconds, "(f): destroy the process group and wait for concurrent faults."),
    ("drain_s", _seconds, "(f): the pending CUDA kernels finish (about a step)."),
    ("agree_s", _seconds, "(f): rank assignment and the store barrier over the new membership [default: "
     "measured, our membership round at --gpus ranks, benchmarks/scale_bench.py, extrapolated]."),
    ("new_group_s", _seconds, "(f): new NCCL communicators over the new membership."),
    ("first_step_s", _seconds, "(f): what the first step after recovery costs beyond a step."),
    ("step_s", click.FloatRange(min=0, min_open=True), "(f): a training step; snapshots come at most once a step."),
    ("snapshot_block_s", _seconds, "(f): what one snapshot blocks training (provisional default: see "
     "docs/goodput.md)."),
]


def inprocess_inputs(gpus: int, given: dict[str, float | None]) -> dict[str, dict[str, str]]:
    """Where each of (f)'s inputs comes from: ``measured`` by our benchmark, ``borrowed`` from a
    named published figure (or an assumption, so named), or ``given`` on the command line."""
    ctx = click.get_current_context(silent=True)
    out = {}
    for name in given:
        flag = f"inprocess_{name}"
        defaulted = ctx is None or ctx.get_parameter_source(flag) in (ParameterSource.DEFAULT, None)
        if not defaulted:
            out[name] = {"kind": "given", "source": "the command line"}
        elif name in inputs.MEASURED_INPROCESS:
            out[name] = {"kind": "measured", "source": fitted(inputs.MEASURED_INPROCESS[name], gpus).source()}
        else:
            out[name] = {"kind": "borrowed", "source": inputs.INPROCESS["sources"][name]}
    return out


def _restart_options(command: Callable) -> Callable:
    """The ``RestartCosts`` fields as options, defaults shown; ``--restart-s`` is the flat what-if."""
    for flag, kind, text in reversed(_RESTART_OPTIONS):
        name = flag[2:].replace("-", "_")
        command = click.option(flag, name, type=kind, default=getattr(inputs.DEFAULT_RESTART, name), show_default=True,
                               help=text)(command)
    command = click.option("--spare-on-alarm/--no-spare-on-alarm", "spare_on_alarm", show_default=True,
                           default=inputs.DEFAULT_RESTART.spare_on_alarm,
                           help="(c)-(e): a failure the predictor caught had its spare requested at the alarm, "
                           "and waits for it only what is left of --replace-s after the alarm's lead.")(command)
    for name, kind, text in reversed(_INPROCESS_OPTIONS):
        flag = "--inprocess-" + name.replace("_", "-")
        measured = name in inputs.MEASURED_INPROCESS
        command = click.option(flag, f"inprocess_{name}", type=kind, show_default=not measured, help=text,
                               default=None if measured else getattr(inputs.DEFAULT_INPROCESS, name))(command)
    return click.option("--restart-s", "flat_s", type=_seconds, default=None,
                        help="What-if: every restart takes this long before its restore, whatever the failure "
                        "and the policy (the earlier model: 300; (f) then relaunches like the rest).")(command)


@click.command("simulate")
@click.option("--gpus", type=click.IntRange(min=1), default=_defaults.gpus, show_default=True)
@click.option("--days", type=click.FloatRange(min=0, min_open=True), default=_defaults.days, show_default=True)
@click.option("--failures", type=click.IntRange(min=1), default=_defaults.failures, show_default=True,
              help="Unexpected interruptions over the run.")
@click.option("--host-down-share", type=click.FloatRange(0, 1), default=_defaults.host_down_share, show_default=True,
              help="Share of failures that take the host (its memory and disk) down.")
@click.option("--gpu-failure-share", type=click.FloatRange(0, 1), default=_defaults.gpu_failure_share,
              show_default=True, help="Share of failures that take a GPU out: its node is replaced, its host "
              "stays up. The rest, after host down, are process crashes on healthy nodes.")
@click.option("--precursor-share", type=click.FloatRange(0, 1), default=_defaults.precursor_share, show_default=True,
              help="Share of failures with a precursor a predictor could see.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=_defaults.gpus_per_node, show_default=True)
@click.option("--state-gb-per-gpu", type=click.FloatRange(min=0, min_open=True), default=inputs.STATE_GB_PER_GPU,
              show_default=True, help="Checkpoint bytes per GPU, in GB (default: Llama 3 405B with Adam).")
@click.option("--bench", **_file, help="benchmarks/ckpt_bench.py --json output.")
@click.option("--objstore-bench", **_file, help="benchmarks/objstore_bench.py --json output.")
@click.option("--predictor-eval", **_file, help="predictor eval --json output.")
@click.option("--objstore-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="What if the object store served every node at this many GB/s (both ways, all tools).")
@click.option("--peer-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GB/s per GPU to and from its peer (default: a 100 Gb/s NIC per node shared by its GPUs).")
@click.option("--monte-carlo", "plays", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also play the run this many times with sampled failures.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--sensitivity", is_flag=True, help="Also best/(a) over the share of GPU failures that hang, "
              "the wait for a spare and the relaunch; and (f)'s ETTR over the share of failures that still "
              "relaunch, the new process group and the snapshot cost.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_restart_options
@trace_options
def simulate_cmd(gpus: int, days: float, failures: int, host_down_share: float, gpu_failure_share: float,
                 precursor_share: float, gpus_per_node: int, state_gb_per_gpu: float,
                 bench: str | None, objstore_bench: str | None, predictor_eval: str | None,
                 objstore_gbps: float | None, peer_gbps: float | None, plays: int, seed: int, sensitivity: bool,
                 as_json: bool, **restart_phases_s: float | bool | None) -> None:
    """ETTR and waste (stalls, lost work, restarts) of (a) DCP to the object store,
    (b) our tiers, (c) our tiers + the failure predictor, (d) our tiers + peer replicas +
    the predictor, (e) (d) with fail-fast, (f) (e) recovering in-process, each at its
    optimal interval; which copy each restart reads, and what each restart's phases cost.
    With --fault-trace: the same strategies on a job replayed through a real fault history
    (docs/fault-trace.md)."""
    trace_opts = {k: restart_phases_s.pop(k) for k in TRACE_KEYS}
    try:
        run = Run(gpus, days, failures, host_down_share, gpu_failure_share, precursor_share, gpus_per_node)
        restart = RestartCosts(**{f.name: restart_phases_s[f.name] for f in fields(RestartCosts)})
        given = {f.name: restart_phases_s[f"inprocess_{f.name}"] for f in fields(InProcessCosts)}
        inprocess = inputs.inprocess_at(gpus, **{k: v for k, v in given.items() if v is not None})
        inputs_of = inprocess_inputs(gpus, given)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    peer_gbps = peer_gbps or inputs.peer_gbps_default(run)
    try:
        sources = [inputs.load_json(bench, inputs.BENCH), inputs.load_json(objstore_bench, inputs.OBJSTORE),
                   inputs.load_json(predictor_eval, inputs.PREDICTOR)]
        def build(costs: RestartCosts, inproc: InProcessCosts = inprocess) -> list:
            return inputs.strategies(run, *sources, state_gb_per_gpu, objstore_gbps, peer_gbps, costs, inproc)

        strategies = build(restart)
        notes = inputs.eval_notes(sources[2])
    except (OSError, ValueError, KeyError, TypeError) as e:
        click.echo(f"error: unusable input: {e!r}", err=True)
        sys.exit(1)
    if trace_opts["fault_trace"]:
        return run_trace(trace_opts, lambda r: inputs.strategies(
            r, *sources, state_gb_per_gpu, objstore_gbps, peer_gbps, restart, inprocess), run, seed, as_json)
    outcomes = [analytic(run, s) for s in strategies]
    played = [monte_carlo(run, s, plays, seed) for s in strategies] if plays else []
    ratio = outcomes[2].waste / outcomes[0].waste
    best, best_ratio = best_over_a(outcomes)
    phases = {s.name: restart_phases(run, s) for s in strategies}
    split = {o.strategy: {"stalls": o.stall, "lost work": o.lost}
             | {f"restart {p}": w for p, w in phases[o.strategy]["waste"].items() if p != "total"} for o in outcomes}
    dominant = max(split[best.strategy], key=split[best.strategy].get)
    f_ettr = outcomes[-1].ettr
    payload = {"run": asdict(run), "restart": asdict(restart), "inprocess": asdict(inprocess)
               | {"phases": inprocess.phases(), "total_s": inprocess.total_s, "inputs": inputs_of},
               "state_gb_per_gpu": state_gb_per_gpu,
               "objstore_gbps": objstore_gbps, "peer_gbps": peer_gbps,
               "sources": {k: src["source"] for k, src in zip(("bench", "objstore", "predictor"), sources)},
               "strategies": [asdict(s) | {"policy": s.policy(run).explain()} for s in strategies],
               "restart_phases": phases, "waste_split": split,
               "notes": notes, "analytic": [o.to_dict() for o in outcomes],
               "monte_carlo": [o.to_dict() for o in played],
               "sensitivity": grids(run, build, restart) if sensitivity else None,
               "inprocess_sensitivity": inprocess_grids(run, build, restart, inprocess) if sensitivity else None,
               "target": {"c_waste_over_a_waste": ratio, "at_most": TARGET, "met": ratio <= TARGET},
               "best_target": {"best": best.strategy, "best_waste_over_a_waste": best_ratio,
                               "at_most": BEST_TARGET, "met": best_ratio <= BEST_TARGET, "dominant": dominant,
                               "best_restart_over_a_waste": best.restart / outcomes[0].waste},
               "inprocess_target": {"ettr": f_ettr, "at_least": INPROCESS_TARGET, "met": f_ettr >= INPROCESS_TARGET}}
    if as_json:
        click.echo(json.dumps(payload, indent=2))
        return
    restarts = (f"every restart {restart.flat_s:g} s before its restore (flat what-if)" if restart.flat_s is not None
                else f"restart phases per kind (relaunch {restart.relaunch_s:g} s, spare {restart.replace_s:g} s"
                f"{', staged at alarms' if restart.spare_on_alarm else ''}, "
                f"{restart.gpu_hang_share:.0%} of GPU failures hang)")
    lines = [f"{run.gpus} GPUs, {run.days:g} days, {run.failures} failures (MTBF {1 / run.failure_rate / 3600:.2f} h), "
             f"{state_gb_per_gpu:.3f} GB/GPU, peer {peer_gbps:.3g} GB/s per GPU, {restarts}",
             *notes, "", table(outcomes), "", "Which copy the restart reads (lost node's shards):", "",
             reads_table(run, strategies), "",
             "Failure to training again, seconds (detect + replace + relaunch + inprocess + restore), and each phase's "
             "share of the wall clock:", "", phases_table(run, strategies), "",
             f"(f)'s in-process recovery, seconds ({1 - inprocess.relaunch_share:.0%} of failures; the other "
             f"{inprocess.relaunch_share:.0%} relaunch as under (e)):", "", inprocess_table(inprocess, inputs_of)]
    if sensitivity:
        lines += ["", "best / (a) waste; rows: the share of GPU failures that hang, then the wait for a spare (s); "
                  f"columns: the relaunch (s); bold where <= {BEST_TARGET}:", "",
                  grid_tables(payload["sensitivity"], BEST_TARGET), "",
                  "(f)'s ETTR; columns: the share of failures that still relaunch; rows: the new process group (s), "
                  f"then the blocking per snapshot (s); bold where >= {INPROCESS_TARGET:.0%}:", "",
                  inprocess_tables(payload["inprocess_sensitivity"], INPROCESS_TARGET)]
    if played:
        lines += ["", f"Monte Carlo, {plays} runs, seed {seed}:", "", table(played)]
    verdict = "met" if ratio <= TARGET else "NOT met"
    best_verdict = "met" if best_ratio <= BEST_TARGET else "NOT met"
    lines += ["", f"(c) waste / (a) waste = {ratio:.2f} (target <= {TARGET}: {verdict})",
              f"best ({best.strategy}) waste / (a) waste = {best_ratio:.2f} "
              f"(target <= {BEST_TARGET}, set at --objstore-gbps 1: {best_verdict} here); "
              f"its largest term: {dominant}, {split[best.strategy][dominant]:.2%} of the wall clock; its restarts are "
              f"{best.restart / outcomes[0].waste:.2f} x (a)'s waste",
              f"(f) ETTR = {f_ettr:.2%} (target >= {INPROCESS_TARGET:.0%}, set at --objstore-gbps 1: "
              f"{'met' if f_ettr >= INPROCESS_TARGET else 'NOT met'} here)"]
    click.echo("\n".join(lines))
