"""How the best strategy's waste over (a)'s moves with the restart phases nobody has
measured at scale: the share of GPU failures that hang, the wait for a spare node and
the relaunch; and how (f)'s ETTR moves with the share of faults that still relaunch, the
new process group and the snapshot cost (``ckpt simulate --sensitivity``). The verdict on
a target that holds only for some of them should show where it holds, not pick one."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .inprocess import InProcessCosts
from .model import Outcome, Run, Strategy, analytic
from .restart import RestartCosts

RELAUNCH_S = (10.0, 30.0, 60.0, 120.0, 300.0)  # our small job's measured ~10 s up to issue 7's 5 min
AXES = {"gpu_hang_share": (0.0, 0.32, 0.64, 1.0), "replace_s": (0.0, 60.0, 120.0, 300.0, 600.0)}
# issue 17's target compares checkpoint policies; (f) changes how a job recovers and has its own (issue 33)
CHECKPOINT_POLICIES = ("b", "c", "d", "e")
RELAUNCH_SHARE = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # (f): faults that still relaunch
INPROCESS_AXES = {"new_group_s": (5.0, 15.0, 30.0, 60.0, 120.0),
                  "snapshot_block_s": (0.002, 0.02, 0.078, 0.3, 1.39)}  # 1.39: (b)-(e)'s snapshot on the VM


def best_over_a(outcomes: list[Outcome]) -> tuple[Outcome, float]:
    """Of the strategies' outcomes, (a)'s first: the checkpoint policy with the least waste
    and its waste over (a)'s (issue 17's ratio)."""
    best = min((o for o in outcomes if o.strategy in CHECKPOINT_POLICIES), key=lambda o: o.waste)
    return best, best.waste / outcomes[0].waste


def inprocess_ettr(run: Run, build: Callable[..., list[Strategy]], costs: RestartCosts,
                   inprocess: InProcessCosts) -> float:
    """(f)'s ETTR under ``inprocess`` (a flat what-if, which leaves no in-process path, is dropped)."""
    return next(analytic(run, s).ettr for s in build(replace(costs, flat_s=None), inprocess) if s.name == "f")


def inprocess_grids(run: Run, build: Callable[..., list[Strategy]], costs: RestartCosts,
                    inprocess: InProcessCosts) -> dict:
    """Per axis of ``INPROCESS_AXES``, (f)'s ETTR for each of its values (rows) x each share
    of faults that still relaunch (columns), the rest as ``inprocess`` has them."""
    out: dict = {"relaunch_share": list(RELAUNCH_SHARE)}
    for axis, values in INPROCESS_AXES.items():
        out[axis] = {"values": list(values), "ettr": [
            [inprocess_ettr(run, build, costs, replace(inprocess, relaunch_share=r, **{axis: v}))
             for r in RELAUNCH_SHARE] for v in values]}
    return out


def inprocess_tables(sweep: dict, target: float) -> str:
    """(f)'s grids as Markdown, ETTR at or over ``target`` in bold."""
    return "\n\n".join(_markdown(f"{axis} \\ relaunch_share", sweep["relaunch_share"], sweep[axis]["values"],
                                  [[(f"{x:.2%}", x >= target) for x in row] for row in sweep[axis]["ettr"]])
                        for axis in INPROCESS_AXES)


def _markdown(corner: str, columns: list[float], rows: list[float], cells: list[list[tuple[str, bool]]]) -> str:
    """A grid as a Markdown table: (text, bold) per cell."""
    lines = [f"| {corner} | " + " | ".join(f"{c:g}" for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {value:g} | " + " | ".join(f"**{text}**" if bold else text for text, bold in row) + " |"
              for value, row in zip(rows, cells)]
    return "\n".join(lines)


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
    def cell(x: float) -> tuple[str, bool]:
        return (f"{x:.3f}" if round(x, 2) == target else f"{x:.2f}"), x <= target  # no 0.40 both ways

    return "\n\n".join(_markdown(f"{axis} \\ relaunch_s", sweep["relaunch_s"], sweep[axis]["values"],
                                  [[cell(x) for x in row] for row in sweep[axis]["best_over_a"]]) for axis in AXES)
