"""The simulator's inputs: measured costs scaled to a run's checkpoint, and the three
strategies compared. Embedded defaults are our own measurements (sources below and in
docs/goodput.md); ``--bench``, ``--objstore-bench`` and ``--predictor-eval`` replace them.

Scaling: every node writes its own GPUs' share of the checkpoint at the same time, so a
node is taken to do on its share what the benchmark machine did on the benchmark's
bytes (times scale with bytes per node); the object store is taken to serve every node
at the per-client throughput measured (it scales out by key prefix).
"""
from __future__ import annotations

import json
from pathlib import Path

from .simulate import Lead, Recovery, Run, Skill, Strategy

# benchmarks/ckpt_bench.py --config medium (GPT ~350M + AdamW, 4.26 GB), median of 3, on
# the 2-core development VM, 2026-11-22. Keys as that script writes them with --json.
BENCH = {"state_bytes": 4258456720, "ours_block_s": 2.143, "ours_durable_disk_s": 6.562,
         "ours_restore_memory_s": 0.861, "dcp_save_s": 10.494,
         "dcp_load_s": 10.026, "source": "ckpt_bench.py --config medium, 2-core VM (load ~2.5), 2026-11-22"}

# benchmarks/objstore_bench.py --json (branch objstore) against moto's S3 server on
# loopback, 2-core VM, 2026-11-22: MB/s up and down per contender. The server's CPU is
# the bottleneck there, so these are far below a real store: see --objstore-gbps.
OBJSTORE = {"results": {"ours": {"up": {"MBps": 52.3}, "down": {"MBps": 30.1}},
                        "dcp1": {"up": {"MBps": 45.6}, "down": {"MBps": 17.5}},
                        "dcpN": {"up": {"MBps": 52.5}, "down": {"MBps": 71.3}}},
            "source": "objstore_bench.py --gb 1 --repeats 3, moto on loopback, 2-core VM, 2026-11-22"}

# predictor eval --json (branch predictor), node level; keys as the reference scorer
# (shared/telemetry/score_alarms.py) writes them. Recall and false alarms: what threshold
# rules reach (shared/telemetry/EVAL.md); lead: the precursor durations of the
# fleet-sample trace's predictable failures (median, 10th percentile), the most any
# predictor could give. The packaged model's own eval is far weaker (docs/goodput.md).
PREDICTOR = {"node": {"recall_of_predictable": 0.8, "false_alarms_per_1000_node_days": 20.0,
                      "lead_s_median": 3130.0, "lead_s_p10": 810.0},
             "source": "EVAL.md threshold-rule reference (0.8 of predictable, 20 false alarms/1000 "
                       "node-days); lead from fleet-sample precursors"}

# Llama 3 405B: 405e9 parameters x 14 bytes (bf16 weights, fp32 master copy, two fp32
# Adam moments) over 16,384 GPUs.
STATE_GB_PER_GPU = round(405e9 * 14 / 16384 / 1e9, 3)


def load_json(path: str | None, default: dict) -> dict:
    """A benchmark or eval JSON file, or the embedded default."""
    if path is None:
        return default
    data = json.loads(Path(path).read_text())
    return data | {"source": str(path)}


def _dcp_MBps(objstore: dict, phase: str) -> float:
    """DCP through fsspec at its better thread count: the baseline at its best."""
    return max(objstore["results"][c][phase]["MBps"] for c in ("dcp1", "dcpN") if c in objstore["results"])


def skill_of(evaluation: dict) -> Skill:
    """The node-level scores of ``predictor eval --json``."""
    node = evaluation["node"]
    return Skill(node["recall_of_predictable"], node["false_alarms_per_1000_node_days"],
                 Lead(node["lead_s_median"], node["lead_s_p10"]))


def strategies(run: Run, bench: dict, objstore: dict, evaluation: dict, state_gb_per_gpu: float,
               objstore_gbps: float | None = None) -> list[Strategy]:
    """(a) DCP straight to the object store, (b) our tiers, (c) our tiers + the predictor."""
    node_bytes = state_gb_per_gpu * 1e9 * run.gpus_per_node
    scale = node_bytes / bench["state_bytes"]

    def rate(MBps: float) -> float:  # bytes per second
        return objstore_gbps * 1e9 if objstore_gbps else MBps * 1e6

    # a save through DCP is never faster than DCP's own save to local disk
    dcp_save = max(node_bytes / rate(_dcp_MBps(objstore, "up")), bench["dcp_save_s"] * scale)
    dcp_load = max(node_bytes / rate(_dcp_MBps(objstore, "down")), bench["dcp_load_s"] * scale)
    dcp = Recovery(dcp_save, dcp_load)
    block = bench["ours_block_s"] * scale
    memory = Recovery(block, bench["ours_restore_memory_s"] * scale)
    ours = objstore["results"]["ours"]
    off_node = Recovery(bench["ours_durable_disk_s"] * scale + node_bytes / rate(ours["up"]["MBps"]),
                        node_bytes / rate(ours["down"]["MBps"]))
    return [Strategy("a", "(a) DCP to object store, periodic", dcp_save, dcp, dcp),
            Strategy("b", "(b) ckpt tiers, periodic", block, memory, off_node),
            Strategy("c", "(c) ckpt tiers + predictor", block, memory, off_node, skill_of(evaluation))]
