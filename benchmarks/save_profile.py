"""Where ``save()``'s own time on the trainer thread goes, saving every step with
``overlap=True``: an MLP of ``--layers`` Linear layers with AdamW (8 tensors a layer:
weight and bias, two moments and a step each), so ``--tensors 8,72,256`` picks 1, 9 and
32 layers. Each step trains, then saves; ``save()`` is timed with ``time.thread_time()``
(the trainer thread's CPU: the copy and drain threads do not count, a busy machine adds
little), and every other save is profiled with cProfile on the same clock (the median
is of the saves not profiled: the profiler inflates Python-heavy code several-fold). Prints the median per save and the
functions with the most cumulative time. Not a test: nothing here asserts a speed.

    PYTHONPATH=. python benchmarks/save_profile.py [--tensors 8,72,256] [--width 256] [--saves 40] [--json -]
"""
from __future__ import annotations

import cProfile
import io
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402


def profile(tensors: int, width: int, saves: int, top: int) -> dict[str, Any]:
    """``saves`` overlapped saves of a model with ``tensors`` tensors (rounded to 8 a layer)."""
    torch.manual_seed(0)
    layers = max(1, tensors // 8)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(32, width)
    model(batch).square().mean().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    work = Path(tempfile.mkdtemp(prefix="save-profile-"))
    shm = tempfile.mkdtemp(prefix="save-profile-", dir="/dev/shm")
    prof = cProfile.Profile(time.thread_time)
    cpu = []
    try:
        with CheckpointManager(work / "root", memory_dir=shm, keep_last=2, state=state, overlap=True,
                               drain_interval_s=1.0) as mgr:
            for step in range(saves + 3):
                model(batch).square().mean().backward()
                opt.step()
                opt.zero_grad()
                profiled = step >= 3 and step % 2 == 1  # the first saves start threads and fault slots in
                if profiled:
                    prof.enable()
                t0 = time.thread_time()
                mgr.save(step, state)
                seconds = time.thread_time() - t0
                if profiled:
                    prof.disable()
                elif step >= 3:
                    cpu.append(seconds)
            mgr.wait()
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    profiled_saves = sum(1 for step in range(3, saves + 3) if step % 2 == 1)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    funcs = []
    for (file, line, name), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        funcs.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_save": calls / profiled_saves,
                      "cum_ms_per_save": 1e3 * cum / profiled_saves})
    funcs.sort(key=lambda f: -f["cum_ms_per_save"])
    n = sum(1 for _ in model.parameters()) * 4
    return {"tensors": n, "layers": layers, "width": width, "saves": len(cpu), "profiled_saves": profiled_saves,
            "save_thread_ms": {"median": 1e3 * statistics.median(cpu), "min": 1e3 * min(cpu), "max": 1e3 * max(cpu)},
            "top": funcs[:top], "text": out.getvalue()}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tensors", default="8,72,256", help="comma-separated tensor counts (8 a layer)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--saves", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    meta = run_meta(threads=torch.get_num_threads())
    rows = []
    for n in (int(x) for x in args.tensors.split(",")):
        row = profile(n, args.width, args.saves, args.top)
        rows.append(row)
        s = row["save_thread_ms"]
        print(f"{row['tensors']:5d} tensors: save() {s['median']:.2f} ms of trainer-thread CPU (median of "
              f"{row['saves']}; {s['min']:.2f}..{s['max']:.2f}); profiled, per save (inflated):")
        for f in row["top"][:args.top]:
            print(f"    {f['cum_ms_per_save']:7.3f} ms  {f['calls_per_save']:7.1f}x  {f['function']}")
    for row in rows:
        del row["text"]
    write_json(args.json, meta, rows=rows)


if __name__ == "__main__":
    main()
