#!/usr/bin/env bash
# Which capabilities the node agent needs to reclaim another user's checkpoint shared memory
# (docs/agents.md, "Shared memory of jobs that are gone"). Run as root on Linux with the
# project's venv:   sudo scripts/agent_shm_caps.sh [PYTHON]
#
# A job (uid 0) saves one durable step and dies without close(); its namespace is handed to
# uid 1001 and put in a sticky 1777 directory owned by uid 1003 (as /dev/shm is root's, not
# the agent's DynamicUser). The agent's ShmWatch then ticks twice as uid 0 holding only the
# capabilities named (uid 0 without capabilities is checked like any other user).
set -euo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
for caps in none dac_read_search dac_override fowner dac_override,fowner; do
  base=$(mktemp -d /tmp/agent-caps.XXXXXX); shm=$(mktemp -d /dev/shm/agent-caps.XXXXXX)
  chmod 755 "$base"; chmod 1777 "$shm"; chown 1003 "$shm"
  "$PY" - "$base" "$shm" <<'PYEOF'
import os, sys, torch
from ckpt import CheckpointManager
base, shm = sys.argv[1:]
state = {"w": torch.ones(1000)}
mgr = CheckpointManager(base + "/root", memory_dir=shm, state=state)
mgr.save(1, state).wait()
os._exit(0)  # gone without close(): its slots stay, its newest step durable on disk
PYEOF
  ns=$(ls -d "$shm"/ckpt-guard-0-*); mv "$ns" "${ns/ckpt-guard-0-/ckpt-guard-1001-}"
  chown -R 1001:1001 "$shm"/ckpt-guard-1001-* "$base/root"
  bset=-all; [ "$caps" != none ] && bset="-all,$(echo "$caps" | sed 's/\(^\|,\)/\1+/g')"
  got=$(setpriv --bounding-set "$bset" --inh-caps -all "$PY" -c "
from agents.shm import ShmWatch
w = ShmWatch('$shm', every_s=0)
seen = len(w._survey()); w.tick()
print(seen, len(w.tick()))")
  left=$(du -sk "$shm" | cut -f1)
  echo "caps=$caps sees=${got% *} reclaimed=${got#* } left_in_shm_kib=$left entries_left=$(ls "$shm" | wc -l)"
  rm -rf "$shm" "$base"
done
