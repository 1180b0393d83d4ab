"""The engine's own cost per save and per restore, apart from moving bytes: a state of
many small tensors (2,000 x 256 B by default), so the copy is negligible and what is
timed is flattening, planning, sealing, the drain's bookkeeping and the restore path.
Minimum and median over many calls: contention only ever adds time, so on a shared
machine the minimum is the figure to compare (e.g. old against new checkouts with
``benchmarks/ab.py``).

    python benchmarks/save_overhead.py [--tensors 2000] [--saves 60] [--json out.json]
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--saves", type=int, default=60)
    args = ap.parse_args()
    meta = run_meta()
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(args.numel) for i in range(args.tensors)}
    base = Path(tempfile.mkdtemp(prefix="ckpt-overhead-"))
    shm = tempfile.mkdtemp(prefix="ckpt-overhead-", dir="/dev/shm")
    blocking, durable, restore = [], [], []
    try:
        with CheckpointManager(base / "root", memory_dir=shm, keep_last=2, state=state) as mgr:
            for step in range(1, args.saves + 6):
                h = mgr.save(step, state)
                h.wait()
                if step > 5:  # the first saves warm caches and allocate
                    blocking.append(h.blocking_s)
                    durable.append(h.durable_s["disk"])
            for _ in range(max(5, args.saves // 3)):
                t0 = time.perf_counter()
                mgr.restore(state)
                restore.append(time.perf_counter() - t0)
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res = {"tensors": args.tensors, "numel": args.numel}
    for name, xs in (("save_blocking", blocking), ("save_durable_disk", durable), ("restore_memory", restore)):
        res[f"{name}_min_ms"] = 1e3 * min(xs)
        res[f"{name}_median_ms"] = 1e3 * statistics.median(xs)
    for k, v in res.items():
        print(f"{k:28} {v:9.2f}" if isinstance(v, float) else f"{k:28} {v}")
    write_json(args.json, meta, **res)


if __name__ == "__main__":
    main()
