"""Step-time overhead of saving every step: ours with ``overlap=True``, the same with the
lower tiers paced (``paced``: ``drain_interval_s``, the memory tier still takes every
step), ours blocking (``overlap=False``), and torch DCP's zero-overhead configuration (``dcp.async_save`` with
``DefaultStager(StagingOptions(...))``: pinned and shared memory where there is a GPU,
asynchronous staging, non-blocking copies; staging awaited before ``optimizer.step()``
and the previous save's write before the next save, as torchtitan does), each against
not saving, on the same model, bytes and process.

A real training loop (an MLP with AdamW, ``--width`` x ``--layers``, batch ``--batch``)
runs in blocks of ``--block`` steps; each round runs one block of every arm, in the
order none, overlap, paced, blocking, dcp, then reversed in the next round, so that drifting
load on a shared machine hits every arm alike. A block's figure is its mean step time;
each arm's is the median over rounds, and the per-round ratio to that round's
"none" block gives the spread. Between blocks each arm's background work is waited
for, untimed (the paced arm's last drain too: make blocks last several intervals). Our
disk root and DCP's directory are on the same filesystem (``--dir``, default the
temporary directory). The memcpy floor of the state's bytes is
measured in the same run. Not a test: nothing here asserts a speed.

    PYTHONPATH=. python benchmarks/overlap_bench.py [--device cpu|cuda] [--rounds 6] [--json out.json | --json -]
    PYTHONPATH=. python benchmarks/overlap_bench.py --arms none,overlap,verified   # overlap_verify's cost
    PYTHONPATH=. python benchmarks/overlap_bench.py --arms none,overlap --tensors 8,64,256   # save() by tensor count
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.torch_version import TorchVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import leaves_no_shm, memcpy_floor, parser, run_meta, spread, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402

ARMS = ("none", "overlap", "paced", "blocking", "dcp", "verified")
DEFAULT_ARMS = ARMS[:5]  # "verified" (overlap_verify=True: the staged bytes compared at the seal) on request


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class DcpSaver:
    """DCP's zero-overhead path, as torchtitan drives it."""

    def __init__(self, directory: Path, device: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = device == "cuda"
        self._dcp, self.dir = dcp, directory
        self.options = StagingOptions(use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=True,
                                      use_non_blocking_copy=gpu)
        self._new_stager = lambda: DefaultStager(self.options)
        # torch before 2.13 closes the stager's copy table and staged buffers at the end of
        # every staging (torch 2.11 on an H100: the next save failed in the cleared table), so
        # there each save gets a new stager, paying the allocation DCP itself pays there.
        self._stager_per_save = TorchVersion(torch.__version__) < (2, 13)
        self._stager = self._new_stager()
        self._response = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait_upload()  # one save in flight at a time
        if self._stager_per_save:
            self._stager.close()
            self._stager = self._new_stager()
        self._response = self._dcp.async_save(state, checkpoint_id=str(self.dir / f"step-{step % 2}"),
                                              async_stager=self._stager, no_dist=True)

    def wait_staged(self) -> None:
        if self._response is not None:
            self._response.staging_completion.result()

    def wait_upload(self) -> None:
        if self._response is not None:
            self._response.staging_completion.result()
            self._response.upload_completion.result()
            self._response = None

    def close(self) -> None:
        self.wait_upload()
        self._stager.close()


def run_block(arm: str, steps: int, model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor,
              save: Callable[[int], Any], before_step: Callable[[], None], counter: list[int],
              blocking: list[float], staging_wait: list[float],
              save_cpu: list[float] | None = None) -> tuple[float, float, float]:
    """Mean seconds per step over ``steps`` steps, each followed by a save (but for "none"):
    wall-clock, the process's CPU (training, copy and drain threads) and the training thread's CPU.
    ``blocking`` gets each save's wall-clock seconds, ``save_cpu`` its training-thread CPU seconds."""
    sync(batch.device.type)
    t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        loss = model(batch).float().square().mean()
        loss.backward()
        w0 = time.perf_counter()
        before_step()
        staging_wait[0] += time.perf_counter() - w0
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter[0] += 1
        if arm != "none":
            s0, st0 = time.perf_counter(), time.thread_time()
            save(counter[0])
            blocking.append(time.perf_counter() - s0)
            if save_cpu is not None:
                save_cpu.append(time.thread_time() - st0)
    sync(batch.device.type)
    return ((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps,
            (time.thread_time() - th0) / steps)


def one_thread_copy_s(state_tensors: list[torch.Tensor], repeats: int = 5) -> float:
    """CPU state: seconds one thread takes to copy it (numpy, as the overlapped copy does),
    best of ``repeats``. When training keeps every core busy this is the copy's floor on
    the step: its CPU time is taken from the step whenever it runs."""
    outs = [np.empty(t.numel() * t.element_size(), dtype=np.uint8) for t in state_tensors]
    srcs = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in state_tensors]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for o, t in zip(outs, srcs):
            np.copyto(o, t)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(args: argparse.Namespace, arms: list[str]) -> dict[str, Any]:
    """Every arm on one model (``args.layers`` layers), in rounds; the figures of one configuration."""
    model, opt = build(args)
    batch = torch.randn(args.batch, args.width, device=args.device)
    model(batch).square().mean().backward()
    opt.step()  # the optimizer's state exists before any save
    state = {"model": model, "optim": opt}
    tensors = list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()
                                                     if isinstance(v, torch.Tensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    work = Path(tempfile.mkdtemp(prefix="overlap-bench-", dir=args.dir))
    shm = [tempfile.mkdtemp(prefix="overlap-bench-", dir="/dev/shm") for _ in range(4)]
    counter, blocking, save_cpu = [0], {a: [] for a in arms}, {a: [] for a in arms}
    blocks: list[dict[str, Any]] = []
    try:
        paced = {"overlap": True, "drain_interval_s": args.drain_interval_s}
        options = {"overlap": {"overlap": True}, "paced": paced, "blocking": {},
                   "verified": {"overlap": True, "overlap_verify": True}}
        ours = {a: CheckpointManager(work / a, memory_dir=m, keep_last=2, state=state, **options[a])
                for a, m in zip(options, shm) if a in arms}
        dcp = DcpSaver(work / "dcp", args.device) if "dcp" in arms else None
        savers: dict[str, tuple[Callable[[int], Any], Callable[[], None], Callable[[], None]]] = {
            "none": (lambda s: None, lambda: None, lambda: None)}
        for a, mgr in ours.items():
            savers[a] = (lambda s, m=mgr: m.save(s, state), lambda: None, mgr.wait)
        if dcp is not None:
            savers["dcp"] = (lambda s: dcp.save(s, {"model": model.state_dict(), "optim": opt.state_dict()}),
                             dcp.wait_staged, dcp.wait_upload)
        for a in arms:  # warm-up: allocation, first-touch, thread pools
            run_block(a, 2, model, opt, batch, savers[a][0], savers[a][1], counter, [], [0.0])
            savers[a][2]()
        floor = memcpy_floor(tensors, 5, stat=min)[0]
        copy_1t = one_thread_copy_s(tensors) if args.device == "cpu" else None
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for a in order:
                save, before_step, settle = savers[a]
                waited = [-ours[a].staged_wait_s if a in ours else 0.0]  # the pre-hook's waits, or DCP's
                mean, cpu, thread = run_block(a, args.block, model, opt, batch, save, before_step, counter,
                                              blocking[a], waited, save_cpu[a])
                waited[0] += ours[a].staged_wait_s if a in ours else 0.0
                c0 = time.process_time()
                settle()  # what a block left to do in the background counts in its CPU, not its steps
                cpu += (time.process_time() - c0) / args.block
                stall = (sum(blocking[a][-args.block:]) if a != "none" else 0.0) + waited[0]
                blocks.append({"round": r, "arm": a, "mean_step_s": mean, "cpu_per_step_s": cpu,
                               "train_thread_cpu_per_step_s": thread, "trainer_stall_per_step_s": stall / args.block,
                               "loadavg_1min": os.getloadavg()[0]})
                print(f"round {r} {a:9} {1e3 * mean:8.1f} ms/step, CPU {1e3 * cpu:8.1f} ms/step "
                      f"(training thread {1e3 * thread:.1f})", file=sys.stderr)
        slot_stall = {a: mgr.stall_s for a, mgr in ours.items()}
        for mgr in ours.values():
            mgr.close()
        if dcp is not None:
            dcp.close()
        leaves_no_shm(*shm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for m in shm:
            shutil.rmtree(m, ignore_errors=True)
    step = {a: [b["mean_step_s"] for b in blocks if b["arm"] == a] for a in arms}
    cpu = {a: [b["cpu_per_step_s"] for b in blocks if b["arm"] == a] for a in arms}
    by_round = {(b["round"], b["arm"]): b["mean_step_s"] for b in blocks}
    out: dict[str, Any] = {
        "drain_interval_s": args.drain_interval_s,
        "model": {"width": args.width, "layers": args.layers, "batch": args.batch, "optimizer": "AdamW"},
        "state_bytes": state_bytes, "memcpy_floor_s": floor, "one_thread_copy_s": copy_1t,
        "rounds": args.rounds, "block_steps": args.block,
        "dcp_staging_options": vars(dcp.options) if dcp is not None else None,
        "dcp_stager_per_save": dcp._stager_per_save if dcp is not None else None,
        "mean_step_s": {a: spread(xs) for a, xs in step.items()},
        "cpu_per_step_s": {a: spread(xs) for a, xs in cpu.items()},
        "save_call_s": {a: spread(xs) for a, xs in blocking.items() if xs},
        "save_thread_cpu_s": {a: spread(xs) for a, xs in save_cpu.items() if xs},  # save()'s training-thread CPU
        "slot_wait_s": slot_stall,
        "trainer_stall_per_step_s": {a: spread([b["trainer_stall_per_step_s"] for b in blocks if b["arm"] == a])
                                     for a in arms if a != "none"},
        "blocks": blocks,
    }
    if "none" in arms:
        base = statistics.median(step["none"])
        out["overhead"] = {a: statistics.median(step[a]) / base - 1 for a in arms if a != "none"}
        out["cpu_overhead"] = {a: statistics.median(cpu[a]) / statistics.median(cpu["none"]) - 1
                               for a in arms if a != "none"}
        out["paired_overhead"] = {a: spread([by_round[(r, a)] / by_round[(r, "none")] - 1 for r in range(args.rounds)])
                                  for a in arms if a != "none"}
    base_s = statistics.median(step.get("none", [0]))
    print(f"state {state_bytes / 2**20:.0f} MiB, memcpy floor {1e3 * floor:.1f} ms; step without saving "
          f"{1e3 * base_s:.1f} ms")
    if copy_1t is not None and base_s:
        out["copy_floor_overhead"] = copy_1t / base_s
        print(f"one thread copies the state in {1e3 * copy_1t:.1f} ms: {100 * copy_1t / base_s:.1f} % of a step, "
              "the floor on the overhead when training keeps every core busy")
    for a in arms:
        if a == "none":
            continue
        line = f"{a:9} mean step {1e3 * statistics.median(step[a]):8.1f} ms"
        if "overhead" in out:
            p = out["paired_overhead"][a]
            line += (f"  overhead {100 * out['overhead'][a]:+6.1f} % (per round: median {100 * p['median']:+.1f} %, "
                     f"{100 * p['min']:+.1f}..{100 * p['max']:+.1f})")
        if "cpu_overhead" in out:
            line += f"  CPU {100 * out['cpu_overhead'][a]:+.1f} %"
        if a in out["save_call_s"]:
            line += (f"  save() returns in {1e3 * out['save_call_s'][a]['median']:.2f} ms "
                     f"({1e3 * out['save_thread_cpu_s'][a]['median']:.2f} ms of training-thread CPU), the trainer "
                     f"waits {1e3 * out['trainer_stall_per_step_s'][a]['median']:.2f} ms per step in all")
        print(line)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tensors", default=None,
                    help="comma-separated tensor counts, one run each: 8 a layer (weight and bias, each with 2 moments "
                         "and a step), so --tensors 8,64,256 runs 1, 8 and 32 layers (instead of --layers)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=8, help="steps per block")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--drain-interval-s", type=float, default=1.0,
                    help="the paced arm: overlap=True with this drain_interval_s (blocks should last several)")
    ap.add_argument("--dir", default=None, help="where the disk root and DCP's directory go")
    args = ap.parse_args()
    arms = [a for a in ARMS if a in args.arms.split(",")]
    meta = run_meta(threads=torch.get_num_threads(),
                    device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu")
    if args.tensors is None:
        write_json(args.json, meta, **measure(args, arms))
        return
    runs = []
    for n in (int(x) for x in args.tensors.split(",")):
        args.layers = max(1, n // 8)
        print(f"-- {8 * args.layers} tensors ({args.layers} layers of {args.width})")
        runs.append({"tensors": 8 * args.layers, **measure(args, arms)})
    print("tensors  arm        save() training-thread CPU, median ms (min..max)")
    for run in runs:
        for a, xs in run["save_thread_cpu_s"].items():
            lo, hi = 1e3 * xs["min"], 1e3 * xs["max"]
            print(f"{run['tensors']:7d}  {a:9} {1e3 * xs['median']:8.2f}  ({lo:.2f}..{hi:.2f})")
    write_json(args.json, meta, by_tensors=runs)


if __name__ == "__main__":
    main()
