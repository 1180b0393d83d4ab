"""Where ``save()``'s own time on the trainer thread goes, saving every step with
``overlap=True``: an MLP of ``--layers`` Linear layers with AdamW (8 tensors a layer:
weight and bias, two moments and a step each), so ``--tensors 8,72,256`` picks 1, 9 and
32 layers. Each step trains, then saves; ``save()`` is timed with ``time.thread_time()``
(the trainer thread's CPU: the copy and drain threads do not count, a busy machine adds
little), and every other save is profiled with cProfile on the same clock (the median
is of the saves not profiled: the profiler inflates Python-heavy code several-fold). Prints the median per save and the
functions with the most time (``--sort tottime``: their own; ``cumulative``: with what they call). The profiler's
inflation is uneven (Python calls more than torch's or the kernel's), so ``parts`` also times the stages of a save
without it: the named functions below, each wrapped by a ``time.thread_time()`` pair on the training thread in the
steps and saves not profiled (mean per save; stages nest; ``ShmSlot.seal`` is the seal at the next forward, outside
``save()``). Not a test: nothing here asserts a speed.

    PYTHONPATH=. python benchmarks/save_profile.py [--tensors 8,72,256] [--width 256] [--saves 40] \
        [--sort tottime] [--json -]
"""
from __future__ import annotations

import collections
import contextlib
import cProfile
import functools
import importlib
import io
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402

# the stages of a save timed apart, as (module, attribute): functions a save calls through these names
PARTS = [("ckpt.save.save_path", n) for n in ("flatten", "deferrable", "step_written", "param_names", "scope_of",
                                                "optimizers_in", "modules_in", "found_in")] + [
    ("ckpt.save.save_path:SavePath", n) for n in ("stage", "_reserve", "submit", "skip_superseded")] + [
    ("ckpt.save.layout_cache:LayoutCache", "plan"), ("ckpt.save.layout_cache:ParamsCache", "of"),
    ("ckpt.save.flat_cache:FlatCache", "flatten"), ("ckpt.save.flat_cache:FlatCache", "deferrable"),
    ("ckpt.save.overlap:FoundCache", "of"), ("ckpt.tiers.memory.slots:SlotPool", "reserve"),
    ("ckpt.tiers.memory.slots:SlotPool", "start_snapshot"), ("ckpt.tiers.memory.slots:SlotPool", "destinations"),
    ("ckpt.tiers.memory.slots:ShmSlot", "unseal"), ("ckpt.tiers.memory.copier:TensorCopier", "start"),
    ("ckpt.tiers.memory.copier:TensorCopier", "run"),
    ("ckpt.tiers.memory.slots:ShmSlot", "seal")]  # not in save(): the seal at the next forward


@contextlib.contextmanager
def timed_parts(spent: dict[str, list[float]], on: list[bool]) -> Iterator[None]:
    """Wrap each of ``PARTS`` so that, while ``on[0]``, its trainer-thread CPU per call is added to ``spent``."""
    undo = []
    for where, name in PARTS:
        module, _, cls = where.partition(":")
        try:
            owner = importlib.import_module(module)
        except ImportError:  # a tree without this module (the script run against an older checkout)
            continue
        owner = getattr(owner, cls, None) if cls else owner
        fn = getattr(owner, name, None)
        if fn is None:  # a tree without this stage (the script run against an older checkout)
            continue

        @functools.wraps(fn)
        def wrapper(*args: Any, _fn: Any = fn, _label: str = f"{cls or module.rsplit('.', 1)[1]}.{name}",
                    **kwargs: Any) -> Any:
            if not on[0] or threading.current_thread() is not threading.main_thread():
                return _fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_label].append(time.thread_time() - t0)

        setattr(owner, name, wrapper)
        undo.append((owner, name, fn))
    try:
        yield
    finally:
        for owner, name, fn in undo:
            setattr(owner, name, fn)


def profile(tensors: int, width: int, saves: int, top: int, sort: str = "tottime") -> dict[str, Any]:
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
    spent: dict[str, list[float]] = collections.defaultdict(list)
    parts_on = [False]
    try:
        with timed_parts(spent, parts_on), CheckpointManager(work / "root", memory_dir=shm, keep_last=2, state=state,
                                                             overlap=True, drain_interval_s=1.0) as mgr:
            for step in range(saves + 3):
                profiled = step >= 3 and step % 2 == 1  # the first saves start threads and fault slots in
                parts_on[0] = step >= 3 and not profiled  # the step too: it seals the last save
                model(batch).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if profiled:
                    prof.enable()
                t0 = time.thread_time()
                mgr.save(step, state)
                seconds = time.thread_time() - t0
                parts_on[0] = False
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
    stats.sort_stats(sort).print_stats(top)
    funcs = []
    for (file, line, name), (_, calls, tot, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        funcs.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_save": calls / profiled_saves,
                      "tot_ms_per_save": 1e3 * tot / profiled_saves, "cum_ms_per_save": 1e3 * cum / profiled_saves})
    funcs.sort(key=lambda f: -f["tot_ms_per_save" if sort == "tottime" else "cum_ms_per_save"])
    parts = {label: 1e3 * sum(xs) / len(cpu) for label, xs in spent.items()}  # mean per save: a stage may run twice
    n = sum(1 for _ in model.parameters()) * 4
    return {"tensors": n, "layers": layers, "width": width, "saves": len(cpu), "profiled_saves": profiled_saves,
            "save_thread_ms": {"median": 1e3 * statistics.median(cpu), "min": 1e3 * min(cpu), "max": 1e3 * max(cpu)},
            "parts_ms_per_save": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "top": funcs[:top], "text": out.getvalue()}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tensors", default="8,72,256", help="comma-separated tensor counts (8 a layer)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--saves", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", choices=("tottime", "cumulative"), default="tottime",
                    help="the profile's order: a function's own time, or with what it calls")
    args = ap.parse_args()
    meta = run_meta(threads=torch.get_num_threads())
    rows = []
    for n in (int(x) for x in args.tensors.split(",")):
        row = profile(n, args.width, args.saves, args.top, args.sort)
        rows.append(row)
        s = row["save_thread_ms"]
        print(f"{row['tensors']:5d} tensors: save() {s['median']:.2f} ms of trainer-thread CPU (median of "
              f"{row['saves']}; {s['min']:.2f}..{s['max']:.2f}); its stages, not profiled, mean per save (nested):")
        for label, ms in row["parts_ms_per_save"].items():
            print(f"    {ms:7.3f} ms  {label}")
        print(f"  profiled, per save (inflated), by {args.sort}: own ms, with callees ms, calls")
        for f in row["top"][:args.top]:
            print(f"    {f['tot_ms_per_save']:7.3f} {f['cum_ms_per_save']:7.3f}  {f['calls_per_save']:7.1f}x  "
                  f"{f['function']}")
    for row in rows:
        del row["text"]
    write_json(args.json, meta, rows=rows)


if __name__ == "__main__":
    main()
