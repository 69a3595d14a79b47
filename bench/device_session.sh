#!/usr/bin/env bash
# One GPU-machine call: the graph-safe tests, then graph-safe vs exact-plan graph timings on
# synthetic and real-trace steps (bench/trace_replay.py), results under $OUT.
#   bench/device_session.sh OUT [steps.npz ...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="$1"; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 -m pytest -q -x tests/test_gpu_graph_safe.py 2>&1 | tail -15
for f in "$@"; do
    name=$(basename "$f" .npz)
    python3 bench/trace_replay.py time --steps-file "$f" --out "$out/$name" \
        --methods pat pat-graph --heads 32:8 32:32 --reps 10 2>&1 | tail -40
done
