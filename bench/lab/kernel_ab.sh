#!/usr/bin/env bash
# A/B of two source trees in one GPU-machine call: the same kernel_lab cases run on a baseline
# tree (an exported commit, e.g. `git archive REV pat_core cuda_src bench | tar -x -C DIR`) and
# on this tree, in the order base, new, new, base so a drift of the machine shows; then one table
# of each case's best time and new / base.  It is bench/lab/kernel_arms.sh with those two arms
# (OUT and BASE_DIR relative to the calling folder, as there).
#   bench/lab/kernel_ab.sh OUT BASE_DIR [kernel_lab.py options...]
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bench/lab/kernel_ab.sh OUT BASE_DIR [kernel_lab.py options...]" >&2
    exit 2
fi
out="$1"; base="$2"; shift 2
exec "$(dirname "$0")/kernel_arms.sh" "$out" "base@$base" new= -- "$@"
