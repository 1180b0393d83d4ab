#!/usr/bin/env python3
"""Does the ramp rule date a ramp the same at 60 s and 30 s? Rules only, two ways of dating events.

A counter read at t shows the events since its previous read at t - dt. `predictor/ramps.py`
dates them at t ("end"): at a coarser cadence events look younger by about dt/2, the ramp
steeper early and flatter late, so its end moves by minutes with the sample interval, and
the rule's 30 min cut turns that into catches 10-25 min later (or earlier) on the shifted
sample (docs/predictor.md, "Fleet shift on the hidden generator"). "mid" dates them at
t - dt/2, the expected time of an event spread uniformly over the interval, which does not
depend on the cadence. This replays a labelled trace through the online feature path with
the model off (critical XIDs and the ramp rule only) and scores the alarms as EVAL.md does.

usage: PYTHONPATH=. python benchmarks/ramp_cadence.py --trace DIR [--dating end|mid] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from predictor import evaluation
from predictor.features import COUNTERS, FleetState
from predictor.ramps import Ramps
from predictor.replay import score_trace
from predictor.scoring import Scorer


class MidpointRamps(Ramps):
    """Ramps whose events are dated half-way through the interval since the counter's last read."""

    def grow(self, cap: int) -> None:
        old = getattr(self, "read_t", np.empty((0, self.counters), np.int64))
        super().grow(cap)
        self.read_t = np.full((cap, self.counters), -1, np.int64)
        self.read_t[: len(old)] = old

    def reset(self, slots: np.ndarray) -> None:
        super().reset(slots)
        self.read_t[slots] = -1

    def event_time(self, s: np.ndarray, t: np.ndarray, ok: np.ndarray) -> np.ndarray:
        prev = self.read_t[s]
        self.read_t[s] = np.where(ok, t[:, None], prev)
        return np.where(prev >= 0, (t[:, None] + prev) // 2, t[:, None])   # expected time of the events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--dating", choices=("end", "mid"), default="mid")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    scorer = Scorer(None)
    if a.dating == "mid":
        scorer.state = FleetState(ramps=MidpointRamps(len(COUNTERS)))
    alarms = score_trace(a.trace, scorer, threshold=1.0)
    r = evaluation.score(alarms, evaluation.load_truth(a.trace), "node")
    out = {"trace": a.trace, "dating": a.dating, "secs": round(time.time() - t0), **r}
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
