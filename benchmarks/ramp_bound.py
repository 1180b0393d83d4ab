#!/usr/bin/env python3
"""How far can any detector of counter ramps go? A full-posterior bound on a labelled trace.

The ramp rule (predictor/model/rules.py) dates a precursor from its events' count and mean age.
This asks whether a better use of the same events exists: it replays the trace through the
online feature path, records every GPU's ramp statistics per counter (events since the
counter woke, time since the first, their summed age: the sufficient statistics of an
exponential rate), and scores each instant with the exact posterior probability that the
GPU fails within the next 58 minutes, under the generator's own model:

    rate(age a) = A * exp(-g * (s + a) / D)   for s + a <= D (s: time left, D: ramp length)
    g = 4.1 (one growth, as the shared sample's fits say); log A and log D normal, with the
    mean and spread of this trace's own failures (in-sample: optimistic for the detector);
    against a steady look-alike with a constant rate.

Alarms are the instants where that probability reaches c (plus critical XIDs), scored as
EVAL.md does, for a sweep of c. No detector that sees only these counters can sit far above
the frontier this traces, so it bounds what sharpening the rule can buy.

usage: PYTHONPATH=. python benchmarks/ramp_bound.py --trace DIR [--priors-from DIR] [--json]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from scipy.optimize import brentq
from scipy.special import digamma, gammaln, polygamma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402
from predictor.model import evaluation  # noqa: E402
from predictor.model.features import COUNTERS, FleetState  # noqa: E402
from predictor.model.ramps import Ramps  # noqa: E402
from predictor.model.replay import replay  # noqa: E402
from predictor.model.scoring import Scorer  # noqa: E402
from predictor.model.training import _Sweep  # noqa: E402

GROWTH = 4.1
HORIZON_MS, MIN_LEAD_MS = int(evaluation.HORIZON_S * 1000), int(evaluation.MIN_LEAD_S * 1000)
SOON_MIN = (evaluation.HORIZON_S - evaluation.MIN_LEAD_S) / 60.0   # the width of the catch window
MODE_OF = {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "hbm", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie",
           "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "nvlink"}
D_GRID = np.exp(np.linspace(np.log(3.0), np.log(600.0), 40))          # ramp length, minutes
S_GRID = np.r_[np.arange(0.0, 60.0, 2.0), np.arange(60.0, 600.0, 10.0)]  # time left, minutes
LOG_PRIOR_STEADY = 5.0              # prior log-odds of a steady look-alike against a precursor
LEVELS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.997, 0.999, 0.9999)


class RampRecorder(Ramps):
    """Ramps that also keep, per scored row, each counter's ramp statistics."""

    def __init__(self, counters: int):
        super().__init__(counters)
        self.calls: list[np.ndarray] = []     # per features() call: [rows, 3] of n, elapsed s, moment

    def features(self, s: np.ndarray, t: np.ndarray, k: int) -> np.ndarray:
        live, n, elapsed = self.window(s, t, k)
        self.calls.append(np.stack([np.where(live, n, 0.0), elapsed, self.moment[s, k]], 1))
        return super().features(s, t, k)


def record(trace: Path) -> dict[str, np.ndarray]:
    """Per scored row: slot, time, critical flag, and n / elapsed (min) / summed age (min) per counter."""
    scorer = Scorer(None)
    recorder = RampRecorder(len(COUNTERS))
    scorer.state = FleetState(ramps=recorder)
    rows: dict[str, list] = {"slot": [], "t": [], "crit": [], "n": [], "el": [], "sa": []}
    nk = len(COUNTERS)

    def on(scored) -> None:
        calls, recorder.calls = recorder.calls, []
        # features() runs once per counter for each chunk of samples, counters in order
        stats = np.concatenate([np.stack(calls[i:i + nk], 1) for i in range(0, len(calls), nk)]) \
            if calls else np.empty((0, nk, 3))
        n, el, mom = stats[:, :, 0], stats[:, :, 1], stats[:, :, 2]
        ns = len(n)
        rows["slot"].append(scored.slots)
        rows["t"].append(scored.t_ms)
        rows["crit"].append(scored.critical)
        pad = np.zeros((len(scored.slots) - ns, nk))          # XID-only rows after the samples
        rows["n"].append(np.r_[n, pad])
        rows["el"].append(np.r_[el, pad] / 60.0)
        rows["sa"].append(np.r_[np.maximum(n * el - mom, 0.0), pad] / 60.0)   # n * mean age
    replay(trace, scorer, on)
    out = {k: np.concatenate(v) for k, v in rows.items()}
    keys = scorer.state.slot_key
    out["node"] = np.array([keys[i][0] for i in range(len(keys))])
    out["gpu"] = np.array([keys[i][1] for i in range(len(keys))])
    return out


def fit_priors(trace: Path) -> dict[str, tuple[float, float, float, float]]:
    """Per mode: mean and sd of log peak rate (events/min) and log ramp length (min) of the
    trace's failures, from the events on the mode's counter over each labelled precursor."""
    f = pq.read_table(trace / "failures.parquet")
    ft = pc.cast(f["timestamp"], pa.int64()).to_numpy()
    fkey = np.char.add(np.array(f["node"].to_pylist(), str), np.char.mod("/%d", f["gpu"].to_numpy()))
    fmode = np.array(f["mode"].to_pylist())
    dur = f["precursor_s"].to_numpy() / 60.0
    tel = pq.read_table(trace / "telemetry.parquet", columns=["timestamp", "node", "gpu", *MODE_OF])
    tt = pc.cast(tel["timestamp"], pa.int64()).to_numpy()
    tkey = np.char.add(pc.cast(tel["node"], pa.string()).to_numpy(zero_copy_only=False).astype(str),
                       np.char.mod("/%d", tel["gpu"].to_numpy()))
    priors = {}
    for col, mode in MODE_OF.items():
        v = tel[col].to_numpy(zero_copy_only=False).astype(float)
        log_a, log_d = [], []
        for i in np.flatnonzero((fmode == mode) & (dur >= 2)):
            m = (tkey == fkey[i]) & (tt >= ft[i] - (dur[i] + 70) * 60e3) & (tt < ft[i])
            o = np.argsort(tt[m])
            got = np.clip(np.nan_to_num(np.diff(v[m][o])), 0, None)[tt[m][o][1:] >= ft[i] - dur[i] * 60e3].sum()
            if got >= 1:
                log_a.append(math.log(got * GROWTH / (dur[i] * -math.expm1(-GROWTH))))
                log_d.append(math.log(dur[i]))
        priors[mode] = (float(np.mean(log_a)), float(np.std(log_a)), float(np.mean(log_d)), float(np.std(log_d)))
    return priors


def _gamma_like(mu: float, sd: float) -> tuple[float, float]:
    """Gamma(shape, rate) with the given mean and sd of its log (so A integrates in closed form)."""
    shape = brentq(lambda a: polygamma(1, a) - sd ** 2, 0.05, 500.0)
    return shape, math.exp(digamma(shape) - mu)


def p_soon(n: np.ndarray, el: np.ndarray, sa: np.ndarray, prior: tuple[float, float, float, float],
           chunk: int = 4000) -> np.ndarray:
    """Posterior probability of a failure within SOON_MIN, per row (n events, el minutes since
    the first, summed age sa minutes; an hour of silence before the first)."""
    mu_a, sd_a, mu_d, sd_d = prior
    shape, rate = _gamma_like(mu_a, sd_a)
    log_wd = np.log(np.gradient(D_GRID)) - (np.log(D_GRID) - mu_d) ** 2 / (2 * sd_d ** 2) - np.log(D_GRID)
    log_ws = np.log(np.gradient(S_GRID))
    D, S = D_GRID[None, :, None], S_GRID[None, None, :]
    out = np.zeros(len(n))
    for i in range(0, len(n), chunk):
        nn, ee, aa = (x[i:i + chunk, None, None] for x in (n, el, sa))
        window = np.minimum(ee + 60.0, np.maximum(D - S, 1e-9))
        expo = (D / GROWTH) * np.exp(-GROWTH * S / D) * -np.expm1(-GROWTH * window / D)
        ll = -(GROWTH / D) * (nn * S + aa) - (nn + shape) * np.log(expo + rate) + gammaln(nn + shape)
        ll = ll + shape * math.log(rate) - gammaln(shape) + log_wd[None, :, None] + log_ws[None, None, :]
        ll = np.where(ee <= D - S + 1.0, ll, -np.inf)            # the first event lies inside the ramp
        top = ll.max(axis=(1, 2), keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        w = np.exp(ll - top)
        total, soon = w.sum(axis=(1, 2)), w[:, :, S_GRID <= SOON_MIN].sum(axis=(1, 2))
        log_pre = np.log(np.maximum(total, 1e-300)) + top[:, 0, 0] - math.log(D_GRID.max())
        e1 = ee[:, 0, 0] + 60.0                                  # steady rate, Exp(1) prior on it
        log_steady = gammaln(nn[:, 0, 0] + 1) - (nn[:, 0, 0] + 1) * np.log(e1 + 1.0)
        pre = 1.0 / (1.0 + np.exp(np.clip(log_steady + LOG_PRIOR_STEADY - log_pre, -50, 50)))
        out[i:i + chunk] = np.where(total > 0, pre * soon / np.maximum(total, 1e-300), 0.0)
    return out


def _by_mode(truth: evaluation.Truth, node: np.ndarray, t: np.ndarray, on: np.ndarray) -> dict[str, str]:
    """'caught/predictable' per failure mode, node level (an alarm on the node 60 to 2 min before)."""
    f, tally = truth.failures, {}
    for i in np.flatnonzero(f["precursor_s"] >= evaluation.MIN_LEAD_S):
        hit = np.any(on & (node == f["node"][i]) & (t >= f["timestamp"][i] - HORIZON_MS)
                     & (t <= f["timestamp"][i] - MIN_LEAD_MS))
        c, n = tally.get(f["mode"][i], (0, 0))
        tally[f["mode"][i]] = (c + int(hit), n + 1)
    return {m: f"{c}/{n}" for m, (c, n) in sorted(tally.items())}


def sweep(trace: Path, priors: dict, min_events: float) -> dict:
    rec = record(trace)
    score = rec["crit"].astype(float)
    for k, col in enumerate(COUNTERS):
        if col in MODE_OF:
            live = np.flatnonzero(rec["n"][:, k] >= min_events)
            p = p_soon(rec["n"][live, k], rec["el"][live, k], rec["sa"][live, k], priors[MODE_OF[col]])
            score[live] = np.maximum(score[live], p)
    hot = np.flatnonzero(score >= min(LEVELS))
    node, t, score = rec["node"][rec["slot"][hot]], rec["t"][hot], score[hot]
    alarms = pa.table({"timestamp": pa.array(t, pa.timestamp("ms", tz="UTC")),
                       "node": pa.array(node.tolist(), pa.string()),
                       "gpu": pa.array(rec["gpu"][rec["slot"][hot]].astype(np.int16)),
                       "score": pa.array(score)})
    truth = evaluation.load_truth(trace)
    counts = _Sweep(alarms, truth, "node")
    rows = []
    for c in LEVELS:
        caught, predictable, false = counts(c)
        rows.append({"level": c, "caught": caught, "predictable": predictable, "false_episodes": false,
                     "false_per_1000_node_days": round(false / truth.node_days * 1000, 2),
                     "caught_by_mode": _by_mode(truth, node, t, score >= c)})
    return {"trace": str(trace), "node_days": truth.node_days, "min_events": min_events, "rows": rows}


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, type=Path, help="labelled trace (with failures.parquet)")
    ap.add_argument("--priors-from", type=Path, default=None,
                    help="fit the ramp priors on this trace instead (default: the trace itself)")
    ap.add_argument("--min-events", type=float, default=6.0, help="events a ramp needs before it alarms")
    a = ap.parse_args()
    meta = run_meta()
    priors = fit_priors(a.priors_from or a.trace)
    res = sweep(a.trace, priors, a.min_events) | {"priors": priors, "growth": GROWTH}
    if a.json:
        write_json(a.json, meta, **res)
        return
    print(f"{res['trace']}: {res['node_days']:.0f} node-days; priors (log A mean/sd, log D mean/sd) "
          + ", ".join(f"{m} {p[0]:.2f}/{p[1]:.2f} {p[2]:.2f}/{p[3]:.2f}" for m, p in priors.items()))
    print("P(fail within 58 min) >= | caught / predictable | false episodes | per 1000 node-days | by mode")
    for r in res["rows"]:
        print(f"{r['level']:>24} | {r['caught']:>4} / {r['predictable']:<4} | {r['false_episodes']:>14} | "
              f"{r['false_per_1000_node_days']:>18} | " + " ".join(f"{m} {v}" for m, v in r["caught_by_mode"].items()))


if __name__ == "__main__":
    main()
