"""An XID-79 eviction against a kill, paired (issue 50 point 6): the survivor's recovery phases
after each, in adjacent runs of the same in-process job (2 ranks + 1 warm spare, the recovery
benchmark's ``inprocess_spare`` rows: benchmarks/recovery_inprocess.py), in A B, B A order so
that a drift in the machine's load falls on both alike.

    python benchmarks/eviction_vs_kill.py --repeats 5 --json OUT

Per pair, xid79 / killed of the survivor's ``abort_s`` (and its parts ``abort_abandon_s``,
``abort_leave_s``; the rest is the garbage collection after them) and of fault -> first resumed
step: the median ratio with its 95 % interval (an interval holding 1.0 is no measured
difference), beside each arm's medians. Every run must end bitwise equal to a clean run.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import abba, paired_ratio, parser, run_meta, write_json  # noqa: E402
from benchmarks.recovery_inprocess import References, run_row  # noqa: E402

ARMS = ("killed", "xid79")
FIGURES = ("fault_to_first_step_s", "abort_s", "abort_abandon_s", "abort_leave_s", "membership_s", "total_s")


def figures(row: dict) -> dict[str, float]:
    return {k: row[k] if k in row else row["phases"][k] for k in FIGURES}


def main() -> None:
    ap = parser(__doc__, repeats=5)
    args = ap.parse_args()
    meta = run_meta(repeats=args.repeats, arms=list(ARMS), mode="inprocess_spare")
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    equal = True
    with tempfile.TemporaryDirectory(prefix="eviction-vs-kill-") as tmp:
        refs = References(Path(tmp))
        for i, order in enumerate(abba(args.repeats)):
            for arm in (ARMS[j] for j in order):
                t0 = time.monotonic()
                with tempfile.TemporaryDirectory(prefix="eviction-vs-kill-") as work:
                    row = run_row(arm, "inprocess_spare", Path(work), refs)
                equal = equal and bool(row["equal_to_clean"])
                runs[arm].append(figures(row))
                print(f"pair {i + 1} {arm}: {runs[arm][-1]} equal={row['equal_to_clean']} "
                      f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    result = {"equal_to_clean": equal, "runs": runs,
              "medians": {arm: {k: statistics.median(r[k] for r in runs[arm]) for k in FIGURES} for arm in ARMS},
              "xid79_over_killed": {k: paired_ratio([r[k] for r in runs["killed"]], [r[k] for r in runs["xid79"]])
                                    for k in FIGURES if all(r[k] > 0 for r in runs["killed"])}}
    for k in FIGURES:
        ratio = result["xid79_over_killed"].get(k)
        print(f"{k:24} killed {result['medians']['killed'][k]:.4f}  xid79 {result['medians']['xid79'][k]:.4f}  "
              + (f"xid79/killed {ratio['median']:.2f} ({ratio['ci_low']:.2f}..{ratio['ci_high']:.2f})"
                 if ratio else ""), file=sys.stderr)
    write_json(args.json, meta, None, **result)


if __name__ == "__main__":
    main()
