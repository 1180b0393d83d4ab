"""The demo's first story (``examples/demo.py``): the predictor's alarm, an urgent save, a lost
node and a warm spare taking its rank in process.

A predictor service and a node agent simulating node1's 8 GPUs (a PCIe link failure with
precursors scheduled on gpu2); the job under ``python -m ckpt.inprocess.launch`` on three
simulated nodes (each its own ``CKPT_GUARD_NODE``, memory dir and disk): node0 and node1 train
one rank each, node2 holds a warm spare (``--spare-nodes 1``). At the failure node1's launcher
and worker are SIGKILLed and its memory and disk wiped; the job launcher publishes a new round,
node2's spare takes rank 1 and node0's worker keeps its process.
"""
from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from ckpt.secret import SECRET_ENV
from examples.demo_events import collect_alarm, first_resumed, wait_for_failure, wait_restore
from examples.demo_procs import PY, REPO, Run, free_port, lose_node, say

TRAIN = str(REPO / "examples" / "demo_train.py")


def train_args(run: Run, args: argparse.Namespace, root: Path, memory: Path) -> list[str]:
    """What both stories' jobs are given alike: model, steps, step time, checkpoint interval, tiers."""
    return [TRAIN, "--root", str(root), "--memory-dir", str(memory), "--object-store", args.object_store_for(run),
            "--steps", str(args.steps), "--every", str(args.every), "--step-time", str(args.step_time),
            "--timeline", str(run.dir / "timeline.jsonl")]


def predictor_and_agent(run: Run, args: argparse.Namespace, node: str) -> tuple[str, str]:
    """A predictor service and a node agent simulating ``node``'s 8 GPUs, a PCIe link failure
    of gpu2 scheduled; returns the predictor's URL and the job's token."""
    agent_tok, job_tok = secrets.token_hex(16), secrets.token_hex(16)
    tokens = run.dir / "tokens"
    tokens.write_text(f"agent {agent_tok}\njob {job_tok}\n")
    tokens.chmod(0o600)
    (run.dir / "agent.token").write_text(agent_tok)
    url = f"http://127.0.0.1:{free_port()}"
    # the agent's model clock runs --time-scale times faster than the wall clock: its
    # samples are hours ahead by the end, which serve refuses beyond --max-ahead
    run.start("predictor", [PY, "-m", "predictor.cli", "serve", "--port", url.rsplit(":", 1)[1], "--tokens",
                            str(tokens), "--max-ahead", str(7 * 86400)])
    say(f"{run.name}: predictor serving on {url}")
    run.start("agent", [PY, "-m", "agents.cli", "run", "--source", "sim", "--predictor", url,
                        "--token-file", str(run.dir / "agent.token"), "--node-name", node,
                        "--interval", str(args.interval), "--time-scale", str(args.time_scale), "--model-clock",
                        "--fail", f"{node}/gpu2/pcie@+{args.fail_after}s", "--metrics-port", "0",
                        "--spool-dir", str(run.dir / "spool")])
    say(f"{run.name}: node agent simulating {node}'s 8 GPUs; a PCIe link failure of gpu2 is due in "
        f"{args.fail_after:.0f} s (precursors {args.time_scale:g}x faster than real)")
    return url, job_tok


def recovery_record(run: Run) -> dict | None:
    """The survivor's (rank 0's) recovery line: cause, world size, restored step, phases."""
    found = re.findall(r"ckpt-guard inprocess recovery (\{.*\})", run.log("node0"))
    return json.loads(found[-1]) if found else None


def inprocess_story(args: argparse.Namespace, name: str = "in-process") -> Run:
    run = Run(name, Path(args.workdir) / name)
    run.dir.mkdir(parents=True, exist_ok=True)
    nodes = ["node0", "node1", "node2"]
    memory = {n: Path(tempfile.mkdtemp(prefix=f"ckpt-demo-{name}-{n}-", dir="/dev/shm")) for n in nodes}
    args.memory_dirs.extend(memory.values())
    try:
        run.events["start"] = time.time()
        url, token = predictor_and_agent(run, args, "node1")
        port, secret = free_port(), secrets.token_hex(32)  # one job secret for every node (docs/security.md)
        launchers = {}
        for k, n in enumerate(nodes):
            cmd = [PY, "-m", "ckpt.inprocess.launch", "--nodes", "3", "--spare-nodes", "1", "--node-rank", str(k),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc", "1", "--hang-s", "30",
                   *train_args(run, args, run.dir / n, memory[n]), "--predictor", url, "--elevated-every", "1",
                   "--peers", "1"]
            launchers[n] = run.start(n, cmd, {"CKPT_GUARD_NODE": n, "CKPT_GUARD_JOB_TOKEN": token, SECRET_ENV: secret})
        say(f"{name}: training started (node0 and node1 one rank each, node2 a warm spare; a step every "
            f"{args.step_time:g} s, a checkpoint every {args.every} steps and every step while a node is at risk, "
            f"peer replicas, off-node tier {args.object_store_for(run)})")
        wait_for_failure(run, args, launchers["node0"], True)
        done = lose_node(run, launchers["node1"], memory["node1"], run.dir / "node1")
        say(f"{name}: GPU FAILURE on node1 at step {run.events['last_step']}: its launcher and worker killed, its "
            "memory and disk wiped")
        wait_restore(run, "node2", 1, launchers["node0"])
        say(f"{name}: node2's warm spare took rank 1 and restored step {run.events['restored_step']} "
            f"({run.events['restore_from']}; its restore() {run.events['restore_s']:.2f} s)")
        first = first_resumed(run, launchers["node0"], run.events["failure"], min_round=1)
        run.events["first_resumed_step"] = first["t"]
        say(f"{name}: training resumed in process at step {first['step']} "
            f"({first['t'] - run.events['failure']:.2f} s after the failure)")
        while len(run.timeline()) < len(done) + args.resume_steps and launchers["node0"].poll() is None:
            time.sleep(0.2)
        record = recovery_record(run)  # logged after the first resumed step
        if record is not None:
            run.events.update(recovery_total_s=record["phases"]["total_s"], world_size=record["world_size"])
        collect_alarm(run)
        return run
    finally:
        run.stop_all()
        for d in memory.values():
            shutil.rmtree(d, ignore_errors=True)
