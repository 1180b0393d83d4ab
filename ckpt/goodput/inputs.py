"""The simulator's inputs: measured costs scaled to a run's checkpoint, and the five
strategies compared. Defaults are our own measurements, kept as dated data files in
``data/`` (each names its source); ``--bench``, ``--objstore-bench`` and
``--predictor-eval`` replace them.

Scaling: every node writes its own GPUs' share of the checkpoint at the same time, so a
node is taken to do on its share what the benchmark machine did on the benchmark's
bytes (times scale with bytes per node); the object store is taken to serve every node
at the per-client throughput measured (it scales out by key prefix); a peer replica
travels over a node's front-end NIC, shared by its GPUs. A restart's phases before
the restore come from ``restart.RestartCosts``, per kind of failure and strategy.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

from .inprocess import InProcessCosts
from .model import KINDS, Lead, Recovery, Run, Skill, Strategy
from .restart import RestartCosts
from .scaling import fitted


def _packaged(name: str) -> dict:
    """A measurement shipped with the package: its values, where they come from and when."""
    return json.loads(files(__package__).joinpath("data", name).read_text())


# Each names its benchmark, command, machine and date (docs/goodput.md lists them).
BENCH = _packaged("ckpt_bench_medium.json")
OBJSTORE = _packaged("objstore_moto.json")
PREDICTOR = _packaged("predictor_reference.json")
INPROCESS = _packaged("inprocess_nvrx.json")  # (f)'s phases and snapshot cost, a source per value

# Llama 3 405B: 405e9 parameters x 14 bytes (bf16 weights, fp32 master copy, two fp32
# Adam moments) over 16,384 GPUs.
STATE_GB_PER_GPU = round(405e9 * 14 / 16384 / 1e9, 3)
DEFAULT_RESTART = RestartCosts()  # the restart phases' defaults (docs/goodput.md, "Restart phases")
# (f)'s phases measured by our own benchmark, each by its scale_bench component, at the run's size
MEASURED_INPROCESS = {"agree_s": "membership_round"}


def inprocess_at(gpus: int, **given: float) -> InProcessCosts:
    """(f)'s phases for a run of ``gpus`` ranks: measured where ``MEASURED_INPROCESS`` says
    (``scaling.fitted``), the rest borrowed (``INPROCESS``), any of them replaced by ``given``."""
    measured = {phase: fitted(component, gpus).seconds for phase, component in MEASURED_INPROCESS.items()}
    return InProcessCosts(**{**INPROCESS["values"], **measured, **given})


DEFAULT_INPROCESS = inprocess_at(Run().gpus)
NIC_GBIT_PER_NODE = 100.0  # the front-end NIC replicas travel over (the GPUs' own fabric is the job's)


def load_json(path: str | None, default: dict) -> dict:
    """A benchmark or eval JSON file, or the packaged default."""
    if path is None:
        return default
    data = json.loads(Path(path).read_text())
    return data | {"source": str(path)}


def _dcp_MBps(objstore: dict, phase: str) -> float:
    """DCP through fsspec at its better thread count: the baseline at its best."""
    return max(objstore["results"][c][phase]["MBps"] for c in ("dcp1", "dcpN") if c in objstore["results"])


# metrics the scorer leaves null (or NaN) when the trace has nothing to measure them on:
# (what, its keys, why it is missing, what the simulator assumes instead)
_NO_SKILL = "the predictor is taken to catch nothing (no skill)"
_MISSING = [("recall of predictable failures", ("recall_of_predictable",),
             "no predictable failures in this trace", _NO_SKILL),
            ("lead", ("lead_s_median", "lead_s_p10"), "no failure caught in this trace", _NO_SKILL),
            ("false-alarm rate", ("false_alarms_per_1000_node_days",), "no node-days in this trace",
             "taken as no false alarms")]


def _metric(node: dict, key: str) -> float | None:
    """A node-level score, or None where the eval could not measure it (null or NaN)."""
    value = node[key]
    return None if value is None or math.isnan(value) else float(value)


def eval_notes(evaluation: dict) -> list[str]:
    """What ``skill_of`` had to assume, one sentence per missing metric."""
    node = evaluation["node"]
    return [f"predictor eval: {what} unknown ({why}); {effect}" for what, keys, why, effect in _MISSING
            if any(_metric(node, k) is None for k in keys)]


def skill_of(evaluation: dict) -> Skill:
    """The node-level scores of ``predictor eval --json``; a predictor whose recall or
    lead could not be measured is one that catches nothing (``eval_notes`` says why)."""
    node = evaluation["node"]
    recall, median, p10, false_alarms = (_metric(node, k) for k in (
        "recall_of_predictable", "lead_s_median", "lead_s_p10", "false_alarms_per_1000_node_days"))
    if recall is None or median is None or p10 is None:
        return Skill(0.0, false_alarms or 0.0, None)
    return Skill(recall, false_alarms or 0.0, Lead(median, p10))


def peer_gbps_default(run: Run) -> float:
    """GB/s per GPU to and from a peer: a 100 Gb/s NIC per node, shared by its GPUs."""
    return NIC_GBIT_PER_NODE / 8 / run.gpus_per_node


def _with_restarts(run: Run, s: Strategy, costs: RestartCosts, inprocess: InProcessCosts | None = None) -> Strategy:
    """``s`` with each kind's recovery carrying its restart phases (``restart.PHASES``);
    a strategy with a predictor stages a spare at the alarms it raises; with ``inprocess``
    most failures recover in-process."""
    lead = s.skill.lead if s.skill else None
    return replace(s, **{k: replace(s.recovery(k), **{f"{p}_s": v for p, v in costs.phases(
        k, s.fail_fast, s.caught(run), lead, inprocess).items()}) for k in KINDS})


def strategies(run: Run, bench: dict, objstore: dict, evaluation: dict, state_gb_per_gpu: float,
               objstore_gbps: float | None = None, peer_gbps: float | None = None,
               restart: RestartCosts = DEFAULT_RESTART, inprocess: InProcessCosts = DEFAULT_INPROCESS
               ) -> list[Strategy]:
    """(a) DCP straight to the object store, (b) our tiers, (c) our tiers + the predictor,
    (d) our tiers + one peer replica per shard + the predictor, (e) (d) with fail-fast
    (issue 19), (f) all of ours: (e) recovering in-process (issue 33), snapshotting at its
    own optimum for its snapshot cost but at most once a step. (a)-(d) wait out the
    collective timeout when a GPU hangs."""
    node_bytes = state_gb_per_gpu * 1e9 * run.gpus_per_node
    scale = node_bytes / bench["state_bytes"]

    def rate(MBps: float) -> float:  # bytes per second
        return objstore_gbps * 1e9 if objstore_gbps else MBps * 1e6

    # a save through DCP is never faster than DCP's own save to local disk
    dcp_save = max(node_bytes / rate(_dcp_MBps(objstore, "up")), bench["dcp_save_s"] * scale)
    dcp_load = max(node_bytes / rate(_dcp_MBps(objstore, "down")), bench["dcp_load_s"] * scale)
    dcp = Recovery(dcp_save, dcp_load, "object store (DCP)")
    block = bench["ours_block_s"] * scale
    memory = Recovery(block, bench["ours_restore_memory_s"] * scale, "local memory")
    ours = objstore["results"]["ours"]
    off_node = Recovery(bench["ours_durable_disk_s"] * scale + node_bytes / rate(ours["up"]["MBps"]),
                        node_bytes / rate(ours["down"]["MBps"]), "object store")
    # each GPU's shard goes to (and comes back from) the same local rank on the next node
    peer_s = state_gb_per_gpu / (peer_gbps or peer_gbps_default(run))
    peer = Recovery(block + peer_s, peer_s, "peer memory")
    skill = skill_of(evaluation)
    peers = Strategy("d", "(d) ckpt tiers + peers + predictor", block, memory, peer, peer, skill)
    fail_fast = replace(peers, name="e", label="(e) ckpt tiers + peers + predictor + fail-fast", fail_fast=True)
    snap = inprocess.snapshot_block_s
    in_process = replace(fail_fast, name="f", label="(f) ckpt tiers + peers + predictor + fail-fast + in-process",
                         blocking_s=snap, crash=replace(memory, lag_s=snap),
                         gpu=replace(peer, lag_s=snap + peer_s), host=replace(peer, lag_s=snap + peer_s),
                         floor_s=inprocess.step_s + snap)
    compared = [Strategy("a", "(a) DCP to object store, periodic", dcp_save, dcp, dcp, dcp),
                Strategy("b", "(b) ckpt tiers, periodic", block, memory, off_node, off_node),
                Strategy("c", "(c) ckpt tiers + predictor", block, memory, off_node, off_node, skill),
                peers, fail_fast]
    return [_with_restarts(run, s, restart) for s in compared] + [_with_restarts(run, in_process, restart, inprocess)]
