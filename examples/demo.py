"""The end-to-end demo (``make demo``): a predicted GPU failure, an urgent checkpoint
evacuated off the node, the node lost, and training resumed in seconds; next to the same
job with periodic checkpoints only.

Everything runs on this machine on embedded defaults: a predictor service, a node
agent simulating a node's 8 GPUs (a PCIe link failure with precursors is scheduled on
gpu2), a 2-rank torchrun (gloo, CPU) training job with the ckpt callback, and an
object-store tier (a ``file://`` directory; ``--object-store s3://...`` with
``AWS_ENDPOINT_URL`` for a real one).

With the predictor the job runs as two simulated nodes (one torchrun agent and one rank
each, their own ``CKPT_GUARD_NODE``, shared memory and disk) with ``peers=1``: the alarm
for node1 makes every rank save urgently, and node1's snapshot is replicated into
node0's memory ahead of anything else. At the failure node1's processes are SIGKILLed
and its shared memory and disk wiped; a replacement node (node2) joins the job and its
rank reads node1's shard from node0's replica. Periodic-only is today's job: one node
of 2 ranks, lost whole, ``ckpt restore`` fetching the newest checkpoint from the object
store onto a "new node". The summary puts the two restores side by side.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One scenario's processes, files and timeline."""

    name: str
    dir: Path
    events: dict[str, float] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, what: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.dir / f"{what}.log", "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})},
                             start_new_session=True)
        self.procs.append(p)
        return p

    def log(self, what: str) -> str:
        path = self.dir / f"{what}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: torchrun starts each worker in a
    session of its own, so killing torchrun's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def steps_done(timeline: Path) -> list[dict]:
    if not timeline.exists():
        return []
    return [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]


def torchrun(run: Run, args: argparse.Namespace, root: Path, memory_dir: Path, *extra: str, env=None,
             tag: str = "train", node: tuple[int, str, int] | None = None) -> subprocess.Popen:
    """The training job: one torchrun of 2 ranks (one node); or, with ``node`` (index, name,
    rendezvous port), that simulated node's agent, one rank of a 2-node job with peer
    replicas (node 0 hosts the rendezvous; an agent started again with index 1 and a new
    name is a replacement node joining the same job)."""
    launch = ["--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    env = {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    if node is not None:
        i, name, port = node
        launch = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=demo-{port}", f"--rdzv-conf=is_host={int(i == 0)}",
                  "--monitor-interval=0.5"]
        extra = (*extra, "--peers", "1")
        env.update(CKPT_GUARD_NODE=name, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # a node can be replaced
    cmd = [PY, "-m", "torch.distributed.run", *launch,
           str(REPO / "examples" / "train_torchrun.py"), "--root", str(root),
           "--object-store", args.object_store_for(run),
           "--memory-dir", str(memory_dir), "--steps", str(args.steps), "--every", str(args.every),
           "--step-time", str(args.step_time), "--timeline", str(run.dir / "timeline.jsonl"), *extra]
    return run.start(tag, cmd, env)


def predictor_and_agent(run: Run, args: argparse.Namespace, node: str) -> tuple[list[str], dict]:
    """A predictor service and a node agent simulating ``node``'s 8 GPUs, a PCIe link
    failure of gpu2 scheduled; returns the training job's extra arguments and environment."""
    agent_tok, job_tok = secrets.token_hex(16), secrets.token_hex(16)
    tokens = run.dir / "tokens"
    tokens.write_text(f"agent {agent_tok}\njob {job_tok}\n")
    tokens.chmod(0o600)
    (run.dir / "agent.token").write_text(agent_tok)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the agent's model clock runs --time-scale times faster than the wall clock: its
    # samples are hours ahead by the end, which serve refuses beyond --max-ahead
    run.start("predictor", [PY, "-m", "predictor.cli", "serve", "--port", str(port), "--tokens", str(tokens),
                            "--max-ahead", str(7 * 86400)], {"PYTHONPATH": str(REPO)})
    say(f"{run.name}: predictor serving on {url}")
    run.start("agent", [PY, "-m", "agents.cli", "run", "--source", "sim", "--predictor", url,
                        "--token-file", str(run.dir / "agent.token"), "--node-name", node,
                        "--interval", str(args.interval), "--time-scale", str(args.time_scale), "--model-clock",
                        "--fail", f"{node}/gpu2/pcie@+{args.fail_after}s", "--metrics-port", "0",
                        "--spool-dir", str(run.dir / "spool")], {"PYTHONPATH": str(REPO)})
    say(f"{run.name}: node agent simulating {node}'s 8 GPUs; a PCIe link failure of gpu2 is due in "
        f"{args.fail_after:.0f} s (precursors {args.time_scale:g}x faster than real)")
    return ["--predictor", url, "--elevated-every", str(max(1, args.every // 4))], {"CKPT_GUARD_JOB_TOKEN": job_tok}


def scenario(args: argparse.Namespace, name: str, with_predictor: bool, fail_at_step: int | None = None) -> Run:
    """With the predictor: two simulated nodes (node0, node1; one rank each, peer replicas),
    node1 at risk and lost, a replacement node2 restoring node1's shard from node0's
    memory. Periodic-only: today's job without either, one node of 2 ranks, lost whole,
    restored from the object store onto a new node. ``fail_at_step``: the node fails at
    that step (the step the other run failed at: the same work at risk) rather than at
    ``--fail-after``."""
    run = Run(name, Path(args.workdir) / name)
    run.dir.mkdir(parents=True, exist_ok=True)
    nodes = ["node0", "node1", "node2"] if with_predictor else ["node-a"]
    memory = {n: Path(tempfile.mkdtemp(prefix=f"ckpt-demo-{name}-{n}-", dir="/dev/shm")) for n in nodes}
    args.memory_dirs.extend(memory.values())
    lost = nodes[1] if with_predictor else nodes[0]
    try:
        run.events["start"] = time.time()
        if with_predictor:
            extra, env = predictor_and_agent(run, args, lost)
            port = free_port()
            agents = {n: torchrun(run, args, run.dir / n, memory[n], *extra, env=env, node=(i, n, port),
                                  tag="train" if i == 0 else f"train-{n}") for i, n in enumerate(nodes[:2])}
            say(f"{name}: training started (2 simulated nodes of one rank each, peers=1, a step every "
                f"{args.step_time:g} s, periodic checkpoint every {args.every} steps, off-node tier "
                f"{args.object_store_for(run)})")
        else:
            agents = {lost: torchrun(run, args, run.dir / lost, memory[lost])}
            say(f"{name}: training started (2 ranks, a step every {args.step_time:g} s, periodic checkpoint every "
                f"{args.every} steps, off-node tier {args.object_store_for(run)})")
        wait_for_failure(run, args, agents[lost], with_predictor, fail_at_step)
        # The GPU fails: the node's processes die with it, its memory and local disk are gone.
        kill_tree(agents[lost].pid)
        agents[lost].wait()
        run.events["failure"] = time.time()
        done = steps_done(run.dir / "timeline.jsonl")
        run.events["last_step"] = done[-1]["step"] if done else 0
        shutil.rmtree(memory[lost], ignore_errors=True)
        shutil.rmtree(run.dir / lost, ignore_errors=True)
        say(f"{name}: GPU FAILURE on {lost} at step {run.events['last_step']}: its processes killed, node lost "
            "(memory and disk wiped)")
        run.events["restart"] = time.time()
        n_before = len(steps_done(run.dir / "timeline.jsonl"))
        if with_predictor:  # a replacement node joins the job; its rank reads node1's shard from node0
            torchrun(run, args, run.dir / nodes[2], memory[nodes[2]], *extra, env=env, node=(1, nodes[2], port),
                     tag="replacement")
            peer_restore(run)
        else:
            object_store_restore(run, args, memory[lost])
        first = resumed(run, n_before)
        run.events["first_resumed_step"] = first["t"]
        say(f"{name}: training resumed at step {first['step']} "
            f"({first['t'] - run.events['failure']:.1f} s after the failure)")
        job = run.procs[-1]  # the replacement node's agent, or the resumed job
        while len(steps_done(run.dir / "timeline.jsonl")) < n_before + args.resume_steps and job.poll() is None:
            time.sleep(0.2)
        collect_alarm(run)
        return run
    finally:
        run.stop_all()
        for d in memory.values():
            shutil.rmtree(d, ignore_errors=True)


def failure_gate(run: Run, with_predictor: bool, store_steps: list[int], late: bool) -> str | None:
    """What the story still needs before the node may fail, or None once it may fail.

    The failure is scheduled by the wall clock but checkpoints come by training steps: on a
    slow machine the job may not have saved anything yet when the clock says "fail".
    With the predictor the node fails once the urgent checkpoint is durable off-node (or,
    ``late`` — the alarm never came — once any checkpoint is); periodic-only once a
    periodic checkpoint is in the object store, else there would be nothing to restore."""
    if with_predictor and "urgent_durable" not in run.events and not late:
        return "the urgent checkpoint to be durable off-node"
    if not store_steps and not (with_predictor and "urgent_durable" in run.events):
        return "a checkpoint in the object store"
    return None


@functools.lru_cache(maxsize=None)
def object_store(url: str):
    """The object-store tier at ``url``, opened once (the demo only lists it)."""
    from ckpt.tiers.object_store import ObjectStoreTier  # the job's own view of what is committed

    return ObjectStoreTier(url, concurrency=1)


def object_store_steps(run: Run, args: argparse.Namespace) -> list[int]:
    """Steps committed in this run's object-store tier (none while it does not exist yet)."""
    try:
        return [i.id.step for i in object_store(args.object_store_for(run)).list() if not i.error]
    except (OSError, ValueError):
        return []


def wait_for_failure(run: Run, args: argparse.Namespace, job: subprocess.Popen, with_predictor: bool,
                     fail_at_step: int | None = None) -> None:
    """Train until the GPU's scheduled failure (``--fail-after``, or ``fail_at_step``) and,
    past it, until the job has what the story needs (``failure_gate``), printing the events
    as they happen. A job that dies, or trains no step for ``--stall-timeout`` s, ends the
    demo with the reason: that is a real failure; a slow machine only delays the failure."""
    t0 = run.events["start"]
    t_fail, last, waiting, store_steps, polled = t0 + args.fail_after, -1, None, [], 0.0
    progress = (-1, time.time())  # the newest step seen, and when
    while True:
        time.sleep(0.5)
        for event, text in collect_alarm(run):  # as they happen, not only in the summary
            say(f"{run.name}: {text} ({run.events[event] - t0:.1f} s)")
        done = steps_done(run.dir / "timeline.jsonl")
        if done and done[-1]["step"] // 25 != last // 25:
            last = done[-1]["step"]
            say(f"{run.name}: step {last}")
        now = time.time()
        step = done[-1]["step"] if done else 0
        if step != progress[0]:
            progress = (step, now)
        if job.poll() is not None:
            raise SystemExit(f"{run.name}: the training job exited ({job.returncode}) before the failure; see the logs "
                             f"in {run.dir}")
        if now - progress[1] > args.stall_timeout:
            raise SystemExit(f"{run.name}: the job trained no step for {args.stall_timeout:.0f} s (at step {step}); "
                             f"see the logs in {run.dir}")
        if (step < fail_at_step) if fail_at_step is not None else now < t_fail:
            continue
        if now - polled > 2:
            store_steps, polled = object_store_steps(run, args), now
        late = now > t_fail + args.alarm_grace
        need = failure_gate(run, with_predictor, store_steps, late)
        if need is None:
            break
        if need != waiting:
            waiting = need
            say(f"{run.name}: the GPU's failure is due ({now - t0:.0f} s) but the job is at step {step}: the node "
                "fails once there is " + need)
    if with_predictor and "urgent_durable" not in run.events:
        say(f"{run.name}: NO URGENT CHECKPOINT: the predictor's alarm did not reach the job within "
            f"{args.alarm_grace:.0f} s of the failure; the node fails anyway (restore from the newest periodic one)")


def resumed(run: Run, n_before: int) -> dict:
    """The first step trained from the restored checkpoint (a surviving rank may log one
    more step of the old incarnation before it notices the loss)."""
    deadline, first = time.time() + 300, run.events["restored_step"] + 1
    while True:
        ended = run.procs[-1].poll() is not None
        after = [d for d in steps_done(run.dir / "timeline.jsonl")[n_before:] if d["step"] == first]
        if after:
            return after[0]
        if ended or time.time() > deadline:
            raise SystemExit(f"resumed training did not run; see the logs in {run.dir}")
        time.sleep(0.2)


def peer_restore(run: Run) -> None:
    """Wait until the replacement node's rank has restored; its log says from where."""
    deadline = time.time() + 300
    while not collect_peer_restore(run):
        if time.time() > deadline or run.procs[-1].poll() is not None:
            raise SystemExit(f"the replacement node did not restore from a peer; see {run.dir / 'replacement.log'}")
        time.sleep(0.2)
    say(f"{run.name}: the replacement node restored node1's shard of step {run.events['restored_step']} from "
        f"{run.events['restore_from']} (its restore() took {run.events['restore_s']:.2f} s)")


def collect_peer_restore(run: Run) -> bool:
    """The replacement node's restore from a peer's replica, from its log: the fetch, then
    the whole ``restore()`` (agreeing on the step, fetching, loading)."""
    log = run.log("replacement")
    stamp = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) rank\d+ "
    fetch = re.search(r"rank (\d+) restored its shard of step (\d+) from rank \d+'s replica \(node (\S+)\)", log)
    done = fetch and re.search(stamp + rf"rank {fetch.group(1)} restored step {fetch.group(2)} .* in ([\d.]+) s", log)
    if done:
        run.events.update(restore_done=_t(done.group(1)), restored_step=int(fetch.group(2)),
                          restore_from=f"a peer replica in {fetch.group(3)}'s memory", restore_s=float(done.group(2)))
    return bool(done)


def ckpt_restore(run: Run, args: argparse.Namespace, dest: Path) -> dict:
    """``ckpt restore`` of the newest checkpoint in the object store into ``dest``: its --json answer."""
    restored = subprocess.run([PY, "-m", "ckpt.cli", "restore", args.object_store_for(run), "--to",
                               str(dest), "--json"], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    if restored.returncode != 0:
        raise SystemExit(f"ckpt restore failed: {restored.stdout.strip()} {restored.stderr[-2000:]}")  # JSON: stdout
    return json.loads(restored.stdout)


def store_rereads(run: Run, args: argparse.Namespace, reads: int = 5) -> list[float]:
    """The object-store restore again, ``reads`` times, each a process of its own into a fresh
    directory: on a busy machine one read is no figure to quote, its spread is."""
    times = []
    for i in range(reads):
        dest, t0 = run.dir / f"reread-{i}", time.monotonic()
        ckpt_restore(run, args, dest)
        times.append(time.monotonic() - t0)
        shutil.rmtree(dest, ignore_errors=True)
    return times


def object_store_restore(run: Run, args: argparse.Namespace, memory_dir: Path) -> None:
    """A new node: ``ckpt restore`` fetches the newest checkpoint from the object store, then the job resumes."""
    info = ckpt_restore(run, args, run.dir / "node-b")
    run.events.update(restored_step=info["step"], restore_done=time.time(), restore_from="the object store")
    run.events["restore_s"] = run.events["restore_done"] - run.events["restart"]
    say(f"{run.name}: ckpt restore → step {info['step']} from the object store onto a new node "
        f"({run.events['restore_s']:.1f} s)")
    torchrun(run, args, run.dir / "node-b", memory_dir, "--steps", str(info["step"] + args.resume_steps),
             tag="resume")


def collect_alarm(run: Run) -> list[tuple[str, str]]:
    """Alarm and urgent-save times from the training log (the job's own record); returns
    the events seen for the first time, with a line to print for each."""
    log = run.log("train")
    stamp = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) rank0 "
    new = []
    if "alarm" not in run.events and (m := re.search(stamp + r"predictor: node (\S+) at risk", log)):
        run.events["alarm"] = _t(m.group(1))
        new.append(("alarm", f"PREDICTOR ALARM: GPU failure predicted on node {m.group(2)}"))
    if "urgent_durable" not in run.events and (
            m := re.search(stamp + r"urgent checkpoint of step (\d+) durable in every tier ([\d.]+) s after save\(\) "
                                   r"\(([^)]*)\)", log)):
        run.events["urgent_durable"] = _t(m.group(1))
        run.events["urgent_step"] = int(m.group(2))
        off_node = [t for t in m.group(4).split(", ") if not t.startswith("disk")]
        new.append(("urgent_durable", f"urgent checkpoint of step {m.group(2)} durable off-node "
                                      f"({', '.join(off_node)} after save())"))
    return new


def _t(stamp: str) -> float:
    return time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp.split(",")[1]) / 1000


def report(runs: list[Run], args: argparse.Namespace) -> dict:
    out = {}
    print()
    for run in runs:
        e = run.events
        def rel(k: str, e: dict = e) -> str:
            return f"{e[k] - e['start']:7.1f} s" if k in e else "      —  "
        lost = e["last_step"] - e["restored_step"]
        print(f"== {run.name}")
        print(f"  {rel('alarm')}  predictor alarm: GPU failure predicted on the node")
        print(f"  {rel('urgent_durable')}  urgent checkpoint durable off-node"
              + (f" (step {e['urgent_step']})" if "urgent_step" in e else ""))
        print(f"  {rel('failure')}  GPU failure: node lost at step {e['last_step']}")
        print(f"  {rel('restore_done')}  lost node's state restored from {e['restore_from']}: step "
              f"{e['restored_step']} ({e['restore_s']:.2f} s)")
        print(f"  {rel('first_resumed_step')}  first resumed step")
        print(f"  work lost: {lost} steps ({lost * args.step_time:.0f} s of training); "
              f"failure to first resumed step: {e['first_resumed_step'] - e['failure']:.1f} s\n")
        out[run.name] = {**e, "lost_steps": lost}
    if len(runs) == 2:
        peer, store = (r.events for r in runs)
        again = sorted(store["reread_s"])
        print(f"restoring the lost node's shard: {peer['restore_s']:.2f} s from a peer's memory (inside the "
              f"replacement's restore(); one read, at the restart) vs {store['restore_s']:.2f} s from the object "
              f"store (`ckpt restore`, a process of its own, start-up included; read {len(again)} times more after "
              f"the run: median {statistics.median(again):.2f} s, {again[0]:.2f}-{again[-1]:.2f} s)")
    return out


def leaves_no_shm(args: argparse.Namespace) -> None:
    """Exit 1 naming what the demo left in /dev/shm: a node's memory dir, or a checkpoint namespace
    of one of its roots (``ckpt restore`` and the resumed jobs use the default memory dir's rules)."""
    from ckpt.tiers.memory.owners import left_behind  # torch-free: the engine's own rule

    left = sorted({str(d) for d in args.memory_dirs if d.exists()}
                  | {str(p) for p in left_behind("/dev/shm", under=Path(args.workdir))})
    if left:
        raise SystemExit(f"the demo left {len(left)} shared-memory dir(s) in /dev/shm: {', '.join(left)}")
    say("shared memory: nothing of the demo's left in /dev/shm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where logs and checkpoints go (default: a new temp dir)")
    ap.add_argument("--object-store", default=None, help="fsspec URL prefix of the off-node tier (default: file://WORKDIR)")
    ap.add_argument("--fail-after", type=float, default=190.0,
                    help="wall seconds until the GPU fails (about step 345: 105 steps past a periodic checkpoint)")
    ap.add_argument("--alarm-grace", type=float, default=240.0,
                    help="with the predictor: seconds past the scheduled failure to wait for the urgent checkpoint "
                         "before failing the node without it (the demo then exits 1)")
    ap.add_argument("--stall-timeout", type=float, default=600.0,
                    help="give up when the job trains no step for this long (the hang guard: a slow machine only "
                         "delays the failure until the job has the checkpoint the story restores)")
    ap.add_argument("--time-scale", type=float, default=30.0, help="how much faster the simulated precursors run")
    ap.add_argument("--interval", type=float, default=2.0, help="agent sampling interval, wall seconds")
    ap.add_argument("--step-time", type=float, default=0.5)
    ap.add_argument("--every", type=int, default=120, help="periodic checkpoint interval, steps")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--resume-steps", type=int, default=10, help="steps to train after resuming")
    ap.add_argument("--only", choices=["predictor", "periodic"], default=None)
    ap.add_argument("--json", default=None, help="write the timelines as JSON here")
    args = ap.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="ckpt-guard-demo-", dir="/var/tmp")
    args.memory_dirs = []
    store = (args.object_store or "file://" + args.workdir).rstrip("/")
    args.object_store_for = lambda run: f"{store}/{run.name}/objstore"
    say(f"work directory {args.workdir}")
    runs = []
    if args.only != "periodic":
        runs.append(scenario(args, "with-predictor", True))
    if args.only != "predictor":
        same_step = runs[0].events["last_step"] if runs else None  # the same work at risk in both runs
        runs.append(scenario(args, "periodic-only", False, same_step))
        runs[-1].events["reread_s"] = store_rereads(runs[-1], args)
    out = report(runs, args)
    leaves_no_shm(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if any(r.name == "with-predictor" and "urgent_durable" not in r.events for r in runs):
        raise SystemExit("the predictor's alarm never made the job save urgently: see the logs in "
                         f"{args.workdir}/with-predictor")


if __name__ == "__main__":
    main()
