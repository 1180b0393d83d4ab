"""`steady_step` with a real store connection per rank and per node launcher: scale_bench's
``steady_step_clients`` row.

``steady_step`` shares 64 clients among its stand-in ranks in one process. Here every worker and
every node launcher but node 0's holds its own ``TCPStore`` client, as in a real job, the
clients living in ``PROCS`` client processes (each raises its soft fd limit to the hard one with
the launcher's ``raise_fd_limit``); the job launcher (with node 0's launcher) and the store's
server are in this one, so the server holds N + N/8 connections. The server listens on
127.0.0.1 only, on a socket bound as the launcher binds its own (``master_listen_fd``): torch's
``TCPStore(is_master=True)`` alone listens on every address (``*:port``). So every client goes
127.0.0.1 -> 127.0.0.1:port, one source/destination pair, whose 28,232 ephemeral ports
(``ip_local_port_range`` 32768-60999) hold the 18,432 connections of 16,384 ranks.

The step is ``steady_step``'s (``scale_bench.worker_step``, then ``BEAT_S / POLL_S`` ticks on the
launchers' clock), its ticks in lockstep: the job launcher's tick here, then each client
process's node launchers' polls, a tick's end awaited from every process. The processes run at
once on this machine's cores, so its seconds are not those of the serial ``steady_step``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time

from benchmarks import scale_standins as si

PROCS = 4


def _client(port: int) -> si.Counting:
    import torch.distributed as dist
    return si.Counting(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=si.TIMEOUT))


def _serve(conn, port: int, nodes: list[int], workers: list[int]) -> None:
    """A client process: its node launchers and workers, each with its own connection, stepping when told."""
    from ckpt.inprocess import launch, node
    launch.raise_fd_limit()
    node.time = si.CLOCK
    si.CLOCK.now = conn.recv()
    launchers = [si.node_launcher(si.ctl(_client(port)), k, port) for k in nodes]
    ctls = {w: si.ctl(_client(port)) for w in workers}
    conn.send(len(launchers) + len(ctls))
    while (cmd := conn.recv()) != "stop":
        what, arg = cmd
        if what == "reset":
            si.Counting.ops = si.Counting.keys = 0
        elif what == "work":
            for w, ctl in ctls.items():
                si.worker_step(ctl, w, arg)
        else:  # a tick at the launchers' clock ``arg``
            si.CLOCK.now = arg
            for nl in launchers:
                nl.poll()
        conn.send((si.Counting.ops, si.Counting.keys, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run_one(n: int, procs: int = PROCS) -> dict:
    """One steady step of ``n`` ranks with a connection each, after three not counted: its row."""
    from ckpt.inprocess import launch, node
    from ckpt.inprocess.runner import BEAT_S
    launch.raise_fd_limit()
    si.CLOCK.now = time.monotonic()
    node.time = launch.time = si.CLOCK
    server = si.listening_store()
    job, _ = si.job_of(n, [si.Counting(server)], others=False)
    n_nodes = max(1, n // si.PER_NODE)
    ctx, kids = mp.get_context("spawn"), []
    for i in range(procs):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(theirs, server.port, list(range(1 + i, n_nodes, procs)),
                                             list(range(i, n, procs))), daemon=True)
        p.start()
        ours.send(si.CLOCK.now)
        kids.append((p, ours))
    connections = 1 + sum(conn.recv() for _, conn in kids)

    def each(cmd) -> list:
        for _, conn in kids:
            conn.send(cmd)
        return [conn.recv() for _, conn in kids]

    try:
        for step in range(1, 5):  # three for the launchers' warm-up, the fourth measured
            if step == 4:
                each(("reset", None))
                si.Counting.ops = si.Counting.keys = 0
                t0 = time.perf_counter()
            each(("work", step))
            for _ in range(round(BEAT_S / node.POLL_S)):
                job.tick()
                counts = each(("tick", si.CLOCK.now))
                si.CLOCK.now += node.POLL_S
        seconds = time.perf_counter() - t0
        ops = si.Counting.ops + sum(c[0] for c in counts)
        keys = si.Counting.keys + sum(c[1] for c in counts)
        fds = len(os.listdir("/proc/self/fd"))
    finally:
        for p, conn in kids:
            conn.send("stop")
            p.join(60)
        job.lifelines.close()
    return {"component": "steady_step_clients", "ranks": n, "seconds": seconds, "store_ops": ops, "store_keys": keys,
            "ops_per_rank": ops / n, "server_s_per_op": seconds / max(1, ops), "clients": connections,
            "client_procs": procs, "client_procs_peak_rss_mb": max(c[2] for c in counts),
            "server_fds": fds}
