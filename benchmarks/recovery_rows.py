"""The recovery benchmark's row schema, shared by its driver (recovery_bench) and the other
engines' rows (recovery_engines): one row per (case, mode), the median of its runs."""
from __future__ import annotations


def median_row(rows: list[dict]) -> dict:
    """The run with the median fault-to-first-step time (its fields stay consistent, where
    per-field medians would pair one run's detection with another's total), every run's
    time beside it (a bimodal engine shows as such), and ``equal_to_clean`` only if every
    run was."""
    ordered = sorted(rows, key=lambda r: r["fault_to_first_step_s"] or 0.0)
    row = {**ordered[(len(ordered) - 1) // 2], "runs_fault_to_first_step_s": [r["fault_to_first_step_s"] for r in rows]}
    if all(r.get("equal_to_clean") is not None for r in rows):
        row["equal_to_clean"] = all(r["equal_to_clean"] for r in rows)
    return row
