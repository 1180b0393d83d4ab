"""The predictor scoring a job's GPUs: scale_bench's ``predictor_score`` row.

N ranks are N/8 nodes of 8 GPUs. Their telemetry (every SCHEMA.md telemetry column, the bodies
``predictor_throughput.py`` sends) goes through the scorer ``predictor serve`` runs
(``predictor.model.scoring.Scorer`` with the packaged model, ``score_table``: features, the
model, the rules), in this process: three instants to fill the fleet state (not timed), then the
one timed: one sample of every GPU, what the fleet's agents send in one interval.
"""
from __future__ import annotations

import time

INTERVAL_MS = 10_000
T0_MS = 1_780_000_000_000
WARM = 3


def _instant(nodes: list[str], k: int, rng):
    import numpy as np
    import pyarrow as pa

    from benchmarks.predictor_throughput import _body
    gpus = 8
    t = np.full(len(nodes) * gpus, T0_MS + k * INTERVAL_MS, dtype=np.int64)
    return pa.ipc.open_stream(_body(nodes, t, gpus, rng)).read_all()


def run_one(n: int) -> dict:
    """Score one interval of N/8 nodes x 8 GPUs after ``WARM`` intervals: its row."""
    import numpy as np

    from predictor.model.model_io import load
    from predictor.model.scoring import Scorer
    rng = np.random.default_rng(0)
    nodes = [f"node{i:05d}" for i in range(max(1, n // 8))]
    tables = [_instant(nodes, k, rng) for k in range(WARM + 1)]
    scorer = Scorer(load())
    for table in tables[:WARM]:
        scorer.score_table(table)
    t0 = time.perf_counter()
    scored = scorer.score_table(tables[WARM])
    seconds = time.perf_counter() - t0
    if len(scored.risk) != len(nodes) * 8:
        raise RuntimeError(f"scored {len(scored.risk)} of {len(nodes) * 8} samples")
    return {"component": "predictor_score", "ranks": n, "seconds": seconds, "store_ops": 0, "store_keys": 0,
            "ops_per_rank": 0.0, "server_s_per_op": 0.0, "gpus": len(nodes) * 8,
            "samples_per_s": len(nodes) * 8 / seconds}
