"""The simulator's inputs: measured costs scaled to a run's checkpoint, and the three
strategies compared. Defaults are our own measurements, kept as dated data files in
``data/`` (each names its source); ``--bench``, ``--objstore-bench`` and
``--predictor-eval`` replace them.

Scaling: every node writes its own GPUs' share of the checkpoint at the same time, so a
node is taken to do on its share what the benchmark machine did on the benchmark's
bytes (times scale with bytes per node); the object store is taken to serve every node
at the per-client throughput measured (it scales out by key prefix).
"""
from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from .model import Lead, Recovery, Run, Skill, Strategy


def _packaged(name: str) -> dict:
    """A measurement shipped with the package: its values, where they come from and when."""
    return json.loads(files(__package__).joinpath("data", name).read_text())


# Each names its benchmark, command, machine and date (docs/goodput.md lists them).
BENCH = _packaged("ckpt_bench_medium.json")
OBJSTORE = _packaged("objstore_moto.json")
PREDICTOR = _packaged("predictor_reference.json")

# Llama 3 405B: 405e9 parameters x 14 bytes (bf16 weights, fp32 master copy, two fp32
# Adam moments) over 16,384 GPUs.
STATE_GB_PER_GPU = round(405e9 * 14 / 16384 / 1e9, 3)


def load_json(path: str | None, default: dict) -> dict:
    """A benchmark or eval JSON file, or the packaged default."""
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
