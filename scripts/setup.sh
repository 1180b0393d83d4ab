#!/usr/bin/env bash
# Fresh-machine set-up: a virtual environment with the CPU torch wheel, the package
# with its test extras, and the Debian tools the tests drive (promtool, Alertmanager).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: this version is served from a local CPU wheel; an unpinned
# resolve would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[test]'
if [ -f scripts/apt-packages.txt ]; then
    missing=()
    while read -r pkg bin; do
        [ -z "$pkg" ] || [[ "$pkg" == \#* ]] && continue
        command -v "$bin" >/dev/null 2>&1 || missing+=("$pkg")
    done < scripts/apt-packages.txt
    if [ ${#missing[@]} -gt 0 ]; then
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi
