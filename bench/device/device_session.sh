#!/usr/bin/env bash
# One GPU-machine call (no network) measuring the development set and checking correctness;
# results under OUT (at most eight files, one folder deep):
#
#   devset.json        development set, head_dim 128: pat (plain), pat-graph (one graph sized for
#                      the largest step of a part, replayed for all), pat-graph-bucket (a graph
#                      per power-of-two batch bucket), FlashInfer decode (the .whl wheel)
#   devset_hd64.json   the synthetic part at head_dim 64: pat and FlashInfer decode
#   devset_fi06.json   FlashInfer 0.6 decode alone on every part (when .whl06/trim holds its wheel)
#   baselines.json     the synthetic trees through bench/compare.py: pat, FlashInfer decode and
#                      cascade, FastTree (when .baselines/fasttree/FastTree.py is there)
#   gpu_tests.log, sanitizer.log, session.log
#
#   bench/device/device_session.sh OUT [STEPS_DIR]    (paths relative to the repository root)
#
# Carried (ignored by git): .whl/flashinfer_python-0.2.5*.whl
# (bench/device/build_flashinfer_wheel.sh), optionally .whl06/trim/*.whl (FlashInfer 0.6 without
# its bundled CUTLASS and spdlog sources, which its decode path does not compile, plus
# apache-tvm-ffi) and .baselines/fasttree/, and the prepared steps (python bench/devset.py
# prepare --out STEPS_DIR, default .trace_steps/devset).
# Environment: DEVSET_HEADS (default "32:8"), TEST_TIMEOUT (seconds, default 300), PAT_GIT_SHA
# (the measured commit, for a copy whose git state is not the tree's).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$1"; steps="${2:-.trace_steps/devset}"
. bench/device/session_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
heads=${DEVSET_HEADS:-32:8}
python3 bench/devset.py time --dir "$steps" --out "$work/dev" --heads $heads \
    --methods pat pat-graph pat-graph-bucket fi-decode 2>&1 | grep -v '^step ' | tail -4
cp "$work/dev/devset.json" "$out/devset.json"
python3 bench/devset.py time --dir "$steps" --out "$work/hd64" --heads $heads --head-dim 64 \
    --parts synthetic --methods pat fi-decode 2>&1 | grep -v '^step ' | tail -2
cp "$work/hd64/devset.json" "$out/devset_hd64.json"
specs=$(python3 -c "from bench import devset; print(' '.join(devset.synthetic_specs()))")
ft=(); [ -f .baselines/fasttree/FastTree.py ] && ft=(--fasttree .baselines/fasttree)
methods=(pat fi-decode fi-cascade); [ ${#ft[@]} -gt 0 ] && methods+=(fasttree)
timeout 240 python3 bench/compare.py --out "$work/cmp" --workloads $specs --heads $heads \
    --page-sizes 16 --methods "${methods[@]}" "${ft[@]}" --time-budget 180 2>&1 | tail -3
for f in "$work"/cmp/*.json; do
    [ "$(basename "$f")" != partial_rows.json ] && cp "$f" "$out/baselines.json"
done
wheels06=(.whl06/trim/*.whl)
if [ ${#wheels06[@]} -gt 0 ]; then
    install "$work/fi06" "${wheels06[@]}"
    PYTHONPATH="$base:$work/fi06" python3 bench/devset.py time --dir "$steps" \
        --out "$work/fi06" --heads $heads --methods fi-decode 2>&1 | grep -v '^step ' | tail -4
    cp "$work/fi06/devset.json" "$out/devset_fi06.json"
fi
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q tests/test_gpu_kernels.py \
    tests/test_gpu_graph_safe.py 2>&1 | tail -6 > "$out/gpu_tests.log"
tail -1 "$out/gpu_tests.log"
for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool=$tool --print-limit 20 python3 \
        bench/device/sanitize_case.py 2>&1 | tail -4
done > "$out/sanitizer.log"
grep -h "SUMMARY" "$out/sanitizer.log"
