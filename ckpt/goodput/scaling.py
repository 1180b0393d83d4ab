"""Our control plane's cost against the number of ranks, measured (``benchmarks/scale_bench.py``,
kept in ``data/control_plane_scaling.json``) and extrapolated to a run's size by the power law
fitted from 1,024 ranks up: the in-process policy's phases we can measure here, so that
``ckpt simulate`` borrows a published figure only where we cannot (docs/goodput.md)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib.resources import files

SCALING = json.loads(files(__package__).joinpath("data", "control_plane_scaling.json").read_text())
FIT_FROM = 1024  # below it fixed costs dominate; the targets are stated from here up (docs/scale.md)


@dataclass(frozen=True)
class Fitted:
    """``component``'s seconds at ``ranks``: measured there, or extrapolated from the largest N
    measured along the fitted exponent."""

    component: str
    ranks: int
    seconds: float
    exponent: float
    measured_to: int

    def source(self) -> str:
        how = "measured" if self.ranks <= self.measured_to else \
            f"extrapolated from {self.measured_to:,} ranks, exponent {self.exponent:.2f}"
        return (f"measured: scale_bench {self.component} at {self.ranks:,} ranks ({how}; "
                f"{SCALING['date']}, {SCALING['caveat']})")


def fitted(component: str, ranks: int, rows: list[dict] | None = None) -> Fitted:
    """The power law ``seconds = c * N ** k`` through ``component``'s rows from ``FIT_FROM``
    ranks up (least squares in log-log), evaluated at ``ranks`` (a measured N gives its own
    figure). ValueError when fewer than two rows are that large."""
    points = sorted((r["ranks"], r["seconds"]) for r in (rows if rows is not None else SCALING["rows"])
                    if r["component"] == component and r["ranks"] >= FIT_FROM and r["seconds"] > 0)
    if len(points) < 2:
        raise ValueError(f"{component}: fewer than two measurements from {FIT_FROM} ranks up")
    xs, ys = [math.log(n) for n, _ in points], [math.log(s) for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    measured = dict(points)
    seconds = measured.get(ranks, math.exp(my + k * (math.log(ranks) - mx)))
    return Fitted(component, ranks, seconds, k, points[-1][0])
