#!/usr/bin/env bash
# One GPU-machine call (no network): the development set timed against FlashInfer decode
# (bench/devset.py time), the GPU tests, and compute-sanitizer on small plans; results under OUT.
#
#   bench/device_session.sh OUT [STEPS_DIR]
#
# Carried (ignored by git): .whl/flashinfer_python-*.whl (bench/build_flashinfer_wheel.sh) and
# the prepared steps (python bench/devset.py prepare --out STEPS_DIR, default .trace_steps/devset).
# Environment: DEVSET_HEADS (default "32:8"), TEST_TIMEOUT (seconds, default 300), PAT_GIT_SHA
# (the measured commit, for a copy whose git state is not the tree's).
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"; steps="${2:-.trace_steps/devset}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
# CUDA 13's nvcc needs this for FlashInfer 0.2.5's decode module to link
export NVCC_APPEND_FLAGS="-static-global-template-stub=false"
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    site="$(mktemp -d)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    export PYTHONPATH="$PYTHONPATH:$site"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/devset.py time --dir "$steps" --out "$out" --heads ${DEVSET_HEADS:-32:8} 2>&1 \
    | grep -v '^step ' | tee "$out/devset.log" | tail -12
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q tests/test_gpu_kernels.py \
    tests/test_gpu_graph_safe.py 2>&1 | tail -6 | tee "$out/gpu_tests.log"
for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool=$tool --print-limit 20 python3 bench/gpu_check.py \
        --sanitize-case 2>&1 | tail -4 | tee -a "$out/sanitizer.log"
done
