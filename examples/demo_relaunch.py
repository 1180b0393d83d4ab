"""The demo's second story (``examples/demo.py``): today's job, periodic checkpoints only, a
lost node and a relaunch restoring from the object store.

The same training script as the first story (``examples/demo_train.py``), under plain
``torchrun``: one node (node-a) of 2 ranks, no predictor, no spare, no peers. At the same
step as the first story's failure node-a's processes are SIGKILLed and its memory and disk
wiped; a new node (node-b, empty memory and disk) starts the job again, whose ranks restore
the newest checkpoint from the object store.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from examples.demo_events import first_resumed, wait_for_failure, wait_restore
from examples.demo_inprocess import train_args
from examples.demo_procs import PY, Run, lose_node, say


def torchrun(run: Run, args: argparse.Namespace, node: str, memory: Path):
    """``torchrun`` of the demo's job on ``node``: 2 ranks, its own memory dir and disk root."""
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", *train_args(run, args, run.dir / node, memory)]
    return run.start(node, cmd, {"CKPT_GUARD_NODE": node})


def relaunch_story(args: argparse.Namespace, fail_at_step: int | None, name: str = "relaunch") -> Run:
    run = Run(name, Path(args.workdir) / name)
    run.dir.mkdir(parents=True, exist_ok=True)
    memory = {n: Path(tempfile.mkdtemp(prefix=f"ckpt-demo-{name}-{n}-", dir="/dev/shm")) for n in ("node-a", "node-b")}
    args.memory_dirs.extend(memory.values())
    try:
        run.events["start"] = time.time()
        job = torchrun(run, args, "node-a", memory["node-a"])
        say(f"{name}: training started under torchrun (node-a, 2 ranks; a step every {args.step_time:g} s, a "
            f"checkpoint every {args.every} steps, off-node tier {args.object_store_for(run)})")
        wait_for_failure(run, args, job, False, fail_at_step)
        done = lose_node(run, job, memory["node-a"], run.dir / "node-a")
        say(f"{name}: GPU FAILURE on node-a at step {run.events['last_step']}: its processes killed, its memory "
            "and disk wiped; the job starts again on node-b")
        job = torchrun(run, args, "node-b", memory["node-b"])
        wait_restore(run, "node-b", 0, job)
        say(f"{name}: the relaunched job restored step {run.events['restored_step']} "
            f"({run.events['restore_from']}; rank 0's restore() {run.events['restore_s']:.2f} s)")
        first = first_resumed(run, job, run.events["failure"])
        run.events["first_resumed_step"] = first["t"]
        say(f"{name}: training resumed at step {first['step']} ({first['t'] - run.events['failure']:.2f} s after "
            "the failure)")
        while len(run.timeline()) < len(done) + args.resume_steps and job.poll() is None:
            time.sleep(0.2)
        return run
    finally:
        run.stop_all()
        for d in memory.values():
            shutil.rmtree(d, ignore_errors=True)
