"""benchmarks/recovery_engines.py's rows, in the recovery benchmark's schema, name why an engine
was not run (the engines themselves run in their own venv: docs/research/recovery-engines.md)."""
from __future__ import annotations

from benchmarks.recovery_engines import CASES, ENGINES, rows


def test_an_engine_that_is_not_there_gives_skipped_rows_that_say_why(tmp_path):
    missing = str(tmp_path / "no-python")
    got = rows(python=missing)
    assert [(r["case"], r["mode"]) for r in got] == [(c, m) for m in ENGINES for c in CASES]
    assert all(missing in r["skipped"] and "does not exist" in r["skipped"] for r in got)
