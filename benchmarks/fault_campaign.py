"""The fault campaign: every fault ckpt-guard claims to survive, on one small job, one row each.

    python benchmarks/fault_campaign.py --json OUT [--faults killed,hung,...] [--no-lmr]

The job (benchmarks/fault_campaign_jobs.py): 2 gloo ranks (+ a warm spare) under
``python -m ckpt.inprocess.launch``, the recovery benchmark's tiny GPT, an overlapped snapshot
every step, the fault at step 4 of 8. Writes ``{"meta": {...}, "rows": [...]}``, a row per
fault (schema: benchmarks/fault_campaign_rows.py), and prints a table as rows finish. A fault
that does not apply here is a row with ``skipped`` and the reason. The two-node rows:
benchmarks/fault_campaign_nodes.py; the object store's: benchmarks/fault_campaign_objstore.py.
``--lmr-site DIR``: lm-resiliency 0.2.0 installed there (``pip install --no-deps --target DIR
lm-resiliency==0.2.0``: not one of our dependencies) adds its SDC check to the SDC rows
(``lmr_*`` columns); without it those columns are absent and ``meta.lmr`` says why.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository first
from benchmarks.fault_campaign_damage import damage_disk_shard, damage_memory_slots  # noqa: E402
from benchmarks.fault_campaign_jobs import FAULT_AT, STEPS  # noqa: E402
from benchmarks.fault_campaign_nodes import lost_node, peer_holder_killed, peer_replica_wrong, sdc_nodes  # noqa: E402
from benchmarks.fault_campaign_objstore import objstore_unreachable  # noqa: E402
from benchmarks.fault_campaign_rows import (  # noqa: E402
    Campaign,
    canary_fail,
    disk_full,
    predictor_down,
    process_fault,
    relaunched,
    sdc,
)
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402
from benchmarks.harness.procs import exit_on_sigterm  # noqa: E402

AT = str(FAULT_AT)
FAULTS = {
    "killed_rank": partial(process_fault, fault="killed_rank", child=["--kill-worker", "1", "--kill-at", AT]),
    "hung_rank": partial(process_fault, fault="hung_rank", launcher=["--hang-s", "1", "--nproc", "2", "--spares", "1"],
                         child=["--kill-worker", "1", "--kill-at", AT, "--hang"]),
    "lost_node": partial(lost_node, fault="lost_node", silent=False),
    "vanished_node": partial(lost_node, fault="vanished_node", silent=True),
    "xid79": partial(process_fault, fault="xid79", child=["--evict-worker", "1", "--kill-at", AT]),
    "sdc_param_bit": partial(sdc, fault="sdc_param_bit", kind="param"),
    "sdc_optim_bit": partial(sdc, fault="sdc_optim_bit", kind="optim"),
    "sdc_nan_forward": partial(sdc, fault="sdc_nan_forward", kind="nan_forward"),
    "sdc_grad_bit": partial(sdc, fault="sdc_grad_bit", kind="grad"),
    "memory_slot_damaged": partial(relaunched, fault="memory_slot_damaged", damage=damage_memory_slots),
    "disk_shard_damaged": partial(relaunched, fault="disk_shard_damaged", damage=damage_disk_shard),
    "second_fault_in_recovery": partial(process_fault, fault="second_fault_in_recovery",
                                        launcher=["--nproc", "2", "--spares", "2"],
                                        child=["--kill-worker", "1", "--kill-at", AT, "--kill-in-recovery", "2"]),
    "launcher_killed": partial(relaunched, fault="launcher_killed"),
    "local_disk_full": partial(disk_full, fault="local_disk_full"),
    "predictor_agent_down": partial(predictor_down, fault="predictor_agent_down"),
    "straggler": partial(process_fault, fault="straggler", child=["--slow-worker", "1", "--slow-s", "0.5"]),
    "peer_replica_wrong_at_save": partial(peer_replica_wrong, fault="peer_replica_wrong_at_save"),
    "objstore_unreachable": partial(objstore_unreachable, fault="objstore_unreachable"),
    "peer_holder_killed": partial(peer_holder_killed, fault="peer_holder_killed"),
    "sdc_param_bit_2_nodes": partial(sdc_nodes, fault="sdc_param_bit_2_nodes", kind="param"),
    "sdc_optim_bit_2_nodes": partial(sdc_nodes, fault="sdc_optim_bit_2_nodes", kind="optim"),
    "canary_fail_inprocess": partial(canary_fail, fault="canary_fail_inprocess"),
}
COLUMNS = ("fault", "mode", "detected", "detect_steps", "named", "restored_step", "steps_lost", "relaunched",
           "equal_to_clean", "lmr_detected")


def table_line(r: dict) -> str:
    if "skipped" in r or "error" in r:
        return f"{r['fault']:<26} {'skipped' if 'skipped' in r else 'ERROR'}: {r.get('skipped') or r['error'][:200]}"
    return " ".join(f"{str(r.get(k, '')):<{26 if k == 'fault' else 10}}" for k in COLUMNS)


def lmr_site(path: str | None) -> tuple[str | None, str]:
    """lm-resiliency's site dir when it imports with our torch, else None and why."""
    if not path:
        return None, "not run: no --lmr-site (pip install --no-deps --target DIR lm-resiliency==0.2.0)"
    import subprocess
    probe = subprocess.run([sys.executable, "-c", "from lm_resiliency.detection.c3 import C3"], capture_output=True,
                           text=True, env={"PYTHONPATH": path}, timeout=300)
    if probe.returncode:
        return None, f"not run: it does not import here: {probe.stderr.strip().splitlines()[-1]}"
    return path, "C3 (lm_resiliency.detection.c3) on the job's gloo group, over parameters and optimizer state"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    ap.add_argument("--lmr-site", default=None, help="a directory with lm-resiliency 0.2.0 installed (--target)")
    args = ap.parse_args()
    chosen = args.faults.split(",")
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown fault(s) {', '.join(unknown)}: one of {', '.join(FAULTS)}")
    exit_on_sigterm()
    site, why = lmr_site(args.lmr_site)
    meta = run_meta(steps=STEPS, fault_at=FAULT_AT, lmr=why)
    rows: list[dict] = []
    print(" ".join(f"{k:<{26 if k == 'fault' else 10}}" for k in COLUMNS), file=sys.stderr, flush=True)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as tmp, \
            tempfile.TemporaryDirectory(prefix="fault-campaign-", dir="/dev/shm") as shm:
        c = Campaign(Path(tmp), Path(shm), site)
        for i, fault in enumerate(chosen, 1):
            t0 = time.monotonic()
            try:
                rows.append({**FAULTS[fault](c), "wall_s": round(time.monotonic() - t0, 1)})
            except (SystemExit, Exception) as e:  # one broken row must not cost the others: it says why
                if isinstance(e, SystemExit) and not isinstance(e.code, str):
                    raise  # SIGTERM (exit_on_sigterm), not a job's failure
                rows.append({"fault": fault, "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
            print(f"{table_line(rows[-1])}  [{i}/{len(chosen)}, {time.monotonic() - t0:.0f} s]", file=sys.stderr,
                  flush=True)
            if args.json not in (None, "-") and i < len(chosen):  # what ran so far survives an interrupted campaign
                write_json(args.json, meta, rows, clean_step_s=c.clean_step_s, partial=f"{i} of {len(chosen)}")
        clean_step_s = c.clean_step_s
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(args.json, meta, rows, clean_step_s=clean_step_s, total_s=round(time.monotonic() - t_all, 1))


if __name__ == "__main__":
    main()
