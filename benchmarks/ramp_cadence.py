#!/usr/bin/env python3
"""Does the ramp rule date a ramp the same at 60 s and 30 s? Rules only, two ways of folding reads.

A counter read at t shows the events since its previous read at t - dt. "read" folds every
read into the ramp, its events dated at t: at a finer cadence events look older by about
(60 s - dt)/2 than at the 60 s the rule's cut and the model were fitted at, so the ramp's end
moved by minutes with the sample interval, and the cut turned that into catches 10-25 min
later (or earlier) on the shifted sample (docs/predictor.md, "Fleet shift on the hidden
generator"). "reference" (what `predictor/ramps.py` does) folds a finer cadence's reads every
60 s, as a 60 s read shows them. This replays a labelled trace through the online feature path
with the model off (critical XIDs and the ramp rule only) and scores the alarms as EVAL.md does.

With `--due-min 25,30,38` it scores the rule at each cut from one replay.

usage: PYTHONPATH=. python benchmarks/ramp_cadence.py --trace DIR [--dating reference|read]
                                                    [--due-min 30[,38...]] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pyarrow as pa

from predictor import evaluation, rules
from predictor.features import COUNTERS, FleetState
from predictor.ramps import RAMP_REFERENCE_INTERVAL_S, Ramps
from predictor.replay import replay
from predictor.scoring import Scored, Scorer

FOLD_EVERY_S = {"reference": RAMP_REFERENCE_INTERVAL_S, "read": 0.0}


def due_rows(trace: str, dating: str) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Replay with the model off; per row that a critical XID holds or whose earliest due ramp (of
    >= RAMP_MIN_EVENTS events) ends within an hour: (timestamp, node, gpu), minutes left, critical."""
    scorer = Scorer(None)
    scorer.state = FleetState(ramps=Ramps(len(COUNTERS), reference_s=FOLD_EVERY_S[dating]))
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
    ap.add_argument("--dating", choices=tuple(FOLD_EVERY_S), default="reference")
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
