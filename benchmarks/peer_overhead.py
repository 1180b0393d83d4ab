"""Training step-time overhead of peer replicas: ``peers=1`` against ``peers=0``, both
saving every N steps, as an interleaved A/B inside one real job.

The job is two simulated nodes on this machine: two worker processes (gloo on
loopback, ``CKPT_GUARD_NODE=node0/node1``, each its own memory dir under /dev/shm and
disk root under the temporary directory) train a small MLP with DDP and Adam, one
intra-op thread each. Each process holds two managers of the same state, one with
``peers=0`` (A) and one with ``peers=1`` (B, replicating to the other node), and the
training alternates blocks of ``--block-saves`` x ``--every`` steps between them in the
order A B B A A B ..., saving every ``--every`` steps through the block's manager (a
save's blocking copy counts in its step). Blocks a few seconds long, in the same
processes, see the same machine: on a machine shared with other jobs this is what keeps
the noise out of the comparison. A block's figure is its mean step time (the overhead
lives in the steps that save and in those the background work slows, not in the median
step), the CPU seconds rank 0's process spent per step (its training, its own drain,
sending its replica and receiving rank 1's: each block waits, untimed, for its drain and
its replicas before the next one starts, so none of its work is counted in the next) and
those its training thread alone spent (the trainer's own share: on a cluster the
background work runs on idle cores, the receiving half on another node). Replication
threads run at nice ``--nice`` (a job's default: 10, ``CKPT_GUARD_PEER_NICE``). The
first A and B blocks allocate the slots and are dropped. Reported: each arm's median
over blocks with min and max, the ratio of medians, and the spread of the per-pair
ratios B/A. The issue's target: ``peers=1`` at most 5 % slower. ``--aa`` runs the same
with ``peers=0`` in both arms: the spread it shows is the noise floor of the comparison
on this machine. An idle ``peers=1`` manager costs nothing measurable (a thread in
``accept``), so A blocks are ``peers=0`` training.

Not a test: nothing here asserts a speed. On one machine the replica's bytes cross
loopback, so sender and receiver compete with training for the same cores (a real
node's NIC moves them by DMA): a harsher setting than a cluster.

    PYTHONPATH=. python benchmarks/peer_overhead.py [--pairs 8] [--every 10] [--nice 10] [--json out.json | --json -]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.harness import abba, leaves_no_shm, paired_ratio, parser, run_meta, spread, write_json  # noqa: E402
from tests.procs import free_port, stop_process  # noqa: E402


def arms(pairs: int) -> list[int]:
    """The peers setting of each block: a warm-up A and B, then A B B A A B ... (pairs of each)."""
    return [0, 1] + [p for pair in abba(pairs) for p in pair]


def worker(args: argparse.Namespace) -> None:
    """One rank: train the blocks, write rank 0's per-block figures."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ckpt import CheckpointManager
    from ckpt.distributed import exit_rank, init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, node = dist.get_rank(), os.environ["CKPT_GUARD_NODE"]
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": opt}
    mgrs = {p: CheckpointManager(Path(args.work) / node / f"arm{p}", memory_dir=str(Path(args.shm) / node / f"arm{p}"),
                                 keep_last=2, state=state, peers=0 if args.aa else p, node=node) for p in (0, 1)}
    gen = torch.Generator().manual_seed(rank)
    blocks, step, handles = [], 0, []
    for peers in arms(args.pairs):
        mgr, times = mgrs[peers], []
        c0, tc0 = time.process_time(), time.thread_time()
        for _ in range(args.every * args.block_saves):
            step += 1
            x = torch.randn(args.batch, args.width, generator=gen)
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            if step % args.every == args.every // 2:  # mid-interval: its background work overlaps timed steps
                handles.append((peers, mgr.save(step, state)))
            times.append(time.perf_counter() - t0)
        mgr.wait()  # the block's background work (drain; replicas below) is counted in its own CPU
        if mgr.peering is not None:
            mgr.peering.replicator.join()
        blocks.append({"peers": peers, "mean_step_s": statistics.fmean(times),
                       "cpu_per_step_s": (time.process_time() - c0) / len(times),
                       "train_thread_cpu_per_step_s": (time.thread_time() - tc0) / len(times)})
    for mgr in mgrs.values():
        mgr.wait()
    rep = mgrs[1].peering.replicator if mgrs[1].peering is not None else None
    if rep is None and not args.aa:
        raise SystemExit("peers=1 made no replicas: are the two ranks on distinct nodes?")
    if rep is not None:
        rep.join()
    out = {"blocks": blocks[2:], "state_bytes": handles[-1][1].nbytes,
           "blocking_s": {p: statistics.median(h.blocking_s for q, h in handles if q == p) for p in (0, 1)},
           "peer_durable_s": statistics.median([h.durable_s["peer"] for _, h in handles if "peer" in h.durable_s]
                                               or [0.0]),
           "replicas": {"sent": rep.sent, "failed": rep.failed, "superseded": rep.superseded} if rep else None}
    for mgr in mgrs.values():
        mgr.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    exit_rank()


def run_job(args: argparse.Namespace, out: Path) -> dict:
    """The two-node job; rank 0's figures."""
    work = Path(tempfile.mkdtemp(prefix="peer-overhead-"))
    shm = tempfile.mkdtemp(prefix="peer-overhead-", dir="/dev/shm")
    port = free_port()
    argv = [sys.executable, __file__, "--worker", "--work", str(work), "--shm", shm, "--out", str(out),
            *(f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("width", "layers", "batch", "every", "block_saves", "pairs")), *(["--aa"] if args.aa else [])]
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                   "CKPT_GUARD_NODE": f"node{rank}", "OMP_NUM_THREADS": "1", "CKPT_GUARD_PEER_NICE": str(args.nice)}
            procs.append(subprocess.Popen(argv, env=env, cwd=REPO))
        while any(p.poll() is None for p in procs):  # one failed rank leaves the other in a collective
            if any(p.returncode not in (None, 0) for p in procs):
                raise RuntimeError(f"a worker failed: exit codes {[p.returncode for p in procs]}")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"a worker failed: exit codes {[p.returncode for p in procs]}")
        leaves_no_shm(shm)
        return json.loads(out.read_text())
    finally:
        for p in procs:
            stop_process(p)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--pairs", type=int, default=8, help="timed blocks per arm")
    ap.add_argument("--every", type=int, default=10, help="save every this many steps")
    ap.add_argument("--block-saves", type=int, default=2, help="saves per block")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--aa", action="store_true", help="A/A: both arms peers=0, to see the noise floor")
    ap.add_argument("--nice", type=int, default=10, help="nice value of the replication threads (0: normal)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    meta = run_meta()
    with tempfile.TemporaryDirectory() as tmp:
        got = run_job(args, Path(tmp) / "rank0.json")
    by = {p: [b for b in got["blocks"] if b["peers"] == p] for p in (0, 1)}
    step = {p: [b["mean_step_s"] for b in bs] for p, bs in by.items()}
    cpu = {p: [b["cpu_per_step_s"] for b in bs] for p, bs in by.items()}
    thread_cpu = {p: [b["train_thread_cpu_per_step_s"] for b in bs] for p, bs in by.items()}
    out = {"aa": args.aa, "nice": args.nice, "pairs": args.pairs, "every": args.every,
           "block_steps": args.every * args.block_saves,
           "width": args.width, "layers": args.layers, "batch": args.batch,
           "state_bytes_per_rank": got["state_bytes"],
           "peers0_mean_step_s": spread(step[0]), "peers1_mean_step_s": spread(step[1]),
           "overhead_ratio": statistics.median(step[1]) / statistics.median(step[0]),
           "paired_ratio": paired_ratio(step[0], step[1]),  # blocks are adjacent pairs: A B, B A, ...
           "peers0_cpu_per_step_s": spread(cpu[0]), "peers1_cpu_per_step_s": spread(cpu[1]),
           "cpu_ratio": statistics.median(cpu[1]) / statistics.median(cpu[0]),
           "peers0_train_thread_cpu_per_step_s": spread(thread_cpu[0]),
           "peers1_train_thread_cpu_per_step_s": spread(thread_cpu[1]),
           "train_thread_cpu_ratio": statistics.median(thread_cpu[1]) / statistics.median(thread_cpu[0]),
           "save_blocking_s": got["blocking_s"], "peer_durable_s": got["peer_durable_s"],
           "replicas": got["replicas"], "blocks": got["blocks"]}
    p = out["paired_ratio"]
    b_arm = "B (peers=0 too: A/A)" if args.aa else "B (peers=1)"
    print(f"A (peers=0): mean step {1e3 * out['peers0_mean_step_s']['median']:.1f} ms (median of {args.pairs} blocks)\n"
          f"{b_arm}: mean step {1e3 * out['peers1_mean_step_s']['median']:.1f} ms\n"
          f"ratio {out['overhead_ratio']:.3f} (per pair: median {p['median']:.3f}, {p['min']:.3f}..{p['max']:.3f}, "
          f"95 % CI {p['ci_low']:.3f}..{p['ci_high']:.3f}); "
          f"CPU per step ratio {out['cpu_ratio']:.3f} (training thread's: {out['train_thread_cpu_ratio']:.3f}); "
          f"replicas {out['replicas']}")
    write_json(args.json, meta, **out)


if __name__ == "__main__":
    main()
