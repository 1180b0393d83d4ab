"""scale_bench's `commit` row: every rank's real ``Committer.commit`` of one step, clean-up included.

What is real: the commit protocol (``ckpt.save.commit.Committer``, unchanged, signed under the
benchmark's job secret as under the launcher), the job's store (a ``TCPStore`` server on
127.0.0.1 in the benchmark's process) and one ``TCPStore`` connection per rank, as each rank's
drain thread holds in a job. What stands in: the ranks are threads, ``PER_PROC`` of them in each
of N / ``PER_PROC`` client processes (each raises its soft fd limit to the hard one with the
launcher's ``raise_fd_limit``), with nothing saved: the tier keeps nothing (``Tier``), so the
seconds are the protocol's own. One volume per node of 8 (local disks: N/8 leaders).

A waiting rank's thread sleeps in the store (a blocking ``wait``), so N threads cost no CPU
while they wait; but the ranks of one process share its GIL (2,048 ranks in one process took
25 s at N = 2,048, 256 in each of 8 processes 6.9 s), hence ``PER_PROC`` ranks a process. The
processes start, connect (in the ranks' threads, ``CONNECTING`` at once: the handshakes overlap) and build their
committers first; the seconds run from the moment every one is told to commit until every
rank has returned.
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import threading
import time

from benchmarks import scale_standins as si

PER_PROC = 512
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


def _ranks(conn, port: int, n: int, ranks: list[int]) -> None:
    """A client process: ``ranks``' committers, each with its own connection, committing when told."""
    import torch.distributed as dist

    from ckpt import secret
    from ckpt.format.manifest import ShardRef
    from ckpt.inprocess import launch
    from ckpt.save.commit import Committer
    from ckpt.tiers.base import CheckpointId
    launch.raise_fd_limit()
    tier, cid, key = Tier(), CheckpointId(1, 0), secret.derive(si.SECRET, "checkpoint commit")
    volumes = [f"node{r // si.PER_NODE}" for r in range(n)]
    go, errors, connected, connecting = threading.Event(), [], threading.Semaphore(0), threading.Semaphore(CONNECTING)

    def rank(r: int) -> None:  # connects in its own thread: the handshakes' round trips overlap
        try:
            with connecting:
                store = si.Counting(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=si.TIMEOUT))
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
    go.set()
    for t in threads:
        t.join()
    conn.send((si.Counting.ops, si.Counting.keys, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, errors))


def run_one(n: int) -> dict:
    """One step committed by ``n`` ranks: its row."""
    from ckpt.inprocess import launch
    launch.raise_fd_limit()  # the server holds a connection a rank
    server = si.listening_store()
    procs = max(1, -(-n // PER_PROC))
    ctx, kids = mp.get_context("spawn"), []
    for i in range(procs):
        ours, theirs = ctx.Pipe()
        ranks = list(range(i * PER_PROC, min(n, (i + 1) * PER_PROC)))
        p = ctx.Process(target=_ranks, args=(theirs, server.port, n, ranks), daemon=True)
        p.start()
        kids.append((p, ours))
    try:
        for _, conn in kids:
            assert conn.recv() == "ready"
        t0 = time.perf_counter()
        for _, conn in kids:
            conn.send("go")
        done = [conn.recv() for _, conn in kids]
        seconds = time.perf_counter() - t0
        left = server.num_keys()
    finally:
        for p, _ in kids:
            p.join(60)
            if p.is_alive():
                p.kill()
    errors = [e for d in done for e in d[3]]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed to commit, the first: {errors[0]}")
    ops, keys = sum(d[0] for d in done), sum(d[1] for d in done)
    return {"component": "commit", "ranks": n, "seconds": seconds, "store_ops": ops, "store_keys": keys,
            "ops_per_rank": ops / n, "server_s_per_op": seconds / max(1, ops), "clients": n,
            "client_procs": procs, "client_procs_peak_rss_mb": max(d[2] for d in done), "keys_left": left}
