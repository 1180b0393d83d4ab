"""The ``meta`` block every results file opens with: what ran (command line, git commit), where
(machine, torch), when, and the machine's load before and after. A figure without these cannot
be quoted: the docs put the command beside every number."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str | None:
    """HEAD of the checkout that ran, with ``-dirty`` when it had uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=40"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head or None


def torch_version() -> str | None:
    """torch's version without importing it (a driver may not need torch at all)."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def run_meta(**extra: Any) -> dict[str, Any]:
    """The meta block, taken when the run starts (``write_json`` adds the load after)."""
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
            "python": platform.python_version(), "torch": torch_version(), "git_commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load": list(os.getloadavg()), **extra}


def write_json(path: str | None, meta: dict[str, Any], rows: list[dict] | None = None, *, echo: bool = False,
               **fields: Any) -> dict:
    """Write ``{"meta": ..., "rows": [...], **fields}`` to ``path`` ('-': stdout; None: nowhere),
    also to stdout with ``echo``, and return it. ``rows`` is left out when None: a script with
    one result per run keeps its fields at the top level, where ``benchmarks/ab.py`` reads them."""
    out = {"meta": {**meta, "load_after": list(os.getloadavg())}, **({"rows": rows} if rows is not None else {}),
           **fields}
    text = json.dumps(out, indent=2)
    if path and path != "-":
        Path(path).write_text(text + "\n")
    if echo or path == "-":
        print(text)
    return out
