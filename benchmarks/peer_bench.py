"""Peer replication throughput against a plain loopback TCP copy of the same bytes.

One process, loopback, the same sealed checkpoint slot for every contender:

* replicate   ``Replicator`` → ``PeerServer``: authenticated connection, the bytes
              written straight into a pre-allocated replica slot, every chunk's CRC32C
              checked, then sealed (what ``peers=1`` does after each drain);
* fetch       ``RemoteTier.open_shard``: a restoring rank reading a replica back;
* tcp copy    ``sendall`` of the slot's bytes into a pre-allocated buffer on a loopback
              socket, nothing else: the ceiling for this machine.

Runs are interleaved (replicate, fetch, copy, repeat; the first two rounds allocate
the two replica slots and are dropped), medians reported with GB/s and ratios to the copy. Not a test: nothing
here asserts a speed; the issue's target is replicate >= 0.8x the copy.

    PYTHONPATH=. python benchmarks/peer_bench.py --mb 256 --repeats 5 [--json out.json | --json -]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import CheckpointManager  # noqa: E402
from ckpt.peers.remote import Held, RemoteTier  # noqa: E402
from ckpt.peers.replicas import ReplicaSlots  # noqa: E402
from ckpt.peers.replicator import ReplicaJob, Replicator  # noqa: E402
from ckpt.peers.server import PeerServer  # noqa: E402
from ckpt.peers.wire import new_secret, recv_into  # noqa: E402
from ckpt.restore import open_shard  # noqa: E402
from ckpt.tiers.memory import MemoryTier, namespace_dir  # noqa: E402
from ckpt.tiers.memory.reader import SlotReader  # noqa: E402
from ckpt.tiers.peer import PeerTier  # noqa: E402


def tcp_copy(data: memoryview) -> float:
    """Seconds to push ``data`` through a loopback socket into a ready buffer."""
    out = bytearray(len(data))
    with socket.create_server(("127.0.0.1", 0)) as server:
        def take() -> None:
            conn, _ = server.accept()
            with conn:
                recv_into(conn, memoryview(out), deadline=None)
                conn.sendall(b"k")
        t = threading.Thread(target=take)
        t.start()
        t0 = time.perf_counter()
        with socket.create_connection(server.getsockname()) as c:
            c.sendall(data)
            c.recv(1)
        elapsed = time.perf_counter() - t0
        t.join()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results as JSON to this path ('-': stdout)")
    args = ap.parse_args()

    shm = tempfile.mkdtemp(prefix="peer-bench-", dir="/dev/shm")
    root = tempfile.mkdtemp(prefix="peer-bench-root-")
    n = args.mb * 2**20 // 4
    state = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    mgr = CheckpointManager(root, memory_dir=shm)
    mgr.save(1, state).wait()
    src = MemoryTier(namespace_dir(str(Path(root).resolve()), "default", shm), 0)
    ckpt_id = src.list()[-1].id
    secret = new_secret()
    ns = Path(shm) / "ckpt-guard-bench-replicas"
    replicas = ReplicaSlots(ns, {"root": root, "run": "bench"}, threads=4)
    server = PeerServer(replicas, PeerTier(ns), host="127.0.0.1", timeout_s=120)
    server.start(secret)
    rep = Replicator([server.addr], secret, bytes_per_s=None, timeout_s=120)
    times: dict[str, list[float]] = {"replicate": [], "fetch": [], "tcp_copy": []}
    try:
        reader = open_shard(src, ckpt_id, 0)
        nbytes = reader.manifest.data_bytes
        # the trainer's own mapping of its slot, as the manager hands it to the replicator
        slot = next(s for s in mgr.memory.pool.slots if s.holds == (ckpt_id.generation, ckpt_id.step))
        sealed, seal = reader.manifest, os.stat(slot.meta_path).st_ino

        def source() -> SlotReader:
            return SlotReader(slot.meta_path, slot.data_path, sealed, slot.buffer, seal=seal)
        for i in range(args.repeats + 2):
            ok: list[bool] = []
            t0 = time.perf_counter()
            rep.submit(ReplicaJob(1, source, ok.append))
            rep.join()
            t_rep = time.perf_counter() - t0
            assert ok == [True], "replication failed"
            ref = PeerTier(ns).read_manifest(ckpt_id).shards[0]
            remote = RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, secret, timeout_s=120)
            t0 = time.perf_counter()
            remote.open_shard(ckpt_id, ref).close()
            t_fetch = time.perf_counter() - t0
            t_copy = tcp_copy(memoryview(slot.buffer.numpy())[:nbytes])
            if i > 1:  # the first two rounds allocate the two replica slots
                times["replicate"].append(t_rep)
                times["fetch"].append(t_fetch)
                times["tcp_copy"].append(t_copy)
            print(f"round {i}: replicate {t_rep:.3f} s, fetch {t_fetch:.3f} s, tcp copy {t_copy:.3f} s"
                  + ("" if i > 1 else " (warm-up, dropped)"), file=sys.stderr, flush=True)
        reader.close()
    finally:
        rep.close()
        server.close()
        replicas.close()
        mgr.close()
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bytes": nbytes, "repeats": args.repeats,
           **{f"{k}_s": v for k, v in med.items()},
           **{f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()},
           "replicate_vs_copy": med["tcp_copy"] / med["replicate"], "fetch_vs_copy": med["tcp_copy"] / med["fetch"]}
    for k in ("replicate", "fetch", "tcp_copy"):
        print(f"{k:>10}: {med[k]:.3f} s  {out[f'{k}_GBps']:.2f} GB/s"
              + ("" if k == "tcp_copy" else f"  {med['tcp_copy'] / med[k]:.2f}x the copy's speed"))
    if args.json == "-":
        print(json.dumps(out, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
