"""The demo's story read from its jobs' own records (``examples/demo.py``): the alarm and the
urgent save (their log lines), when the node may fail (``failure_gate``), where the lost node's
state came from and the first resumed step (the restore lines and rank 0's timeline)."""
from __future__ import annotations

import argparse
import functools
import re
import subprocess
import time

from examples.demo_procs import STAMP, Run, log_time, say


def collect_alarm(run: Run) -> list[tuple[str, str]]:
    """Alarm and urgent-save times from the training logs (the job's own record; the earliest
    rank's line); returns the events seen for the first time, with a line to print for each."""
    logs, new = run.logs(), []
    alarms = re.findall(STAMP + r"predictor: node (\S+) at risk", logs)
    if "alarm" not in run.events and alarms:
        stamp, node = min(alarms, key=lambda m: log_time(m[0]))
        run.events["alarm"] = log_time(stamp)
        new.append(("alarm", f"PREDICTOR ALARM: GPU failure predicted on node {node}"))
    durable = re.findall(STAMP + r"urgent checkpoint of step (\d+) durable in every tier [\d.]+ s after save\(\) "
                                 r"\(([^)]*)\)", logs)
    if "urgent_durable" not in run.events and durable:
        stamp, step, tiers = min(durable, key=lambda m: log_time(m[0]))
        run.events.update(urgent_durable=log_time(stamp), urgent_step=int(step))
        off_node = [t for t in tiers.split(", ") if not t.startswith("disk")]
        new.append(("urgent_durable", f"urgent checkpoint of step {step} durable off-node "
                                      f"({', '.join(off_node)} after save())"))
    return new


def collect_restore(run: Run, log: str, rank: int, after: float) -> bool:
    """Rank ``rank``'s restore logged after ``after`` (the failure) in ``log``: the step, where
    each shard came from (``shard K from TIER``; a peer replica named with its node) and how
    long its ``restore()`` took."""
    for stamp, step, sources, seconds in re.findall(STAMP + rf"rank {rank} restored step (\d+) \((.*?)\) in ([\d.]+) s",
                                                    log):
        if log_time(stamp) < after - 1.0:  # its start, before the failure
            continue
        peer = re.search(rf"rank {rank} restored its shard of step {step} from rank \d+'s replica \(node (\S+)\)", log)
        tiers = set(re.findall(rf"shard {rank} from ([\w-]+)", sources))
        where = f"a peer replica in {peer.group(1)}'s memory" if peer else \
            "the object store" if tiers == {"object"} else ", ".join(sorted(tiers)) or sources
        run.events.update(restore_done=log_time(stamp), restored_step=int(step), restore_from=where,
                          restore_sources=sources, restore_s=float(seconds))
        return True
    return False


def wait_restore(run: Run, node: str, rank: int, job: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until ``rank`` on ``node`` logs its restore after the failure (``collect_restore``); a
    job that ends first, or a restore that takes past ``timeout`` (the hang guard), ends the demo."""
    deadline = time.time() + timeout
    while not collect_restore(run, run.log(node), rank, run.events["failure"]):
        if time.time() > deadline or job.poll() is not None:
            raise SystemExit(f"{run.name}: rank {rank} on {node} did not restore; see the logs in {run.dir}")
        time.sleep(0.1)


def failure_gate(run: Run, with_predictor: bool, store_steps: list[int], late: bool, step: int,
                 every: int) -> str | None:
    """What the story still needs before the node may fail, or None once it may fail.

    The failure is scheduled by the wall clock but checkpoints come by training steps: on a
    slow machine the job may not have saved anything yet when the clock says "fail". Both
    runs fail at the same step, past the first periodic checkpoint (``every``: the relaunch
    restores from it). With the predictor the node fails once the urgent checkpoint is durable
    off-node (or, ``late`` — the alarm never came — once any checkpoint is); the relaunch once
    a periodic checkpoint is in the object store, else there would be nothing to restore."""
    if step <= every:
        return f"a periodic checkpoint behind it (step {every}: the relaunch restores from one)"
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
        time.sleep(0.2)
        for event, text in collect_alarm(run):  # as they happen, not only in the summary
            say(f"{run.name}: {text} ({run.events[event] - t0:.1f} s)")
        done = run.timeline()
        if done and done[-1]["step"] // 50 != last // 50:
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
        need = failure_gate(run, with_predictor, store_steps, now > t_fail + args.alarm_grace, step, args.every)
        if need is None:
            break
        if need != waiting:
            waiting = need
            say(f"{run.name}: the GPU's failure is due ({now - t0:.0f} s) but the job is at step {step}: the node "
                "fails once there is " + need)
    if with_predictor and "urgent_durable" not in run.events:
        say(f"{run.name}: NO URGENT CHECKPOINT: the predictor's alarm did not reach the job within "
            f"{args.alarm_grace:.0f} s of the failure; the node fails anyway")


def first_resumed(run: Run, job: subprocess.Popen, after: float, min_round: int = 0, timeout: float = 300.0) -> dict:
    """The first step rank 0 completed after the failure from the restored checkpoint, in round
    ``min_round`` or later (a survivor may log the step it was finishing as the node went, in
    the old round: that one is not it)."""
    deadline = time.time() + timeout
    while True:
        restored = run.events.get("restored_step")
        later = [d for d in run.timeline() if d["t"] > after and d.get("round", 0) >= min_round
                 and restored is not None and d["step"] == restored + 1]
        if later:
            return later[0]
        if job.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{run.name}: training did not resume; see the logs in {run.dir}")
        time.sleep(0.1)
