"""benchmarks/recovery_engines.py's rows, in the recovery benchmark's schema, name why an engine
was not run (the engines themselves run in their own venv: docs/research/recovery-engines.md)."""
from __future__ import annotations

from benchmarks.recovery_engines import CASES, ENGINES, rows
from benchmarks.recovery_rows import median_row


def test_an_engine_that_is_not_there_gives_skipped_rows_that_say_why(tmp_path):
    missing = str(tmp_path / "no-python")
    got = rows(python=missing)
    assert [(r["case"], r["mode"]) for r in got] == [(c, m) for m in ENGINES for c in CASES]
    assert all(missing in r["skipped"] and "does not exist" in r["skipped"] for r in got)


def test_a_row_is_the_median_run_whole_with_every_run_beside_it():
    """Per-field medians paired one run's detection with another's total (torchft's hung row: a
    5 s detection beside a 1.03 s total); a row is now one run, the median one."""
    runs = [{"fault_to_first_step_s": 1.0, "detect_s": None, "equal_to_clean": True},
            {"fault_to_first_step_s": 5.2, "detect_s": 5.0, "equal_to_clean": True},
            {"fault_to_first_step_s": 0.9, "detect_s": None, "equal_to_clean": False}]
    row = median_row(runs)
    assert row["fault_to_first_step_s"] == 1.0 and row["detect_s"] is None
    assert row["runs_fault_to_first_step_s"] == [1.0, 5.2, 0.9] and row["equal_to_clean"] is False
