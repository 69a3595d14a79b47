#!/usr/bin/env bash
# One GPU-machine call (no network) checking and timing the engine features: head_dim 256, FP8
# KV caches, multi-token (speculative verify) queries and batch-invariant plans.  Results under
# OUT (at most eight files, one folder deep):
#
#   gpu_tests.log       every GPU test (the features' parametrisations included)
#   feat_hd256.json     synthetic part at head_dim 256: pat, FlashInfer decode
#   feat_fp16.json      synthetic part, fp16 KV, one token: pat (the same call's base for the
#                       FP8 and multi-token steps)
#   feat_fp8.json       synthetic part, FP8 KV (e4m3, per-tensor scales): pat, FlashInfer decode
#   feat_qlen4.json     synthetic part, 4 query tokens per request: pat, FlashInfer paged prefill
#   feat_invariant.json every part: pat and pat-invariant (batch_invariant=True)
#   variant_speed_d256.json  the head_dim-256 variant-speed table (kernel_lab's layouts
#                       cases; copy it to pat_core/data/ and regenerate kernel_resources.json)
#   sanitizer.log, session.log
#
#   bench/device/features_session.sh OUT [STEPS_DIR]
#
# Carried as for device_session.sh: .whl/flashinfer_python-0.2.5*.whl and the prepared steps
# (default .trace_steps/devset).  Environment: DEVSET_HEADS (default "32:8"), TEST_TIMEOUT
# (seconds, default 300), SKIP (space-separated steps to skip: tests hd256table hd256 fp8 qlen
# invariant sanitize), PAT_GIT_SHA (the measured commit).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$1"; steps="${2:-.trace_steps/devset}"
. bench/device/session_setup.sh
skip=" ${SKIP:-} "
want() { [[ "$skip" != *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
heads=${DEVSET_HEADS:-32:8}
dev() {   # dev NAME ARGS...: one devset.py time into OUT/feat_NAME.json
    local name="$1"; shift
    python3 bench/devset.py time --dir "$steps" --out "$work/$name" --heads $heads "$@" 2>&1 \
        | grep -v '^step ' | tail -3
    cp "$work/$name/devset.json" "$out/feat_$name.json"
}
if want tests; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q tests/test_gpu_*.py 2>&1 | tail -25 \
        > "$out/gpu_tests.log"
    tail -3 "$out/gpu_tests.log"
fi
if want hd256table; then
    timeout 500 python3 bench/lab/kernel_lab.py --cases layouts --head-dim 256 --out "$work/kl256" \
        --write-table "$out/variant_speed_d256.json" 2>&1 | tail -3
fi
want hd256 && dev hd256 --parts synthetic --head-dim 256 --methods pat fi-decode
if want fp8; then
    dev fp16 --parts synthetic --methods pat
    dev fp8 --parts synthetic --kv-dtype float8_e4m3fn --methods pat fi-decode
fi
if want qlen; then
    want fp8 || dev fp16 --parts synthetic --methods pat      # the one-token base, same call
    dev qlen4 --parts synthetic --q-len 4 --methods pat fi-prefill
fi
want invariant && dev invariant --methods pat pat-invariant
if want sanitize; then
    for tool in memcheck racecheck; do
        timeout 200 compute-sanitizer --tool=$tool --print-limit 20 python3 \
            bench/device/sanitize_case.py --features 2>&1 | tail -4
    done > "$out/sanitizer.log"
    grep -h "SUMMARY" "$out/sanitizer.log"
fi
