"""How well calibrated job-level risk is on held-out labelled traces.

Replays each trace through the model (as `predictor serve` would score it), takes
every node's probability about every 5 min (predictor/model/job_risk.py), and groups the
nodes, in name order, into jobs of `--job-nodes`. A job-instant is positive when any
of its nodes fails within the hour after it. Reported per level (node, job): the
Brier score, the Brier score of always saying the base rate, and a reliability table
(per bin of predicted probability: count, mean prediction, observed frequency); and,
for comparison, the same for the model's own node score read as a probability.

    PYTHONPATH=. python benchmarks/job_risk_calibration.py --trace /tmp/q/ev_60 [--model M] [--job-nodes 8] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402
from predictor.model import job_risk, model_io  # noqa: E402


def job_level(inst: job_risk.NodeInstants, cal: job_risk.NodeCalibration, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(P(any node fails within H), whether one did) per complete job-instant."""
    rank = np.argsort(np.argsort(inst.names))           # node id -> position in name order
    job = rank[inst.node] // k
    keys, group = np.unique(np.stack([inst.t_ms, job], axis=1), axis=0, return_inverse=True)
    group = group.ravel()
    log_survive = np.zeros(len(keys))
    np.add.at(log_survive, group, np.log1p(-cal.probability(inst.score)))
    failed = np.zeros(len(keys), bool)
    np.logical_or.at(failed, group, inst.failed)
    members = np.bincount(group, minlength=len(keys))
    size = np.bincount(rank // k)[keys[:, 1]]            # a job-instant missing a node is left out
    full = members == size
    return -np.expm1(log_survive[full]), failed[full]


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", required=True, type=Path, help="held-out labelled trace")
    ap.add_argument("--model", help="model file (default: the packaged model)")
    ap.add_argument("--job-nodes", type=int, default=8)
    args = ap.parse_args()
    meta = run_meta()
    m = model_io.load(args.model)
    cal = job_risk.NodeCalibration.of(m)
    if cal is None:
        raise SystemExit("the model has no node calibration: run `predictor calibrate` on it")
    nodes_p, nodes_y, jobs_p, jobs_y, raw = [], [], [], [], []
    for trace in args.trace:
        inst = job_risk.node_instants(trace, m)
        nodes_p.append(cal.probability(inst.score))
        raw.append(inst.score)
        nodes_y.append(inst.failed)
        p, y = job_level(inst, cal, args.job_nodes)
        jobs_p.append(p)
        jobs_y.append(y)
    res = {"traces": [str(t) for t in args.trace], "job_nodes": args.job_nodes,
           "base_probability_per_node": round(cal.base_probability, 6),
           "node": job_risk.reliability(np.concatenate(nodes_p), np.concatenate(nodes_y)),
           # the model's own score (worst GPU) read as a probability, for comparison
           "node_score_as_probability": job_risk.reliability(np.concatenate(raw), np.concatenate(nodes_y)),
           "job": job_risk.reliability(np.concatenate(jobs_p), np.concatenate(jobs_y))}
    if args.json:
        write_json(args.json, meta, **res)
        return
    for level in ("node_score_as_probability", "node", "job"):
        r = res[level]
        print(f"[{level}] {r['n']} instants, {r['positives']} followed by a failure within 1 h: Brier {r['brier']} "
              f"(base rate alone {r['brier_of_base_rate']})")
        print("  predicted bin | n | mean predicted | observed")
        for row in r["table"]:
            print(f"  {row['bin']:>11} | {row['n']} | {row['predicted']} | {row['observed']}")


if __name__ == "__main__":
    main()
