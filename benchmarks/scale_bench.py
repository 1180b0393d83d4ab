"""Cost as the job grows: our real control-plane code against stand-in ranks (no training).

    python benchmarks/scale_bench.py [--max-ranks 16384] [--json OUT] [--plot cost.png]

Each component runs in a fresh process, its sizes in ascending order (peak RSS: the largest N so
far), against one real TCPStore server listening on 127.0.0.1 (``scale_standins.py``). Stand-in
ranks share a pool of real store clients (``--clients``, served in turn by one thread) behind a
proxy that counts every store operation and the keys it names; the workers a node launcher
"starts" are stand-ins for processes (always running), so what is measured is the launchers',
the workers' and the commit protocol's own store traffic:

- `steady_step`: one step (``BEAT_S``) after three (the launchers' warm-up, not counted): each
  worker's beat and step-key traffic, ``BEAT_S / POLL_S`` ticks of every node launcher
  (``NodeLauncher.poll``) and of the job launcher (``Job.tick``);
- `launch`: round 0: ``Job(...)`` publishes it, every node launcher starts its stand-in workers;
- `membership_round`: a member exits: its node reports it, the job launcher publishes the next
  round, every node launcher follows it;
- `commit`: every rank's ``Committer.commit`` of one step (one volume per node of 8, a tier that
  keeps nothing: the protocol's own cost), clean-up included, each rank with a store connection
  of its own, 512 ranks a client process, the store in a process of its own (``scale_commit.py``);
- `ckpt_ls_*`, `verify_manifests_*`: ``ckpt ls`` and ``ckpt verify --manifests-only`` of an
  N-shard checkpoint (a 70B model's manifests) on disk and in the S3 test server
  (``scale_listing.py``); `predictor_score`: the predictor scoring N/8 nodes x 8 GPUs
  (``scale_predictor.py``); `steady_step_clients`: `steady_step` with a real store connection
  per rank and per node launcher, in client processes (``scale_clients.py``).

Every value is signed under a job secret made for the benchmark (``ckpt.control``, as the
launcher's jobs do).

Seconds are wall seconds of the whole component in one process on this machine (all store round
trips serial through loopback), so they are an upper bound of the control plane's serial work,
not of a real job's latency; ``cpu_s`` (the store components) is that process's CPU time, the
launchers' and the store server thread's, which the other processes of a busy machine do not
inflate as they do the wall seconds; ``store_ops`` and ``store_keys`` are the shapes the targets
are in.
The fitted exponent of each (log-log slope between 1,024 and the largest N) is printed and saved.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository first
from benchmarks import scale_clients, scale_commit, scale_listing, scale_plan, scale_predictor  # noqa: E402
from benchmarks.harness import run_meta, write_json  # noqa: E402
from benchmarks.scale_standins import CLOCK, PER_NODE, Counting, ctl, job_of, worker_step  # noqa: E402
from benchmarks.scale_standins import pool as store_pool  # noqa: E402

STORE_COMPONENTS = ("steady_step", "launch", "membership_round")
# components without the job's store, in their own modules: N -> the row (peak RSS added here)
OTHER = {**scale_listing.rows(), **scale_plan.rows(), "predictor_score": scale_predictor.run_one,
         "steady_step_clients": scale_clients.run_one, "commit": scale_commit.run_one}
COMPONENTS = STORE_COMPONENTS + ("commit",) + tuple(c for c in OTHER if c != "commit")
SIZES = (64, 256, 1024, 4096, 16384)
# the default run's largest N where a size costs minutes here (the default run fits in 15 min;
# `--max-for` raises them: docs/scale.md has the 16,384-rank command)
DEFAULT_MAX_FOR = {"commit": 1024, "steady_step_clients": 1024, "verify_manifests_s3": 256}


def _steady_step(n: int, pool, job, nodes, workers, step: int = 1) -> None:
    """One ``BEAT_S`` of steady state: every worker's beat thread (a beat, a look for a newer round)
    and one step (a look before it, its step key after), then the launchers' ticks of that time."""
    from ckpt.inprocess import node
    from ckpt.inprocess.runner import BEAT_S
    for w in range(n):
        worker_step(workers[w], w, step)
    for _ in range(round(BEAT_S / node.POLL_S)):
        job.tick()
        for nl in nodes[1:]:
            nl.poll()
        CLOCK.now += node.POLL_S


def run_one(component: str, n: int, clients: int) -> dict:
    """One component at ``n`` ranks, in this process: its row."""
    if component in OTHER:
        return {**OTHER[component](n), "nodes": max(1, n // PER_NODE),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    from ckpt.inprocess import launch  # imported before the clock starts
    server, pool = store_pool(n, clients)
    job = nodes = None
    if component == "steady_step":
        from ckpt.inprocess import node
        CLOCK.now = time.monotonic()
        node.time = launch.time = CLOCK
    if component in ("steady_step", "membership_round"):
        job, nodes = job_of(n, pool)
    workers = [ctl(pool[w % len(pool)]) for w in range(n)] if component == "steady_step" else []
    for step in range(1, 4) if component == "steady_step" else ():  # the launchers past their warm-up
        _steady_step(n, pool, job, nodes, workers, step)
    Counting.ops = Counting.keys = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    if component == "launch":
        job, nodes = job_of(n, pool)
    elif component == "steady_step":
        _steady_step(n, pool, job, nodes, workers, 4)
    elif component == "membership_round":
        victim = nodes[-1]
        w = next(iter(victim.procs))
        victim.procs[w].code = 1
        victim.poll()  # its node reports the exit
        while job.round == 0:
            job.tick()  # the job launcher publishes the next round
        for nl in nodes[1:]:
            nl.poll()  # every node follows it
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    if job is not None:
        job.lifelines.close()
    del server
    return {"component": component, "ranks": n, "nodes": max(1, n // PER_NODE), "seconds": seconds, "cpu_s": cpu_s,
            "store_ops": Counting.ops, "store_keys": Counting.keys,
            "ops_per_rank": Counting.ops / n, "server_s_per_op": seconds / max(1, Counting.ops),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "clients": len(pool)}


def exponent(rows: list[dict], component: str, field: str, low: int = 1024) -> float | None:
    """The log-log slope of ``field`` against N from ``low`` up (None with fewer than two sizes)."""
    pts = [(r["ranks"], r[field]) for r in rows
           if r["component"] == component and r["ranks"] >= low and r.get(field, 0) > 0]
    if len(pts) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in pts], [math.log(y) for _, y in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for c in sorted({r["component"] for r in rows}):
        pts = sorted((r["ranks"], r["seconds"], r["store_ops"]) for r in rows if r["component"] == c)
        axes[0].loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=c)
        axes[1].loglog([p[0] for p in pts], [p[2] for p in pts], "o-", label=c)
    for ax, what in zip(axes, ("seconds (one process, serial)", "store operations")):
        ax.set_xlabel("ranks N")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT")
    ap.add_argument("--max-ranks", type=int, default=4096, help="largest N (default %(default)s; 16384: the full run)")
    ap.add_argument("--components", default=",".join(COMPONENTS))
    ap.add_argument("--commit-max", type=int, default=None, help="largest N for `commit` (a connection per rank)")
    ap.add_argument("--max-for", default="", metavar="C=N,...",
                    help=f"largest N for these components (besides {DEFAULT_MAX_FOR})")
    ap.add_argument("--clients", type=int, default=64, help="real store clients the stand-in ranks share")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per component; the sizes not reached are listed")
    ap.add_argument("--plot", metavar="PNG")
    ap.add_argument("--one", nargs=2, metavar=("COMPONENT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        for n in map(int, args.one[1].split(",")):  # ascending: the peak RSS so far is the largest N's
            print(json.dumps(run_one(args.one[0], n, args.clients)), flush=True)
        return
    meta = run_meta(clients=args.clients, per_node=PER_NODE)
    rows, skipped = [], []
    largest = {**DEFAULT_MAX_FOR, **({"commit": args.commit_max} if args.commit_max else {}),
               **{c: int(n) for c, n in (kv.split("=") for kv in args.max_for.split(",") if kv)}}
    for c in args.components.split(","):  # one process per component (torch's import is slow on a busy machine)
        sizes = [s for s in SIZES if s <= min(largest.get(c, args.max_ranks), args.max_ranks)]
        proc = subprocess.Popen([sys.executable, __file__, "--one", c, ",".join(map(str, sizes)), "--clients",
                                 str(args.clients)], stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        deadline = time.monotonic() + args.timeout_s
        # the whole group: a component's own children (moto's server, client processes) go with it
        timer = threading.Timer(args.timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:
            row = json.loads(line)
            rows.append(row)
            cpu = f"  {row['cpu_s']:8.3f} s CPU" if "cpu_s" in row else ""
            print(f"{c:18s} N={row['ranks']:6d}  {row['seconds']:9.3f} s{cpu}  {row['store_ops']:9d} ops  "
                  f"{row['store_keys']:10d} keys  {row['ops_per_rank']:7.2f} ops/rank  {row['peak_rss_mb']:6.0f} MB",
                  flush=True)
        timer.cancel()
        done = {r["ranks"] for r in rows if r["component"] == c}
        if proc.wait() or len(done) < len(sizes):
            why = f"over {args.timeout_s:.0f} s" if time.monotonic() >= deadline else f"exit {proc.returncode}"
            skipped += [f"{c} at N={n}: {why}" for n in sizes if n not in done]
            print(f"{c:18s} not reached: N={[n for n in sizes if n not in done]} ({why})", flush=True)
    fields = ("seconds", "cpu_s", "store_ops", "store_keys")
    fits = {c: {f: exponent(rows, c, f) for f in fields} for c in sorted({r["component"] for r in rows})}
    fits_256 = {c: {f: exponent(rows, c, f, 256) for f in fields} for c in fits}
    for c, f in fits.items():
        print(f"{c:18s} exponent from N=1024: " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -"
                                                             for k, v in f.items()))
    if args.plot:
        plot(rows, args.plot)
    largest_n = {c: max(r["ranks"] for r in rows if r["component"] == c) for c in fits}
    write_json(args.json, meta, rows, exponents=fits, exponents_from_256=fits_256, skipped=skipped,
               largest_n=largest_n, short_of_16384={c: why for c, why in scale_listing.SHORT_OF_16384.items()
                                                    if largest_n.get(c, SIZES[-1]) < SIZES[-1]})


if __name__ == "__main__":
    main()
