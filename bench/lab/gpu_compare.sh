#!/usr/bin/env bash
# On the GPU machine (no network): install the carried wheels into a private folder, then run
# the comparison, FastTree included when its file was carried.
#
#   bench/lab/gpu_compare.sh OUT_DIR [compare.py options...]
#
# Carried (ignored by git): .whl/flashinfer_python-*.whl (bench/device/build_flashinfer_wheel.sh) and
# .baselines/fasttree/FastTree.py (flashserve/PAT benchmark/FastTree.py).  A missing wheel or
# FastTree file is reported and its methods are left out; everything else still runs.
# Environment: PAT_BENCH_SITE (install folder, default a fresh temporary one), PAT_FASTTREE_DIR
# (default .baselines/fasttree), PAT_GIT_SHA (the measured commit, for a copy without .git).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bench/lab/gpu_compare.sh OUT_DIR [compare.py options...]" >&2
    exit 2
fi
out="$1"; shift
mkdir -p "$out"
site="${PAT_BENCH_SITE:-$(mktemp -d)}"
shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing into $site: ${wheels[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site:${PYTHONPATH:-}"
else
    echo "no wheels in .whl/: FlashInfer methods will report 'flashinfer unavailable'" >&2
fi
extra=()
ftdir="${PAT_FASTTREE_DIR:-.baselines/fasttree}"
case " $* " in
    *" --fasttree "*) ;;                                   # the caller chose
    *)
        if [ -f "$ftdir/FastTree.py" ]; then
            python3 -c "import triton" 2>/dev/null || {
                echo "FastTree needs triton, which does not import here" >&2; exit 1; }
            extra=(--fasttree "$ftdir")
        else
            echo "no $ftdir/FastTree.py: running without FastTree" >&2
        fi ;;
esac
# CUDA 13's nvcc needs this for FlashInfer 0.2.5's decode module to link
export NVCC_APPEND_FLAGS="-static-global-template-stub=false"
export PYTHONUNBUFFERED=1
python3 bench/compare.py --out "$out" ${extra[@]+"${extra[@]}"} "$@" 2>&1 | tee "$out/compare.log"
exit "${PIPESTATUS[0]}"
