"""Restore at another world size vs the same world size vs ``dcp.load``, in one run.

    python benchmarks/reshard_bench.py [--mb 256] [--repeats 3] [--json out.json]

The same global state (``--tensors`` fp32 matrices, ``--mb`` in all, FSDP's layout:
``Shard(0)`` over every rank) is saved three times: by ckpt-guard at 4 ranks and at 2,
and by ``torch.distributed.checkpoint.save`` at 4. Then 2 ranks (torchrun, gloo, CPU)
restore it, alternating, ``--repeats`` times each:

* ``same``: ckpt-guard, saved at 2 (each rank reads its own shard whole);
* ``reshard``: ckpt-guard, saved at 4 (each rank reads the overlapping halves of two
  saved shards, every chunk verified);
* ``dcp``: ``dcp.load`` of the 4-rank DCP checkpoint (DCP's own resharding, no checksums).

Each restore reads from the disk tier (a fresh memory directory, so no memory slot is
used), through the page cache: what is compared is the engine's work, not the disk. The
time of one restore is the slowest rank's; medians over the repeats, and the ratios to
``same`` (target: ``reshard`` <= 1.5x). Each restored state is checked bitwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402


def launch(nproc: int, *args: str) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", __file__, "--phase", *args]
    subprocess.run(cmd, env=env, check=True, cwd=REPO)


def state_for(mesh, n: int, rows: int, cols: int, zero: bool = False) -> dict:
    """``n`` Shard(0) DTensors whose values follow from their global indices (no full copy anywhere)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_rank()
    per = -(-rows // world)
    lo, hi = min(rows, rank * per), min(rows, (rank + 1) * per)
    out = {}
    for i in range(n):
        local = torch.zeros(hi - lo, cols) if zero else (torch.arange(lo * cols, hi * cols, dtype=torch.float32)
                                                         .reshape(hi - lo, cols) + 0.5 * i)
        out[f"w{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, cols),
                                          stride=(cols, 1))
    return out


def phase(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt import CheckpointManager
    from ckpt.distributed import exit_rank, init_process_group

    init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    work = Path(args.work)
    rows = args.mb * 2**20 // (4 * args.cols * args.tensors)
    if args.phase == "save":
        state = state_for(mesh, args.tensors, rows, args.cols)
        with CheckpointManager(work / f"ours-{world}", memory_dir=str(work / f"shm-save-{world}"), run="bench") as mgr:
            mgr.save(1, state).wait()
        if world == 4:
            dcp.save(state, checkpoint_id=str(work / "dcp-4"))
    else:
        expect = state_for(mesh, args.tensors, rows, args.cols)
        times: dict[str, list[float]] = {"same": [], "reshard": [], "dcp": []}
        amplification = None
        for rep in range(args.repeats):
            for kind in times:
                state = state_for(mesh, args.tensors, rows, args.cols, zero=True)
                mgr = None
                if kind != "dcp":
                    root = work / f"ours-{2 if kind == 'same' else 4}"
                    mgr = CheckpointManager(root, memory_dir=str(work / f"shm-{kind}-{rep}"), run="bench")
                dist.barrier()
                t0 = time.perf_counter()
                if mgr is None:
                    dcp.load(state, checkpoint_id=str(work / "dcp-4"))
                else:
                    assert mgr.restore(state) == 1
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[kind].append(float(took))
                if kind == "reshard":
                    amplification = mgr.last_reshard.amplification
                if mgr is not None:
                    mgr.close()
                bad = [k for k in expect if not torch.equal(state[k].to_local(), expect[k].to_local())]
                assert not bad, f"{kind}: restored values differ in {bad}"
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            result = {"ranks": world,
                      "saved_ranks": {"same": 2, "reshard": 4, "dcp": 4}, "mb": args.mb, "tensors": args.tensors,
                      "shape": [rows, args.cols], "repeats": args.repeats, "seconds": times, "median_s": med,
                      "ratio_to_same": {k: med[k] / med["same"] for k in med},
                      "reshard_read_amplification": amplification}
            Path(args.out).write_text(json.dumps(result, indent=2))
    exit_rank()


def main() -> None:
    p = parser(__doc__, repeats=3)
    p.add_argument("--mb", type=int, default=256, help="size of the whole state")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--phase", choices=["save", "restore"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        return phase(args)
    meta = run_meta()
    common = ["--mb", str(args.mb), "--tensors", str(args.tensors), "--cols", str(args.cols),
              "--repeats", str(args.repeats)]
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as work:
        out = Path(work) / "result.json"
        for nproc in (4, 2):
            launch(nproc, "save", "--work", work, *common)
        launch(2, "restore", "--work", work, "--out", str(out), *common)
        result = json.loads(out.read_text())
        leaves_no_shm(work)  # its jobs' memory dirs are under work: a leak would vanish with it
    write_json(args.json, meta, **result)
    if args.json != "-":
        med = result["median_s"]
        print(f"restore of {args.mb} MB at 2 ranks: same world size {med['same']:.3f} s, from 4 ranks "
              f"{med['reshard']:.3f} s ({result['ratio_to_same']['reshard']:.2f}x), dcp.load from 4 ranks "
              f"{med['dcp']:.3f} s ({result['ratio_to_same']['dcp']:.2f}x); read amplification "
              f"{result['reshard_read_amplification']:.2f}")


if __name__ == "__main__":
    main()
