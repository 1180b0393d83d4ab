#!/usr/bin/env python3
"""Does the ramp rule date a ramp the same at 60 s and 30 s? Rules only, two ways of folding reads.

A counter read at t shows the events since its previous read at t - dt. "read" folds every
read into the ramp, its events dated at t: at a finer cadence events look older by about
(60 s - dt)/2 than at the 60 s the rule's cut and the model were fitted at, so the ramp's end
moved by minutes with the sample interval, and the cut turned that into catches 10-25 min
later (or earlier) on the shifted sample (docs/research/predictor-experiments.md, "Fleet
shift on the hidden generator"). "reference" (what `predictor/model/ramps.py` does) folds a finer cadence's reads every
60 s, as a 60 s read shows them. Both cap a read's burst at 0.1 events per second of its
interval (the code before the fold capped 6 a read at any cadence). This replays a labelled
trace through the online feature path with the model off (critical XIDs and the ramp rule
only) and scores the alarms as EVAL.md does.

With `--due-min 25,30,38 --sigma 1,2 --min-events 10,12 --bound-span 0,150 --hold 0,120` it scores
the rule for each combination (the cut, the events' mean age bound in standard errors, the least
events, how long a ramp's events must span before it is bounded, how long a GPU's ramp must stay
due before it alarms) from one replay.

usage: PYTHONPATH=. python benchmarks/ramp_cadence.py --trace DIR [--dating reference|read]
           [--due-min 30[,38...]] [--sigma 1[,1.5...]] [--min-events 10[,12...]]
           [--bound-span 150[,0...]] [--hold 0[,60...]] [--json]
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402
from predictor.model import evaluation, rules  # noqa: E402
from predictor.model.features import COUNTERS, FleetState  # noqa: E402
from predictor.model.ramps import RAMP_BOUND_SPAN_S, RAMP_NONE_MIN, RAMP_REFERENCE_INTERVAL_S, Ramps  # noqa: E402
from predictor.model.replay import replay  # noqa: E402
from predictor.model.scoring import Scored, Scorer  # noqa: E402

FOLD_EVERY_S = {"reference": RAMP_REFERENCE_INTERVAL_S, "read": 0.0}


class BoundRecorder(Ramps):
    """Ramps that also keep, per scored row and counter, the minutes left at each of `sigmas` (every
    ramp bounded, whatever its span), the seconds its events span and the events (features() runs
    once per counter for each chunk of samples, counters in order); the features themselves are
    the default ones."""

    def __init__(self, counters: int, reference_s: float, sigmas: tuple[float, ...]):
        super().__init__(counters, reference_s)
        self.sigmas = sigmas
        self.calls: list[np.ndarray] = []

    def features(self, s: np.ndarray, t: np.ndarray, k: int) -> np.ndarray:
        left, n = self.left(s, t, k, self.sigmas, bound_span_s=0.0)
        _, _, span = self.window(s, t, k)
        self.calls.append(np.column_stack([left, span, n]))
        return super().features(s, t, k)


def due_rows(trace: str, dating: str, sigmas: tuple[float, ...]) -> tuple[pa.Table, np.ndarray, np.ndarray,
                                                                           np.ndarray, np.ndarray]:
    """Replay with the model off; the rows that a critical XID holds or where some ramp ends within
    an hour at some bound: (timestamp, node, gpu), minutes left [rows, counters, sigmas], seconds
    spanned and events [rows, counters], critical."""
    scorer = Scorer(None)
    ramps = BoundRecorder(len(COUNTERS), FOLD_EVERY_S[dating], sigmas)
    scorer.state = FleetState(ramps=ramps)
    nk, ns = len(COUNTERS), len(sigmas)
    cols: dict[str, list] = {"t": [], "slot": [], "left": [], "span": [], "events": [], "crit": []}

    def keep(scored: Scored) -> None:
        calls, ramps.calls = ramps.calls, []
        rows = len(scored.slots)
        stats = np.full((rows, nk, ns + 2), 0.0)
        stats[:, :, :ns] = RAMP_NONE_MIN                   # XID-only rows after the samples: no ramp
        if calls:
            per_chunk = [np.stack(calls[i:i + nk], 1) for i in range(0, len(calls), nk)]
            done = np.concatenate(per_chunk)
            stats[: len(done)] = done
        hot = scored.critical | (stats[:, :, :ns].min(axis=(1, 2)) <= 60)
        for k, v in (("t", scored.t_ms), ("slot", scored.slots), ("left", stats[:, :, :ns]),
                     ("span", stats[:, :, ns]), ("events", stats[:, :, ns + 1]), ("crit", scored.critical)):
            cols[k].append(v[hot])

    replay(trace, scorer, keep)
    t, slot, left, span, events, crit = (np.concatenate(cols[k]) for k in ("t", "slot", "left", "span", "events",
                                                                            "crit"))
    keys = [scorer.state.slot_key[s] for s in slot.tolist()]
    rows = pa.table({"timestamp": pa.array(t, pa.timestamp("ms", tz="UTC")),
                     "node": pa.array([k[0] for k in keys], pa.string()),
                     "gpu": pa.array([k[1] for k in keys], pa.int16())})
    return rows, left, span, events, crit


def held_s(rows: pa.Table, due: np.ndarray, gap_s: float = 100.0) -> np.ndarray:
    """Per row, the seconds its GPU has been due without a break (a row not due, or more than
    `gap_s` between two due rows, breaks it): rows not due are never recorded as hot unless
    some ramp is near, so a gap means the GPU was not due in between."""
    t = rows.column("timestamp").cast(pa.int64()).to_numpy()
    gpu = np.asarray(rows.column("gpu").to_numpy(), np.int64)
    _, node = np.unique(np.asarray(rows.column("node").to_pylist(), dtype=object).astype(str), return_inverse=True)
    order = np.lexsort((t, gpu, node))
    held = np.zeros(len(t))
    start = prev = -1
    for i, j in zip(order, np.r_[-1, order[:-1]]):
        same = j >= 0 and node[i] == node[j] and gpu[i] == gpu[j] and due[j] and t[i] - prev <= gap_s * 1000
        start = (start if same else t[i]) if due[i] else -1
        held[i] = (t[i] - start) / 1000 if due[i] else 0.0
        prev = t[i]
    return held


def _floats(text: str) -> list[float]:
    return [float(c) for c in text.split(",")]


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--dating", choices=tuple(FOLD_EVERY_S), default="reference")
    ap.add_argument("--due-min", default=f"{rules.RAMP_DUE_MIN:g}",
                    help="the rule's cut(s) in minutes, comma-separated (default: the rule's own)")
    ap.add_argument("--sigma", default="1", help="upper bound(s) of the events' mean age, in standard errors "
                                                   "(the rule: 1)")
    ap.add_argument("--min-events", default=f"{rules.RAMP_MIN_EVENTS:g}", help="the rule's minimum event count(s)")
    ap.add_argument("--bound-span", default=f"{RAMP_BOUND_SPAN_S:g}",
                    help="seconds a ramp's events must span before its bound counts (the rule: "
                         f"{RAMP_BOUND_SPAN_S:g})")
    ap.add_argument("--hold", default="0", help="seconds a GPU's ramp must stay due before it alarms (the rule: 0)")
    a = ap.parse_args()
    meta = run_meta()
    t0 = time.time()
    sigmas = tuple(_floats(a.sigma))
    rows, left, span, events, crit = due_rows(a.trace, a.dating, sigmas)
    truth = evaluation.load_truth(a.trace)
    out: dict = {"trace": a.trace, "dating": a.dating, "rules": []}
    for (i, sigma), cut, least, least_span in itertools.product(enumerate(sigmas), _floats(a.due_min),
                                                                 _floats(a.min_events), _floats(a.bound_span)):
        bounded = (span >= least_span) | (sigma <= 0)
        due = ((left[:, :, i] <= cut) & bounded & (events >= least - 1e-6)).any(axis=1)
        held = held_s(rows, due)
        for hold in _floats(a.hold):
            r = evaluation.score(rows.filter(pa.array(crit | (due & (held >= hold)))), truth, "node")
            out["rules"].append({"sigma": sigma, "due_min": cut, "min_events": least, "bound_span_s": least_span,
                                 "hold_s": hold,
                                 **{k: r[k] for k in ("caught", "predictable_failures", "recall_of_predictable",
                                                      "false_alarms", "false_alarms_per_1000_node_days",
                                                      "lead_s_median", "recall_by_mode")}})
    out["secs"] = round(time.time() - t0)
    if a.json:
        write_json(a.json, meta, **out)
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
