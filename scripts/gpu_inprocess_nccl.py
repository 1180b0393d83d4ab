"""In-process recovery's two GPU-only paths, at world size 1 (NCCL allows one rank per GPU):

1. a NCCL group is joined, used, left (``ckpt.inprocess.group.leave``: forgotten at once, its
   communicator shut down on a daemon thread) and a new one joined and used, as a survivor
   does in each recovery; timed, and nothing may stay held;
2. a sticky CUDA error (an illegal address from a raw kernel, a device-side assert) is
   classified as one that leaves the process (``runner._must_leave``), and the context is
   really unusable afterwards (so resuming in place would be wrong). Each case runs in a child
   process: the error poisons the context for good.

    python scripts/gpu_inprocess_nccl.py [--json OUT]

Prints one JSON object; exits non-zero if a check fails. Needs CUDA; CuPy for the
illegal-address case (skipped with a reason without it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = r"""
import sys, torch
from ckpt.inprocess.runner import _must_leave
case = sys.argv[1]
try:
    if case == "illegal_address":
        import cupy
        bad = cupy.RawKernel(r'extern "C" __global__ void bad(int* p) { p[1ll << 40] = 1; }', "bad")
        x = cupy.zeros(1, dtype=cupy.int32)
        bad((1,), (1,), (x,))
        cupy.cuda.runtime.deviceSynchronize()
    else:
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 20], device="cuda")] = 1.0  # index out of range: a device-side assert
    torch.cuda.synchronize()
    print("no error")
    sys.exit(3)
except Exception as e:
    text = str(e).splitlines()[0]
    err = ("CUDA error: " + text) if "CUDA error" not in text else text  # CuPy words it its own way
    leaves = _must_leave(RuntimeError(err))
    try:
        torch.ones(1, device="cuda").add_(1).cpu()
        sticky = False
    except Exception:
        sticky = True
    import json
    print(json.dumps({"case": case, "error": text[:160], "classified_sticky": leaves, "context_unusable": sticky}))
"""


def nccl_rounds(rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from ckpt.inprocess import group
    from tests.procs import free_port

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    times = []
    for r in range(rounds):
        t0 = time.monotonic()
        group.join(store, r, 0, 1, 60.0, backend="nccl")
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        t1 = time.monotonic()
        group.leave()
        t2 = time.monotonic()
        while group.leaked() and time.monotonic() - t2 < 60:
            time.sleep(0.005)
        t3 = time.monotonic()
        times.append({"round": r, "join_and_all_reduce_s": round(t1 - t0, 4), "leave_s": round(t2 - t1, 4),
                      "communicator_shut_down_s": round(t3 - t2, 4), "held_after": group.leaked(),
                      "all_reduce_ok": bool(t[0].item() == 1.0)})
    return {"rounds": times, "ok": all(x["held_after"] == 0 and x["all_reduce_ok"] for x in times)}


def sticky(case: str) -> dict:
    if case == "illegal_address":
        try:
            import cupy  # noqa: F401
        except ImportError:
            return {"case": case, "skipped": "CuPy is not installed"}
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    res = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, env=env, timeout=300)
    line = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    try:
        out = json.loads(line)
    except ValueError:
        return {"case": case, "ok": False, "rc": res.returncode, "stderr": res.stderr[-600:]}
    out["ok"] = out["classified_sticky"] and out["context_unusable"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "nccl_group_rounds": nccl_rounds(args.rounds),
              "sticky_errors": [sticky("illegal_address"), sticky("device_assert")]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    ok = result["nccl_group_rounds"]["ok"] and all(s.get("ok", True) for s in result["sticky_errors"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
