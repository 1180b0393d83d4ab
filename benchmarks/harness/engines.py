"""The other recovery engines (NVIDIA Resiliency Extension, torchft) live in a venv of their
own, ``.venv-engines`` (``make engines``): their pins clash with ours. A driver finds that
interpreter here, asks whether an engine imports in it (a row skipped says why), and names
the versions it ran in its meta block."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from benchmarks.harness.meta import REPO

DEFAULT_ENGINES_PYTHON = str(REPO / ".venv-engines" / "bin" / "python")  # make engines
ENGINES_PYTHON_ENV = "RECOVERY_ENGINES_PYTHON"
PACKAGES = ("torch", "nvidia-resiliency-ext", "torchft")


def engines_python() -> str:
    """The engines' interpreter: ``$RECOVERY_ENGINES_PYTHON``, else the repository's .venv-engines."""
    return os.environ.get(ENGINES_PYTHON_ENV, DEFAULT_ENGINES_PYTHON)


def engine_available(python: str, module: str) -> str | None:
    """None if ``module`` imports in ``python``, else why not (the error's last line)."""
    if not Path(python).exists():
        return f"{python} does not exist"
    proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def engine_versions(python: str) -> dict[str, str]:
    """The versions of torch and the engines in ``python`` (those installed)."""
    code = ("import importlib.metadata as m\nfor p in %r:\n    try: print(p, m.version(p))\n"
            "    except m.PackageNotFoundError: pass" % (PACKAGES,))
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=False).stdout
    except OSError:
        return {}
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
