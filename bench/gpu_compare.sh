#!/usr/bin/env bash
# On the GPU machine: install the FlashInfer wheel from .whl/ into a private folder, then run
# the comparison.  Usage: bench/gpu_compare.sh OUT_DIR [compare.py options...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="$1"; shift
site="${PAT_BENCH_SITE:-$(mktemp -d)}"
if ls .whl/flashinfer_python-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        .whl/flashinfer_python-*.whl
    export PYTHONPATH="$site:${PYTHONPATH:-}"
fi
# CUDA 13's nvcc needs this for FlashInfer 0.2.5's decode module to link
export NVCC_APPEND_FLAGS="-static-global-template-stub=false"
export PYTHONUNBUFFERED=1
python3 bench/compare.py --out "$out" "$@"
