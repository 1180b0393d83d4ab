#!/usr/bin/env bash
# The recovery engines we build on and measure beside ours (docs/research/recovery-engines.md):
# nvidia-resiliency-ext 0.4.1 (ckpt.integrations.nvrx, the benchmark's NVRx rows) and torchft
# 0.2.0, in a side venv of their own: NVRx pulls a pynvml shim over the nvidia-ml-py the agents
# use, torchft protobuf 7. It sees the main venv's packages (torch, ckpt-guard) through a .pth
# line, so pip finds torch installed and leaves it alone.
set -euo pipefail
BASE=${1:-.venv}
VENV=${2:-.venv-engines}
[ -x "$VENV/bin/python" ] || "$BASE/bin/python" -m venv "$VENV"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib "$BASE/bin/python" > "$(purelib "$VENV/bin/python")/shared-venv.pth"
"$VENV/bin/python" -m pip install -q nvidia-resiliency-ext==0.4.1 torchft==0.2.0  # the [nvrx] extra's pin
