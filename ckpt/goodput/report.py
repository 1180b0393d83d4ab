"""What ``ckpt simulate`` prints: the outcomes, the copy each restart reads, and where
the restarts' time goes, as Markdown tables (the README's and docs/goodput.md's)."""
from __future__ import annotations

from .inprocess import InProcessCosts
from .model import KINDS, Outcome, Run, Strategy
from .restart import PHASES

_STEPS = (*PHASES, "restore")


def table(outcomes: list[Outcome]) -> str:
    """ETTR and the waste split, percent of the wall clock."""
    rows = ["| policy | ETTR | waste | stalls | lost work | restarts | interval | blocking per save |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for o in outcomes:
        risk = f" ({o.risk_interval_s:.0f} s at risk)" if o.risk_interval_s < o.interval_s else ""
        rows.append(f"| {o.label} | {o.ettr:.2%} | {o.waste:.2%} | {o.stall:.2%} | {o.lost:.2%} | "
                    f"{o.restart:.2%} | {o.interval_s:.0f} s{risk} | {o.blocking_s:.2f} s |")
    return "\n".join(rows)


def reads_table(run: Run, strategies: list[Strategy]) -> str:
    """Per kind of failure, the copy each strategy's restart reads, how long after a
    save's start it is durable there, and how long reading it takes."""
    shares = run.shares
    rows = ["| policy | " + " | ".join(f"{KINDS[k]}, {shares[k]:.0%}" for k in KINDS) + " |",
            "|---|" + "---|" * len(KINDS)]
    for s in strategies:
        cells = [f"{r.reads}: durable after {r.lag_s:.1f} s, read in {r.restore_s:.1f} s"
                 for r in map(s.recovery, KINDS)]
        rows.append(f"| {s.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def restart_phases(run: Run, s: Strategy) -> dict:
    """Seconds of each phase per kind of failure, and each phase's expected share of the
    wall clock over all failures (λ · Σ share · seconds, first order)."""
    per_kind = {k: {p: getattr(s.recovery(k), f"{p}_s") for p in _STEPS} | {"total": s.recovery(k).restart_s}
                for k in KINDS}
    waste = {p: run.failure_rate * sum(share * per_kind[k][p] for k, share in run.shares.items())
             for p in (*_STEPS, "total")}
    return {"fail_fast": s.fail_fast, "seconds": per_kind, "waste": waste}


def phases_table(run: Run, strategies: list[Strategy]) -> str:
    """Failure to training again, per kind: detect + replace + relaunch + restore, in
    seconds; then each phase's share of the wall clock."""
    rows = ["| policy | " + " | ".join(KINDS[k] for k in KINDS) + " | " + " | ".join(_STEPS) + " |",
            "|---|" + "---|" * len(KINDS) + "---:|" * len(_STEPS)]
    for s in strategies:
        phases = restart_phases(run, s)
        seconds = phases["seconds"]
        cells = [" + ".join(f"{seconds[k][p]:.0f}" for p in _STEPS) + f" = {seconds[k]['total']:.0f} s" for k in KINDS]
        rows.append(f"| {s.label} | " + " | ".join(cells) + " | "
                    + " | ".join(f"{phases['waste'][p]:.2%}" for p in _STEPS) + " |")
    return "\n".join(rows)


def inprocess_table(costs: InProcessCosts, inputs: dict[str, dict[str, str]] | None = None) -> str:
    """One in-process recovery's phases after detection, in seconds (the restore is the
    strategy's, as on the relaunch path); with ``inputs``, a row saying which each phase is:
    measured by our benchmark, borrowed from a published figure, or given."""
    phases = costs.phases()
    rows = ["| " + " | ".join(phases) + " | total |", "|" + "---:|" * (len(phases) + 1),
            "| " + " | ".join(f"{v:.3g}" for v in phases.values()) + f" | {costs.total_s:.3g} |"]
    if inputs:
        rows.append("| " + " | ".join(inputs[f"{p}_s"]["kind"] for p in phases) + " | |")
        rows += ["", *(f"- {name}: {v['source']}" for name, v in inputs.items() if v["kind"] == "measured")]
    return "\n".join(rows)
