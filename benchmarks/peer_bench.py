"""Peer replication and restore, each against what it replaces, on loopback, same bytes.

One process, the same sealed checkpoint slot (``--mb``, 8 float32 tensors) for every
contender:

* replicate   ``Replicator`` -> ``PeerServer``: authenticated connection, the bytes
              written straight into a pre-allocated replica slot, every chunk's CRC32C
              checked, then sealed (what ``peers=1`` does after each drain);
* tcp copy    ``sendall`` of the slot's bytes into a pre-allocated buffer on a loopback
              socket, nothing else: the ceiling for this machine;
* restore     a lost node's shard read back into the trainer's existing tensors, every
              chunk verified (``load_shard``, what ``restore()`` runs per shard), from
              - memory: this node's own slot (what a crashed process restores from),
              - peer: the replica held by another rank (``RemoteTier``: a replacement node),
              - object: the object store (a moto S3 server on loopback, objects in its
                memory, started here as the tests start it; ``--no-object`` skips it).

Rounds are interleaved (replicate, copy, the restores, repeat; the first two rounds
allocate the two replica slots of its three that a pool uses with one rank per node, and
are dropped). Reported: medians with min and max, GB/s, the ratio of medians, and the
replicate/copy ratio paired per round (both ran back to back), which a noisy machine
disturbs least; ``cpu_s`` is this process's CPU (both ends of the loopback) per run, and
``replicate_vs_copy_cpu`` the copy's CPU over replication's: the throughput ratio to
expect where both ends share too few cores (replication also checks every byte's CRC32C,
~14 GB/s a core). Both move the bytes with the same receive loop (``wire.recv_into``:
blocking, MSG_WAITALL, 8 MiB a call), so the ratio is the cost of what replication adds
(authentication, AES-256-GCM on every piece at both ends, manifest, checksums, seal).
Replication runs at normal priority here (``--nice 0``, as the copy does); a job's
periodic replicas run at nice 10 (``CKPT_GUARD_PEER_NICE``), yielding to training on
busy cores: ``--nice 10`` measures that. Not a test: nothing here asserts a speed; the
issue's target is replicate >= 0.8x the copy.

    PYTHONPATH=. python benchmarks/peer_bench.py --mb 256 --repeats 7 [--nice 0] [--json out.json | --json -]
"""
from __future__ import annotations

import shutil
import socket
import statistics
import sys
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import leaves_no_shm, paired_ratio, parser, run_meta, timed, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402
from ckpt.peers.remote import Held, RemoteTier  # noqa: E402
from ckpt.peers.replicas import ReplicaSlots  # noqa: E402
from ckpt.peers.replicator import ReplicaJob, Replicator  # noqa: E402
from ckpt.peers.server import PeerServer  # noqa: E402
from ckpt.peers.wire import new_secret, recv_into  # noqa: E402
from ckpt.restore.reshard import load_shard  # noqa: E402
from ckpt.tiers.memory import MemoryTier, namespace_dir  # noqa: E402
from ckpt.tiers.memory.reader import SlotReader, slot_epoch  # noqa: E402
from ckpt.tiers.peer import PeerTier  # noqa: E402
from tests.objstore_fixtures import create_bucket, moto_server  # noqa: E402


def tcp_copy(data: memoryview, out: bytearray) -> None:
    """Push ``data`` through a loopback socket into ``out``, a buffer allocated and touched
    beforehand (as the replica slots are)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def take() -> None:
            conn, _ = server.accept()
            with conn:
                recv_into(conn, memoryview(out), deadline=None)
                conn.sendall(b"k")
        t = threading.Thread(target=take)
        t.start()
        with socket.create_connection(server.getsockname()) as c:
            c.sendall(data)
            c.recv(1)
        t.join()


def summary(runs: list[tuple[float, float]], nbytes: int) -> dict[str, float]:
    wall = [w for w, _ in runs]
    med = statistics.median(wall)
    return {"median_s": med, "min_s": min(wall), "max_s": max(wall), "GBps": nbytes / med / 1e9,
            "cpu_s": statistics.median(c for _, c in runs)}


def main() -> None:
    ap = parser(__doc__, repeats=5)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size")
    ap.add_argument("--no-object", action="store_true", help="skip the object-store restore (no moto server)")
    ap.add_argument("--nice", type=int, default=0, help="nice value of the replication threads (a job's periodic "
                                                          "replicas: 10)")
    args = ap.parse_args()
    meta = run_meta()
    n = args.mb * 2**20 // 4
    state = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # the trainer's tensors a restore fills
    times: dict[str, list[tuple[float, float]]] = {"replicate": [], "tcp_copy": [], "restore_memory": [],
                                                   "restore_peer": [], "restore_object": []}
    with ExitStack() as stack:
        shm = tempfile.mkdtemp(prefix="peer-bench-", dir="/dev/shm")
        root = tempfile.mkdtemp(prefix="peer-bench-root-")
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        stack.callback(shutil.rmtree, shm, ignore_errors=True)
        store = {}
        if not args.no_object:  # objects in moto's memory, not spooled to this VM's disk (as objstore_bench)
            s3 = stack.enter_context(moto_server({"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(64 << 30)}))
            store = {"object_store": f"s3://{create_bucket(s3)}/bench",
                     "storage_options": s3.options(read_timeout=600)}
        mgr = stack.enter_context(CheckpointManager(root, memory_dir=shm, state=state, **store))
        mgr.save(1, state).wait()
        src = MemoryTier(namespace_dir(str(Path(root).resolve()), "default", shm), 0)
        ckpt_id = src.list()[-1].id
        secret = new_secret()
        ns = Path(shm) / "bench-replicas"  # this benchmark's own pool, not a job's namespace
        replicas = ReplicaSlots(ns, {"root": root, "run": "bench"})  # checker threads as Peering has them
        stack.callback(replicas.close)
        server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=120, nice=args.nice)
        server.start(secret)
        stack.callback(server.close)
        rep = Replicator([server.addr], secret, bytes_per_s=None, timeout_s=120, nice=args.nice)
        stack.callback(rep.close)
        # the trainer's own mapping of its slot, as the manager hands it to the replicator
        slot = next(s for s in mgr.memory.pool.slots if s.holds == (ckpt_id.generation, ckpt_id.step))
        epoch = slot_epoch(slot.meta_path)
        sealed = slot.sealed()
        assert sealed is not None and sealed.has_checksums, "the drain re-seals the slot with its checksums"
        nbytes = sealed.data_bytes
        data = memoryview(slot.buffer.numpy())[:nbytes]
        copy_to = bytearray(nbytes)  # zero-filled: every page touched before the first run

        def replicate() -> None:
            ok: list[bool] = []
            source = lambda: SlotReader(slot.meta_path, slot.data_path, sealed, slot.buffer, epoch=epoch)  # noqa: E731
            rep.submit(ReplicaJob(1, source, ok.append))
            rep.join()
            assert ok == [True], "replication failed"

        def restore_from(tier_of: Callable[[], object]) -> Callable[[], None]:
            return lambda: load_shard(tier_of(), ckpt_id, target)

        def peer_tier() -> RemoteTier:
            ref = PeerTier(ns).read_manifest(ckpt_id).shards[0]
            return RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, secret, timeout_s=120)

        contenders = {"replicate": replicate, "tcp_copy": lambda: tcp_copy(data, copy_to),
                      "restore_memory": restore_from(lambda: src), "restore_peer": restore_from(peer_tier)}
        if mgr.object is not None:
            contenders["restore_object"] = restore_from(lambda: mgr.object)
        for i in range(args.repeats + 2):
            got = {name: timed(fn) for name, fn in contenders.items()}
            assert all(torch.equal(target[k], v) for k, v in state.items()), "a restore differs from the source"
            if i > 1:  # the first two rounds allocate the two slots used here (the third is never: one rank per node)
                for name, t in got.items():
                    times[name].append(t)
            print(f"round {i}: " + ", ".join(f"{k} {w:.3f} s" for k, (w, _) in got.items())
                  + ("" if i > 1 else " (warm-up, dropped)"), file=sys.stderr, flush=True)
        mgr.close()
        leaves_no_shm(shm)
    out: dict = {"bytes": nbytes, "repeats": args.repeats, "nice": args.nice}
    out |= {k: summary(v, nbytes) for k, v in times.items() if v}
    out["replicate_vs_copy"] = out["tcp_copy"]["median_s"] / out["replicate"]["median_s"]
    out["replicate_vs_copy_cpu"] = out["tcp_copy"]["cpu_s"] / out["replicate"]["cpu_s"]  # where CPU is the limit
    wall = {k: [w for w, _ in v] for k, v in times.items()}
    out["replicate_vs_copy_paired"] = paired_ratio(wall["replicate"], wall["tcp_copy"])
    restores = [k for k in ("restore_memory", "restore_peer", "restore_object") if k in out]
    out["restore_vs_peer"] = {k: out[k]["median_s"] / out["restore_peer"]["median_s"] for k in restores}
    for k in ("replicate", "tcp_copy", *restores):
        r = out[k]
        print(f"{k:>15}: {r['median_s']:.3f} s ({r['min_s']:.3f}..{r['max_s']:.3f})  {r['GBps']:.2f} GB/s  "
              f"cpu {r['cpu_s']:.3f} s")
    p = out["replicate_vs_copy_paired"]
    print(f"replicate: {out['replicate_vs_copy']:.2f}x the copy's speed (paired per round: median {p['median']:.2f},"
          f" {p['min']:.2f}..{p['max']:.2f}; by CPU {out['replicate_vs_copy_cpu']:.2f}); restore time vs peer: "
          + ", ".join(f"{k[8:]} {v:.2f}x" for k, v in out["restore_vs_peer"].items()))
    write_json(args.json, meta, **out)


if __name__ == "__main__":
    main()
