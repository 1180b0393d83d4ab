"""Interleaved A/B of a benchmark between two checkouts: runs alternate (A, B, A, B, …)
so that a noisy machine disturbs both sides alike; prints the median of every
numeric result per side, the ratio B/A of the medians, and the median of the per-run ratios
with its 95 % confidence interval (an interval that holds 1.00 is no measured difference).

    python benchmarks/ab.py --a /path/to/old-checkout --b . --runs 5 -- \\
        benchmarks/ckpt_bench.py --config medium --repeats 3

The benchmark (a path relative to each checkout) must accept ``--json PATH``. Each side
runs with its own checkout first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import paired_ratio, parser, run_meta, write_json  # noqa: E402


def run_once(checkout: Path, bench: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run([sys.executable, str(checkout / bench[0]), *bench[1:], "--json", str(out)], env=env,
                   cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--a", required=True, type=Path, help="checkout A (before)")
    ap.add_argument("--b", required=True, type=Path, help="checkout B (after)")
    ap.add_argument("--runs", type=int, default=5, help="runs per side")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- benchmark script and its arguments")
    args = ap.parse_args()
    meta = run_meta()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    results: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for side in ("a", "b"):
                got = run_once(getattr(args, side).resolve(), bench, Path(tmp) / f"{side}{i}.json")
                results[side].append(got)
                print(f"run {i + 1}/{args.runs} {side} done", file=sys.stderr, flush=True)
    keys = [k for k, v in results["a"][0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    table = {}
    print(f"| {'metric':32} | {'A median':>10} | {'B median':>10} | B/A | per run B/A (95 % CI) |")
    print(f"|{'-' * 34}|{'-' * 12}|{'-' * 12}|-----|----------------------|")
    for k in keys:
        pairs = [(ra[k], rb[k]) for ra, rb in zip(results["a"], results["b"]) if k in ra and k in rb]
        a, b = (statistics.median(side) for side in zip(*pairs))
        paired = paired_ratio(*map(list, zip(*pairs))) if all(x for x, _ in pairs) else None
        table[k] = {"a": a, "b": b, "ratio": b / a if a else None, "paired": paired}
        ci = f"{paired['median']:.2f} ({paired['ci_low']:.2f}..{paired['ci_high']:.2f})" if paired else "-"
        print(f"| {k:32} | {a:10.4g} | {b:10.4g} | {b / a if a else float('nan'):.2f} | {ci:20} |")
    write_json(args.json, meta, runs=args.runs, bench=bench, medians=table, raw=results)


if __name__ == "__main__":
    main()
