"""The README's quick start (examples/quickstart.py) runs as written, and a second run says
where it resumed from, with no logging configured by the program."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def test_quickstart_runs_and_a_resume_says_where_from(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    try:
        first = _run(str(REPO / "examples" / "quickstart.py"), root)
        assert first.returncode == 0, first.stderr
        assert "weights of the last step: ['bias', 'weight']" in first.stdout
        assert "restored step" not in first.stderr
        second = _run(str(REPO / "examples" / "quickstart.py"), root)
        assert second.returncode == 0, second.stderr
        assert "ckpt-guard: restored step 200 from memory" in second.stderr, second.stderr
    finally:  # the example uses the default /dev/shm: its slots go once their steps are on disk
        _run("-m", "ckpt.cli", "gc", root)
