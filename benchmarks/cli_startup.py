"""How fast the ``ckpt`` command answers: ``--help``, ``ls`` and ``verify`` on a local root
holding a small checkpoint (disk and memory tiers), against the floor of starting the
same Python interpreter and doing nothing. Medians of ``--runs`` runs.

    python benchmarks/cli_startup.py [--runs 15] [--json out.json]

Target (issue: polish): each under 0.5 s on an idle machine. Load from other
processes moves every row alike: read the ``over floor`` column.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.harness import leaves_no_shm, median_time, parser, run_meta, write_json  # noqa: E402


def median_wall(cmd: list[str], runs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return median_time(lambda: subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL), runs)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    meta = run_meta()
    import torch

    from ckpt import CheckpointManager

    base = Path(tempfile.mkdtemp(prefix="ckpt-cli-bench-"))
    shm = tempfile.mkdtemp(prefix="ckpt-cli-bench-", dir="/dev/shm")
    try:
        root = base / "root"
        with CheckpointManager(root, memory_dir=shm) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": torch.randn(1 << 18), "step": step}).wait()
        ckpt = [sys.executable, "-m", "ckpt.cli"]
        res = {"runs": args.runs, "floor_s": median_wall([sys.executable, "-c", "pass"], args.runs)}
        for name, argv in (("help", ["--help"]), ("ls", ["ls", str(root), "--memory-dir", shm]),
                           ("verify", ["verify", str(root), "--memory-dir", shm])):
            res[f"{name}_s"] = median_wall(ckpt + argv, args.runs)
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["load_avg_1m"] = os.getloadavg()[0]
    print(f"median of {args.runs}; 1-minute load average {res['load_avg_1m']:.1f} on {os.cpu_count()} cores\n")
    print(f"| {'command':28} | seconds | over floor |")
    print(f"|{'-' * 30}|---------|------------|")
    print(f"| {'python -c pass (floor)':28} | {res['floor_s']:7.3f} |            |")
    for name in ("help", "ls", "verify"):
        label = f"ckpt {name}" if name != "help" else "ckpt --help"
        print(f"| {label:28} | {res[f'{name}_s']:7.3f} | {res[f'{name}_s'] - res['floor_s']:+9.3f}s |")
    write_json(args.json, meta, **res)


if __name__ == "__main__":
    main()
