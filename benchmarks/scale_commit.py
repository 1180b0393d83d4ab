"""scale_bench's `commit` row: every rank's real ``Committer.commit`` of one step, clean-up included.

What is real: the commit protocol (``ckpt.save.commit.Committer``, unchanged, signed under the
benchmark's job secret as under the launcher), the job's store (a ``TCPStore`` server on
127.0.0.1, in a process of its own as in a job, where the job launcher hosts it, at a higher
priority than the ranks: ``STORE_PRIORITY``) and one
``TCPStore`` connection per rank, as each rank's drain thread holds in a job. What stands in: the
ranks are threads, ``PER_PROC`` of them in each of N / ``PER_PROC`` client processes (each raises
its soft fd limit to the hard one with the launcher's ``raise_fd_limit``), with nothing saved: the
tier keeps nothing (``Tier``), so the seconds are the protocol's own. One volume per node of 8
(local disks: N/8 leaders).

A waiting rank's thread sleeps in the store (a blocking ``wait``), so N threads cost no CPU
while they wait; but the ranks of one process share its GIL (2,048 ranks in one process took
25 s at N = 2,048, 256 in each of 8 processes 6.9 s), hence ``PER_PROC`` ranks a process. The
processes start, connect (in the ranks' threads, ``CONNECTING`` at once: the handshakes overlap) and build their
committers first; the seconds run from the moment every one is told to commit until every
rank has returned.

What the row also says, to tell the protocol's cost from this machine's crowding: the store
process's CPU seconds (``server_cpu_s``) and its seconds runnable but waiting for a core
(``server_runq_s``, from ``/proc/<pid>/task/*/schedstat``) in that window, the client processes'
CPU seconds, the machine's runnable threads (``/proc/loadavg``, sampled every 50 ms), and each
phase of the protocol as the ranks' store calls saw it (``phases``: per operation and key, the
first start and last end in seconds from the start, their count and mean latency).
``python benchmarks/scale_commit.py --ranks N`` runs one row with the placement as options.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import scale_standins as si  # noqa: E402

PER_PROC = 512
# the client processes' GIL switch interval: a rank's thread keeps the GIL until it blocks in the store
# (every store call lets it go), instead of every waiting thread waking each 5 ms to ask for it
SWITCH_S = 1.0
# the store's process this much nicer than the benchmark's (floored at -20): in a job it has its
# host's cores, not a share among 16,384 rank threads and the machine's other work
STORE_PRIORITY = 15
CONNECTING = 16  # connections a process makes at once: 16,384 at once overflow the server's listen backlog


class Tier:
    """A durable tier that keeps nothing: the commit protocol's own cost, not a disk's."""

    name, volume = "bench", "local"

    def commit(self, ckpt_id, manifest) -> None:
        pass

    def prune(self, keep, pinned):
        return []

    def list(self):
        return []


class Timed:
    """A rank's store client that notes each call: (operation, the protocol's key kind, start, end)."""

    def __init__(self, store, log: list) -> None:
        self._s, self._log, self.port = store, log, store.port

    def __getattr__(self, op: str):
        call = getattr(self._s, op)

        def timed(keys, *rest):
            t0 = time.time()
            try:
                return call(keys, *rest)
            finally:  # keys: "bench/0.1/<kind>[/rank]", one or a list
                self._log.append((op, (keys if isinstance(keys, str) else keys[0]).split("/")[2], t0, time.time()))
        return timed


def _place(nice: int | None, cpus: str | None, switch_s: float | None = None) -> None:
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:  # not allowed a lower value here: the row says the nice it ran at
            pass
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranks(conn, port: int, n: int, ranks: list[int], place: tuple) -> None:
    """A client process: ``ranks``' committers, each with its own connection, committing when told."""
    import torch.distributed as dist

    from ckpt import secret
    from ckpt.format.manifest import ShardRef
    from ckpt.inprocess import launch
    from ckpt.save.commit import Committer
    from ckpt.tiers.base import CheckpointId
    _place(*place)
    launch.raise_fd_limit()
    tier, cid, key = Tier(), CheckpointId(1, 0), secret.derive(si.SECRET, "checkpoint commit")
    volumes = [f"node{r // si.PER_NODE}" for r in range(n)]
    go, errors, connected, connecting = threading.Event(), [], threading.Semaphore(0), threading.Semaphore(CONNECTING)
    calls: list = []  # list.append is atomic: the ranks' threads share it
    ends: list = []

    def rank(r: int) -> None:  # connects in its own thread: the handshakes' round trips overlap
        try:
            with connecting:
                store = Timed(si.Counting(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=si.TIMEOUT)), calls)
            c = Committer(r, n, store=lambda: store, keep_last={}, default_keep=1, timeout_s=900, key=key)
            c.register(tier, volumes)
        except BaseException as e:  # noqa: BLE001 - reported to the benchmark
            errors.append(f"rank {r} could not start: {e!r}")
            return
        finally:
            connected.release()
        go.wait()
        try:
            c.commit(tier, cid, ShardRef(r, 0, 0))
            ends.append(time.time())
        except BaseException as e:  # noqa: BLE001 - reported to the benchmark
            errors.append(f"rank {r}: {e!r}")

    threading.stack_size(256 << 10)
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for _ in threads:
        connected.acquire()
    conn.send("ready")
    conn.recv()
    cpu0 = _cpu()
    go.set()
    for t in threads:
        t.join()
    phases: dict = {}
    for op, kind, t0, t1 in calls:
        p = phases.setdefault(f"{op} {kind}", [0, t0, t1, 0.0])
        p[0], p[1], p[2], p[3] = p[0] + 1, min(p[1], t0), max(p[2], t1), p[3] + t1 - t0
    conn.send((si.Counting.ops, si.Counting.keys, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, errors,
               _cpu() - cpu0, phases, max(ends, default=0.0)))


def _serve(conn, place: tuple) -> None:
    """The job's store in a process of its own (as the job launcher hosts it), placed as told."""
    _place(*place)
    from ckpt.inprocess import launch
    launch.raise_fd_limit()  # the server holds a connection a rank
    server = si.listening_store()
    conn.send((server.port, os.getpriority(os.PRIO_PROCESS, 0)))
    while conn.recv() == "keys":
        conn.send(server.num_keys())


def _sched(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable waiting for one) of every thread of ``pid`` so far."""
    run = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                r, w, _ = f.read().split()
        except OSError:
            continue
        run, wait = run + int(r), wait + int(w)
    return run / 1e9, wait / 1e9


def _runnable(samples: list, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        with open("/proc/loadavg") as f:
            samples.append(int(f.read().split()[3].split("/")[0]))


def store_nice() -> int:
    """The store process's nice value: ``STORE_PRIORITY`` below this process's."""
    return max(-20, os.getpriority(os.PRIO_PROCESS, 0) - STORE_PRIORITY)


def run_one(n: int, per_proc: int = PER_PROC, server_place: tuple | None = None,
            client_place: tuple = (None, None, SWITCH_S)) -> dict:
    """One step committed by ``n`` ranks: its row. ``*_place``: (nice, cpus[, GIL switch interval])
    of the store's process (default: ``store_nice()``) and of the client processes (None: as
    this process)."""
    server_place = (store_nice(), None) if server_place is None else server_place
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    store = ctx.Process(target=_serve, args=(theirs, server_place), daemon=True)
    store.start()
    port, nice = ours.recv()
    procs, kids = max(1, -(-n // per_proc)), []
    for i in range(procs):
        mine, theirs = ctx.Pipe()
        ranks = list(range(i * per_proc, min(n, (i + 1) * per_proc)))
        p = ctx.Process(target=_ranks, args=(theirs, port, n, ranks, client_place), daemon=True)
        p.start()
        kids.append((p, mine))
    samples: list = []
    stop = threading.Event()
    try:
        for _, conn in kids:
            assert conn.recv() == "ready"
        sampler = threading.Thread(target=_runnable, args=(samples, stop), daemon=True)
        sampler.start()
        s0, w0 = time.time(), _sched(store.pid)
        t0 = time.perf_counter()
        for _, conn in kids:
            conn.send("go")
        done = [conn.recv() for _, conn in kids]
        seconds = time.perf_counter() - t0
        s1 = _sched(store.pid)
        stop.set()
        ours.send("keys")
        left = ours.recv()
        ours.send("stop")
    finally:
        stop.set()
        for p, _ in [*kids, (store, None)]:
            p.join(60)
            if p.is_alive():
                p.kill()
    errors = [e for d in done for e in d[3]]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed to commit, the first: {errors[0]}")
    ops, keys = sum(d[0] for d in done), sum(d[1] for d in done)
    phases: dict = {}
    for d in done:
        for k, (c, a, b, tot) in d[5].items():
            p = phases.setdefault(k, [0, a, b, 0.0])
            p[0], p[1], p[2], p[3] = p[0] + c, min(p[1], a), max(p[2], b), p[3] + tot
    return {"component": "commit", "ranks": n, "seconds": seconds, "store_ops": ops, "store_keys": keys,
            "ops_per_rank": ops / n, "server_s_per_op": seconds / max(1, ops), "clients": n,
            "client_procs": procs, "per_proc": per_proc, "client_procs_peak_rss_mb": max(d[2] for d in done),
            "keys_left": left, "server_cpu_s": s1[0] - w0[0], "server_runq_s": s1[1] - w0[1],
            "server_cpu_us_per_op": 1e6 * (s1[0] - w0[0]) / max(1, ops), "clients_cpu_s": sum(d[4] for d in done),
            "runnable_mean": sum(samples) / max(1, len(samples)), "runnable_max": max(samples, default=0),
            "last_rank_done_s": max(d[6] for d in done) - s0, "server_place": list(server_place), "server_nice": nice,
            "client_nice": os.getpriority(os.PRIO_PROCESS, 0) if client_place[0] is None else client_place[0],
            "client_place": list(client_place),
            "phases": {k: {"n": c, "first_s": round(a - s0, 4), "last_s": round(b - s0, 4),
                           "mean_ms": round(1e3 * tot / c, 3)} for k, (c, a, b, tot) in sorted(
                               phases.items(), key=lambda kv: kv[1][1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--per-proc", type=int, default=PER_PROC, help="rank threads a client process")
    ap.add_argument("--store-nice", type=int, default=store_nice(),
                    help=f"the store process's nice value (default %(default)s: {STORE_PRIORITY} below this one's)")
    ap.add_argument("--store-cpus", help="the store process's cores, e.g. 0")
    ap.add_argument("--client-nice", type=int, help="the client processes' nice value")
    ap.add_argument("--client-cpus", help="the client processes' cores, e.g. 1")
    ap.add_argument("--switch-s", type=float, default=SWITCH_S,
                    help="the client processes' GIL switch interval (default %(default)s; CPython's own: 0.005)")
    a = ap.parse_args()
    place = (a.client_nice, a.client_cpus, a.switch_s)
    print(json.dumps(run_one(a.ranks, a.per_proc, (a.store_nice, a.store_cpus), place)))


if __name__ == "__main__":
    main()
