"""``ckpt simulate``: ETTR and the waste split of four checkpointing strategies over a run.

Runs with no inputs on the packaged measurements (``data/``, read by ``inputs.py``);
exit 0 ok, 1 for an unreadable input file, 2 usage. ``ckpt/simulate_cli.py`` loads this
module only when the command runs.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from . import inputs
from .model import Run, analytic, monte_carlo, reads_table, table

TARGET = 0.5  # issue 7: (c)'s waste at most half of (a)'s
BEST_TARGET = 0.4  # issue 17: the best strategy's waste at most 0.4 of (a)'s, at --objstore-gbps 1
_defaults = Run()
_file = dict(type=click.Path(exists=True, dir_okay=False), default=None)


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
@click.option("--restart-s", type=click.FloatRange(min=0), default=_defaults.restart_s, show_default=True,
              help="Restart overhead per failure (rendezvous, process start, data loader).")
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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def simulate_cmd(gpus: int, days: float, failures: int, host_down_share: float, gpu_failure_share: float,
                 precursor_share: float, restart_s: float, gpus_per_node: int, state_gb_per_gpu: float,
                 bench: str | None, objstore_bench: str | None, predictor_eval: str | None,
                 objstore_gbps: float | None, peer_gbps: float | None, plays: int, seed: int, as_json: bool) -> None:
    """ETTR and waste (stalls, lost work, restarts) of (a) DCP to the object store,
    (b) our tiers, (c) our tiers + the failure predictor, (d) our tiers + peer replicas +
    the predictor, each at its optimal interval; and which copy each restart reads."""
    try:
        run = Run(gpus, days, failures, host_down_share, gpu_failure_share, precursor_share, restart_s, gpus_per_node)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    peer_gbps = peer_gbps or inputs.peer_gbps_default(run)
    try:
        sources = [inputs.load_json(bench, inputs.BENCH), inputs.load_json(objstore_bench, inputs.OBJSTORE),
                   inputs.load_json(predictor_eval, inputs.PREDICTOR)]
        strategies = inputs.strategies(run, *sources, state_gb_per_gpu, objstore_gbps, peer_gbps)
        notes = inputs.eval_notes(sources[2])
    except (OSError, ValueError, KeyError, TypeError) as e:
        click.echo(f"error: unusable input: {e!r}", err=True)
        sys.exit(1)
    outcomes = [analytic(run, s) for s in strategies]
    played = [monte_carlo(run, s, plays, seed) for s in strategies] if plays else []
    ratio = outcomes[2].waste / outcomes[0].waste
    best = min(outcomes[1:], key=lambda o: o.waste)
    best_ratio = best.waste / outcomes[0].waste
    restart_floor = run.failure_rate * run.restart_s / outcomes[0].waste  # what no policy can remove
    payload = {"run": asdict(run), "state_gb_per_gpu": state_gb_per_gpu, "objstore_gbps": objstore_gbps,
               "peer_gbps": peer_gbps,
               "sources": {k: src["source"] for k, src in zip(("bench", "objstore", "predictor"), sources)},
               "strategies": [asdict(s) | {"policy": s.policy(run).explain()} for s in strategies],
               "notes": notes, "analytic": [o.to_dict() for o in outcomes],
               "monte_carlo": [o.to_dict() for o in played],
               "target": {"c_waste_over_a_waste": ratio, "at_most": TARGET, "met": ratio <= TARGET},
               "best_target": {"best": best.strategy, "best_waste_over_a_waste": best_ratio,
                               "at_most": BEST_TARGET, "met": best_ratio <= BEST_TARGET,
                               "restart_overhead_over_a_waste": restart_floor}}
    if as_json:
        click.echo(json.dumps(payload, indent=2))
        return
    lines = [f"{run.gpus} GPUs, {run.days:g} days, {run.failures} failures (MTBF {1 / run.failure_rate / 3600:.2f} h), "
             f"{state_gb_per_gpu:.3f} GB/GPU, restart {run.restart_s:g} s, peer {peer_gbps:.3g} GB/s per GPU",
             *notes, "", table(outcomes), "", "Which copy the restart reads (lost node's shards):", "",
             reads_table(run, strategies)]
    if played:
        lines += ["", f"Monte Carlo, {plays} runs, seed {seed}:", "", table(played)]
    verdict = "met" if ratio <= TARGET else "NOT met"
    best_verdict = "met" if best_ratio <= BEST_TARGET else "NOT met"
    lines += ["", f"(c) waste / (a) waste = {ratio:.2f} (target <= {TARGET}: {verdict})",
              f"best ({best.strategy}) waste / (a) waste = {best_ratio:.2f} "
              f"(target <= {BEST_TARGET} at --objstore-gbps 1: {best_verdict}); the restart overhead alone, "
              f"{run.failure_rate * run.restart_s:.2%} of the wall clock under every policy, is {restart_floor:.2f} "
              "x (a)'s waste"]
    click.echo("\n".join(lines))
