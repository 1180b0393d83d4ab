"""How soon an in-process launcher's workers can train: forked from the preloaded template
(``--preload torch``, the default) against ``python <command>`` (``--no-preload``).

    python benchmarks/inprocess_start.py [--runs 3] [--nproc 2] [--json out.json]

Each run launches ``--nproc`` workers that import torch and join a gloo group on the launcher's
store, then ask for a relaunch (exit 75); the relaunched workers join again and end. Per mode, the
medians of: the first start (launcher started -> the worker's first line, -> every worker joined),
the relaunch (the last worker of attempt 0 gone -> every worker of attempt 1 joined), and the CPU
(user + sys) of the launcher with everything it started. Load from other processes lengthens the
wall times; the CPU is the steadier figure.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402

WORKER = """
import time
first = time.time()
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
rank, world, attempt = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["CKPT_INPROCESS_ATTEMPT"]
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=dist.PrefixStore(f"bench/{attempt}", store), rank=rank, world_size=world)
dist.barrier()
joined = time.time()
dist.destroy_process_group()
line = json.dumps({"attempt": int(attempt), "first": first, "joined": joined, "gone": time.time()})
os.write(1, f"BENCH {line}\\n".encode())  # one write: the workers share the launcher's stdout
sys.exit(75 if attempt == "0" else 0)
"""


def one(script: Path, nproc: int, preload: bool) -> dict[str, float]:
    """One launch: its start and relaunch times (s) and its CPU (s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", "--nproc", str(nproc), "--relaunches", "1",
           *([] if preload else ["--no-preload"]), str(script)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    assert out.returncode == 0 and len(lines) == 2 * nproc, out.stderr[-3000:]
    first = [x for x in lines if x["attempt"] == 0]
    again = [x for x in lines if x["attempt"] == 1]
    return {"first_line_s": min(x["first"] for x in first) - started,
            "joined_s": max(x["joined"] for x in first) - started,
            "relaunch_joined_s": max(x["joined"] for x in again) - max(x["gone"] for x in first),
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        runs: dict[str, list[dict[str, float]]] = {"popen": [], "preload": []}
        for _ in range(args.runs):  # alternated: load changes hit both alike
            for mode in runs:
                runs[mode].append(one(script, args.nproc, mode == "preload"))
    rows = {mode: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]} for mode, rs in runs.items()}
    for mode, row in rows.items():
        print(f"{mode:8} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
    write_json(args.json, run_meta(), nproc=args.nproc, runs=args.runs, medians=rows)


if __name__ == "__main__":
    main()
