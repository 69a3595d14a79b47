#!/usr/bin/env bash
# Opcode histogram of one forward variant's SASS (needs nvcc and cuobjdump; no GPU).
#   bench/lab/sass_mix.sh D T M N WARPS STAGES RW [arch]   e.g. bench/lab/sass_mix.sh 128 __half 128 64 4 2 32
set -euo pipefail
cd "$(dirname "$0")/../.."
D=$1 T=$2 M=$3 N=$4 W=$5 S=$6 RW=$7 ARCH=${8:-sm_90}
tmp=$(mktemp -d)
args="const $T*, const $T*, const $T*, float*, float*, const int*, const int*, const int*, const int*, const int*, const int*, const int*, int, int, int, int, int, int, long long, long long, long long, long long, long long, long long, long long, long long, int, float, int*, const int*, void*, float*, long long, long long, long long, long long"
printf '#include "pat_kernels.cu"\ntemplate __global__ void pat_fwd_kernel<%s, %s, %s, %s, %s, %s, %s>(%s);\n' \
  "$D" "$T" "$M" "$N" "$W" "$S" "$RW" "$args" > "$tmp/v.cu"
nvcc -std=c++17 -arch="$ARCH" -cubin -use_fast_math -Icuda_src -o "$tmp/v.cubin" "$tmp/v.cu"
cuobjdump -sass "$tmp/v.cubin" > "$tmp/v.sass"
echo "pat_fwd<$D,$T,$M,$N,$W,$S,$RW> $ARCH: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$tmp/v.sass") instructions"
grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_]+' "$tmp/v.sass" | awk '{print $NF}' \
  | sort | uniq -c | sort -rn | head -25
rm -rf "$tmp"
