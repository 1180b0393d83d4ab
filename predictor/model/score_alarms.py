# Vendored verbatim from the shared telemetry contract (telemetry/score_alarms.py): the
# reference scorer. `predictor eval` calls its score() so the numbers are the same by
# construction; tests check this copy still matches the shared one when it is present.
#!/usr/bin/env python3
"""Reference scorer for failure-prediction alarms (see EVAL.md beside this file).

usage: score_alarms.py ALARMS.parquet TRACE_DIR [--horizon 3600] [--min-lead 120] [--json]

ALARMS.parquet needs columns timestamp, node, gpu. TRACE_DIR holds failures.parquet
and telemetry.parquet (or trace.json with nodes and days) of the same trace.
Needs only pyarrow and numpy.
"""
import argparse, json, os, sys
import numpy as np
import pyarrow.parquet as pq

REAL_FAILURES_PER_NODE_DAY = 419 / (2048 * 54)  # Llama 3 405B run: 419 unexpected interruptions, 2048 nodes, 54 days


def _ms(col):
    return np.asarray(col.cast("int64") if str(col.type).startswith("timestamp") else col, dtype=np.int64)


def load(path, cols):
    t = pq.read_table(path, columns=cols)
    out = {}
    for c in cols:
        col = t.column(c).combine_chunks()
        if c == "timestamp":
            unit = getattr(col.type, "unit", "ms")
            div = {"s": 1e-3, "ms": 1, "us": 1e3, "ns": 1e6}[unit]
            out[c] = (_ms(col) / div).astype(np.int64)
        elif c == "node":
            out[c] = np.asarray(col.cast("string").to_pylist(), dtype=object)
        else:
            out[c] = np.asarray(col.to_pylist())
    return out


def node_days(trace_dir):
    meta = os.path.join(trace_dir, "trace.json")
    if os.path.exists(meta):
        m = json.load(open(meta))
        return m["nodes"] * m["days"]
    t = load(os.path.join(trace_dir, "telemetry.parquet"), ["timestamp", "node"])
    total = 0.0
    for nd in np.unique(t["node"]):
        ts = t["timestamp"][t["node"] == nd]
        total += (ts.max() - ts.min()) / 86400e3
    return total


def score(alarms, fails, n_days, horizon_s=3600, min_lead_s=120, level="node"):
    H, L = horizon_s * 1000, min_lead_s * 1000
    key = (lambda d, i: d["node"][i]) if level == "node" else (lambda d, i: (d["node"][i], int(d["gpu"][i])))
    by_key = {}
    for i in range(len(alarms["timestamp"])):
        by_key.setdefault(key(alarms, i), []).append(alarms["timestamp"][i])
    for k in by_key:
        by_key[k] = np.sort(np.asarray(by_key[k], dtype=np.int64))
    fails_by_key = {}
    for i in range(len(fails["timestamp"])):
        fails_by_key.setdefault(key(fails, i), []).append(fails["timestamp"][i])
    caught, leads, per_mode = 0, [], {}
    predictable = caught_predictable = 0
    for i in range(len(fails["timestamp"])):
        T = fails["timestamp"][i]; a = by_key.get(key(fails, i), np.empty(0, np.int64))
        win = a[(a >= T - H) & (a <= T - L)]
        mode = str(fails["mode"][i])
        pm = per_mode.setdefault(mode, [0, 0]); pm[1] += 1
        is_predictable = fails["precursor_s"][i] * 1000 >= L
        predictable += int(is_predictable)
        if len(win):
            caught += 1; pm[0] += 1; leads.append((T - win.min()) / 1000)
            caught_predictable += int(is_predictable)
    false_eps = 0; episodes = 0
    for k, a in by_key.items():
        f = np.sort(np.asarray(fails_by_key.get(k, []), dtype=np.int64))
        start = None
        for t in a:
            if start is not None and t <= start + H:
                continue
            # an alarm in the hour after a failure on the same key reports that failure
            if len(f) and np.any((f <= t) & (t <= f + H)):
                continue
            start = t; episodes += 1
            if not (len(f) and np.any((f >= t) & (f <= t + H))):
                false_eps += 1
    n = len(fails["timestamp"])
    fa_rate = false_eps / n_days * 1000 if n_days else float("nan")
    rec = caught / n if n else float("nan")
    rho = REAL_FAILURES_PER_NODE_DAY
    fa_per_node_day = false_eps / n_days if n_days else float("nan")
    prec_real = rec * rho / (rec * rho + fa_per_node_day) if (rec * rho + fa_per_node_day) > 0 else float("nan")
    return {"level": level, "failures": int(n), "predictable_failures": int(predictable), "caught": int(caught),
            "recall": round(rec, 4), "recall_of_predictable": round(caught_predictable / predictable, 4) if predictable else None,
            "alarm_episodes": int(episodes), "false_alarms": int(false_eps), "node_days": round(float(n_days), 2),
            "false_alarms_per_1000_node_days": round(fa_rate, 3),
            "lead_s_median": round(float(np.median(leads)), 1) if leads else None,
            "lead_s_p10": round(float(np.percentile(leads, 10)), 1) if leads else None,
            "precision_at_real_failure_rate": round(prec_real, 4),
            "recall_by_mode": {m: f"{c}/{t}" for m, (c, t) in sorted(per_mode.items())}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("alarms"); ap.add_argument("trace_dir")
    ap.add_argument("--horizon", type=float, default=3600); ap.add_argument("--min-lead", type=float, default=120)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    alarms = load(a.alarms, ["timestamp", "node", "gpu"])
    fails = load(os.path.join(a.trace_dir, "failures.parquet"), ["timestamp", "node", "gpu", "mode", "precursor_s"])
    nd = node_days(a.trace_dir)
    res = {lvl: score(alarms, fails, nd, a.horizon, a.min_lead, lvl) for lvl in ("node", "gpu")}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for lvl, r in res.items():
            print(f"[{lvl}] recall {r['recall']} ({r['caught']}/{r['failures']}), of predictable {r['recall_of_predictable']}, "
                  f"false alarms {r['false_alarms_per_1000_node_days']}/1000 node-days, lead median {r['lead_s_median']} s, "
                  f"precision at real failure rate {r['precision_at_real_failure_rate']}, by mode {r['recall_by_mode']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
