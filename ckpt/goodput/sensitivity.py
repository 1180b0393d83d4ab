"""How the best strategy's waste over (a)'s moves with the restart phases nobody has
measured at scale: the share of GPU failures that hang, the wait for a spare node and
the relaunch (``ckpt simulate --sensitivity``). The verdict on a target that holds only
for some of them should show where it holds, not pick one."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .model import Outcome, Run, Strategy, analytic
from .restart import RestartCosts

RELAUNCH_S = (10.0, 30.0, 60.0, 120.0, 300.0)  # our small job's measured ~10 s up to issue 7's 5 min
AXES = {"gpu_hang_share": (0.0, 0.32, 0.64, 1.0), "replace_s": (0.0, 60.0, 120.0, 300.0, 600.0)}


def best_over_a(outcomes: list[Outcome]) -> tuple[Outcome, float]:
    """Of the strategies' outcomes, (a)'s first: the least waste after (a)'s, and its waste
    over (a)'s (issue 17's ratio)."""
    best = min(outcomes[1:], key=lambda o: o.waste)
    return best, best.waste / outcomes[0].waste


def grids(run: Run, build: Callable[[RestartCosts], list[Strategy]], costs: RestartCosts) -> dict:
    """Per axis of ``AXES``, best/(a) for each of its values (rows) x each relaunch
    (columns), the other phases as ``costs`` has them (a flat what-if is dropped)."""
    out: dict = {"relaunch_s": list(RELAUNCH_S)}
    for axis, values in AXES.items():
        out[axis] = {"values": list(values), "best_over_a": [
            [best_over_a([analytic(run, s) for s in build(replace(costs, flat_s=None, relaunch_s=r, **{axis: v}))])[1]
             for r in RELAUNCH_S]
            for v in values]}
    return out


def grid_tables(sweep: dict, target: float) -> str:
    """The grids as Markdown, ratios at or under ``target`` in bold."""
    tables = []
    for axis in AXES:
        rows = [f"| {axis} \\ relaunch_s | " + " | ".join(f"{r:g}" for r in sweep["relaunch_s"]) + " |",
                "|---|" + "---:|" * len(sweep["relaunch_s"])]
        for value, ratios in zip(sweep[axis]["values"], sweep[axis]["best_over_a"]):
            shown = [f"{x:.3f}" if round(x, 2) == target else f"{x:.2f}" for x in ratios]  # no 0.40 both ways
            cells = [f"**{text}**" if x <= target else text for x, text in zip(ratios, shown)]
            rows.append(f"| {value:g} | " + " | ".join(cells) + " |")
        tables.append("\n".join(rows))
    return "\n\n".join(tables)
