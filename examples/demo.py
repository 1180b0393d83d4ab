"""The end-to-end demo (``make demo``): a predicted GPU failure, an urgent checkpoint, the
node lost, and a warm spare taking its rank in process within about a second; beside it
today's job, relaunched and restored from the object store.

Everything runs on this machine on embedded defaults (no GPU, no cloud account), twice, with
the same training script (``examples/demo_train.py``: a small GPT, DDP on gloo, 2 ranks), the
same steps, step time, checkpoint interval and failure step. The two runs differ only in this:

  in-process   the predictor and a node agent (a PCIe failure with precursors scheduled on node1),
               the job under ``python -m ckpt.inprocess.launch`` on three simulated nodes: node0
               and node1 one rank each, node2 a warm spare; peer replicas; while a node is at risk
               a checkpoint every step (``--elevated-every 1``). The alarm makes every rank save
               urgently; at the failure node1's processes are killed and its memory and disk
               wiped; node2's spare takes rank 1 in the survivors' job (``demo_inprocess.py``).
  relaunch     today's job: periodic checkpoints only, under ``torchrun`` on one node of 2 ranks,
               lost whole; the job starts again on a new node and restores from the object store
               (``demo_relaunch.py``).

The object store is a ``file://`` directory (``--object-store s3://...`` with
``AWS_ENDPOINT_URL`` for a real one). ``--json FILE`` writes every event and figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.demo_inprocess import inprocess_story  # noqa: E402
from examples.demo_procs import Run, leaves_no_shm, say  # noqa: E402
from examples.demo_relaunch import relaunch_story  # noqa: E402

# each figure the summary prints, with what it measures (from which event to which)
EXPLAINED = {
    "alarm": "the predictor's alarm, as the job logged it (the agent's precursors -> predictor -> the job's listener)",
    "urgent_durable": "the urgent checkpoint durable in every tier: memory, disk, the peer replica, the object store",
    "failure": "the demo SIGKILLs the node's processes and wipes its memory and disk (rank 0's last completed step)",
    "restore_done": "the lost rank's state loaded (in-process: the spare's; relaunch: rank 0's): its restore() (agree "
                    "on a step, read, load) and where it read from",
    "first_resumed_step": "rank 0 completed the first step after the restored one",
}


def report(runs: list[Run], args: argparse.Namespace) -> dict:
    """The summary: each run's events in seconds since its job started, then its two figures."""
    out = {}
    print()
    for run in runs:
        e = run.events

        def rel(k: str, e: dict = e) -> str:
            return f"{e[k] - e['start']:7.1f} s" if k in e else "      -  "
        lost = e["last_step"] - e["restored_step"]
        print(f"== {run.name}   (seconds since the job started)")
        what = {"alarm": "predictor alarm: GPU failure predicted on node1",
                "urgent_durable": "urgent checkpoint durable off-node" + (f" (step {e['urgent_step']})"
                                                                           if "urgent_step" in e else ""),
                "failure": f"GPU failure: node lost after step {e['last_step']}",
                "restore_done": f"the lost state restored: step {e['restored_step']} from {e['restore_from']} "
                                f"({e['restore_sources']}; its restore() {e['restore_s']:.2f} s)",
                "first_resumed_step": f"first resumed step ({e['restored_step'] + 1})"}
        for k, line in what.items():
            print(f"  {rel(k)}  {line}")
        resume_s = e["first_resumed_step"] - e["failure"]
        print(f"  failure to first resumed step: {resume_s:.2f} s   (from the SIGKILL to rank 0 completing step "
              f"{e['restored_step'] + 1})")
        print(f"  steps lost: {lost}   (steps completed before the failure and trained again: {e['last_step']} - "
              f"{e['restored_step']}, {lost * args.step_time:.1f} s of training)")
        if "recovery_total_s" in e:
            print(f"  the survivor's own record: {e['recovery_total_s']:.2f} s   (from its step failing on the lost "
                  f"rank to its first resumed step, at world size {e['world_size']})")
        print()
        out[run.name] = {**e, "lost_steps": lost, "failure_to_first_resumed_step_s": resume_s}
    print("what each line measures:")
    for k, text in EXPLAINED.items():
        print(f"  {k}: {text}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where logs and checkpoints go (default: a new temp dir)")
    ap.add_argument("--object-store", default=None, help="fsspec URL prefix of the off-node tier (default: file://WORKDIR)")
    ap.add_argument("--fail-after", type=float, default=190.0, help="wall seconds until the GPU fails")
    ap.add_argument("--alarm-grace", type=float, default=240.0,
                    help="in-process: seconds past the scheduled failure to wait for the urgent checkpoint before "
                         "failing the node without it (the demo then exits 1)")
    ap.add_argument("--stall-timeout", type=float, default=600.0,
                    help="give up when the job trains no step for this long (the hang guard)")
    ap.add_argument("--time-scale", type=float, default=30.0, help="how much faster the simulated precursors run")
    ap.add_argument("--interval", type=float, default=2.0, help="agent sampling interval, wall seconds")
    ap.add_argument("--step-time", type=float, default=0.5)
    ap.add_argument("--every", type=int, default=120, help="checkpoint interval, steps")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--resume-steps", type=int, default=10, help="steps to train after resuming")
    ap.add_argument("--only", choices=["in-process", "relaunch"], default=None)
    ap.add_argument("--json", default=None, help="write the events and figures as JSON here")
    args = ap.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="ckpt-guard-demo-", dir="/var/tmp")
    args.memory_dirs = []
    store = (args.object_store or "file://" + args.workdir).rstrip("/")
    args.object_store_for = lambda run: f"{store}/{run.name}/objstore"
    say(f"work directory {args.workdir}")
    runs = []
    if args.only != "relaunch":
        runs.append(inprocess_story(args))
    if args.only != "in-process":
        same_step = runs[0].events["last_step"] if runs else None  # the same work at risk in both runs
        runs.append(relaunch_story(args, same_step))
    out = report(runs, args)
    leaves_no_shm(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if any(r.name == "in-process" and "urgent_durable" not in r.events for r in runs):
        raise SystemExit("the predictor's alarm never made the job save urgently: see the logs in "
                         f"{args.workdir}/in-process")


if __name__ == "__main__":
    main()
