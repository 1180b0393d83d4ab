"""The README's quick start (examples/quickstart.py) runs as written, a finished job frees its
shared memory, and a second run says where it resumed from with no logging configured."""
from __future__ import annotations

import os
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
        # the finished job freed its memory slots, so the rerun comes from the disk
        assert "ckpt-guard: restored step 200 from disk" in second.stderr, second.stderr
        assert not _namespaces(root), "a finished job left its slots in /dev/shm"
    finally:  # the example uses the default /dev/shm
        _run("-m", "ckpt.cli", "gc", root)


def _namespaces(root: str) -> list:
    from ckpt.tiers.memory import namespaces_of_root

    return [ns for ns in namespaces_of_root(os.path.realpath(root), "/dev/shm") if ns.exists()]
