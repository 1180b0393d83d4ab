#!/usr/bin/env bash
# The Debian tools the tests drive (scripts/apt-packages.txt: promtool, Alertmanager, munge
# and Slurm), installed only where missing. `make test` runs this; the demo needs none of them.
set -euo pipefail
if [ -f scripts/apt-packages.txt ]; then
    missing=()
    while read -r pkg bin; do
        [ -z "$pkg" ] || [[ "$pkg" == \#* ]] && continue
        PATH="$PATH:/usr/sbin" command -v "$bin" >/dev/null 2>&1 || missing+=("$pkg")  # munged, slurmd: sbin
    done < scripts/apt-packages.txt
    if [ ${#missing[@]} -gt 0 ]; then
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi
