#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (CI has none): the CUDA snapshot/restore path,
# NVML telemetry, and the checkpoint benchmark with the state on the GPU.
#
#   scripts/gpu_checks.sh [OUT_DIR]      # on a machine with a GPU, torch and the project's deps
#
# Results (JSON, logs) go to OUT_DIR (default ./gpu-checks). On a machine that lacks some of
# the deps and cannot fetch them, WHEELS=DIR installs the wheels in DIR (no index, no deps)
# under OUT_DIR/deps first. STEP_TIMEOUT=S bounds each benchmark (0, the default: none), so a
# short lease still brings back the steps that finished. The checkpoint benchmark runs last.
set -uo pipefail
out=${1:-gpu-checks}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
    $py -m pip install -q --no-index --no-deps --target "$out/deps" "$WHEELS"/*.whl
    export PYTHONPATH=$PYTHONPATH:$out/deps
fi
bounded() { timeout "${STEP_TIMEOUT:-0}" "$@"; }
nvidia-smi -L | tee "$out/nvidia-smi.txt"
$py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

echo "== GPU tests"
$py -m pytest -q -m gpu -s tests/test_ckpt_roundtrip.py tests/test_ckpt_overlap.py tests/test_restore_normalise.py tests/test_agents_run.py 2>&1 | tee "$out/pytest-gpu.log"

echo "== agent on NVML: /metrics"
$py -m agents.cli run --source nvml --interval 1 --duration 6 --metrics-port 19400 --json >"$out/agent-nvml.json" 2>"$out/agent-nvml.log" &
sleep 4
$py - <<'PY' | tee "$out/agent-metrics.txt"
import urllib.request
text = urllib.request.urlopen("http://127.0.0.1:19400/metrics", timeout=5).read().decode()
print("\n".join(l for l in text.splitlines() if l.startswith("DCGM_FI_") or l.startswith("agent_"))[:6000])
PY
wait

echo "== in-process recovery on the GPU: a NCCL group left and rebuilt, sticky CUDA errors leave the process"
bounded $py scripts/gpu_inprocess_nccl.py --json "$out/inprocess_nccl.json" 2>"$out/inprocess_nccl.log"

echo "== overlapped snapshots: step time saving every step (ours overlap / blocking, DCP zero-overhead) vs none"
bounded $py benchmarks/overlap_bench.py --device cuda --width "${OVERLAP_WIDTH:-4096}" --layers "${OVERLAP_LAYERS:-4}" \
    --batch "${OVERLAP_BATCH:-16384}" --rounds "${OVERLAP_ROUNDS:-6}" --block "${OVERLAP_BLOCK:-10}" \
    --json "$out/overlap_bench_cuda.json" 2>"$out/overlap_bench_cuda.log"

echo "== checkpoint benchmark, state on the GPU"
bounded $py benchmarks/ckpt_bench.py --device cuda --repeats "${REPEATS:-3}" --json "$out/ckpt_bench_cuda.json" 2>"$out/ckpt_bench_cuda.log"
# restore from memory: "ours: restore from memory" / "memcpy floor back" in its output is
# the issue's ratio (target <= 1.5x, asynchronous copies from the pinned slots)
