#!/usr/bin/env bash
# Fresh-machine set-up: a virtual environment with the CPU torch wheel and the package
# with its test extras. The Debian tools only the tests drive (promtool, Alertmanager)
# come from scripts/test-tools.sh, which `make test` runs and `make demo` does not.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: this version is served from a local CPU wheel; an unpinned
# resolve would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[test]'
