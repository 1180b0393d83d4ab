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

With `--due-min 25,30,38` it scores the rule at each cut from one replay.

usage: PYTHONPATH=. python benchmarks/ramp_cadence.py --trace DIR [--dating end|mid] [--due-min 30[,38...]] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pyarrow as pa

from predictor import evaluation, rules
from predictor.features import COUNTERS, FleetState
from predictor.ramps import Ramps
from predictor.replay import replay
from predictor.scoring import Scored, Scorer


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


def due_rows(trace: str, dating: str) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Replay with the model off; per row that a critical XID holds or whose earliest due ramp (of
    >= RAMP_MIN_EVENTS events) ends within an hour: (timestamp, node, gpu), minutes left, critical."""
    scorer = Scorer(None)
    if dating == "mid":
        scorer.state = FleetState(ramps=MidpointRamps(len(COUNTERS)))
    cols: dict[str, list] = {"t": [], "slot": [], "left": [], "crit": []}

    def keep(scored: Scored) -> None:
        f = scored.features
        events = np.expm1(f[:, rules._EVENTS])
        left = np.where(events >= rules.RAMP_MIN_EVENTS - 1e-6, np.expm1(f[:, rules._LEFT_HI]), np.inf).min(axis=1)
        hot = scored.critical | (left <= 60)
        for k, v in (("t", scored.t_ms), ("slot", scored.slots), ("left", left), ("crit", scored.critical)):
            cols[k].append(v[hot])

    replay(trace, scorer, keep)
    t, slot, left, crit = (np.concatenate(cols[k]) for k in ("t", "slot", "left", "crit"))
    keys = [scorer.state.slot_key[s] for s in slot.tolist()]
    rows = pa.table({"timestamp": pa.array(t, pa.timestamp("ms", tz="UTC")),
                     "node": pa.array([k[0] for k in keys], pa.string()),
                     "gpu": pa.array([k[1] for k in keys], pa.int16())})
    return rows, left, crit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--dating", choices=("end", "mid"), default="mid")
    ap.add_argument("--due-min", default=str(int(rules.RAMP_DUE_MIN)),
                    help="the rule's cut(s) in minutes, comma-separated (default: the rule's own)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    rows, left, crit = due_rows(a.trace, a.dating)
    truth = evaluation.load_truth(a.trace)
    out: dict = {"trace": a.trace, "dating": a.dating, "cuts": {}}
    for cut in (float(c) for c in a.due_min.split(",")):
        r = evaluation.score(rows.filter(pa.array(crit | (left <= cut))), truth, "node")
        out["cuts"][f"{cut:g}"] = {k: r[k] for k in ("caught", "predictable_failures", "recall_of_predictable",
                                                     "false_alarms", "false_alarms_per_1000_node_days",
                                                     "lead_s_median", "recall_by_mode")}
    out["secs"] = round(time.time() - t0)
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
