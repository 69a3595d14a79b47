#!/usr/bin/env bash
# One GPU-machine call (no network) running pat inside transformers' continuous batching and
# timing host planning with the device copy.  Results under OUT (at most eight files):
#
#   engine_tests.log    tests/test_transformers_integration.py and test_bench_engine_e2e.py
#   e2e_*.json          bench/engine_e2e.py runs (E2E_RUNS: "model:workload:requests ...")
#   plan_loop_cuda.json bench/plan_loop.py --backend cuda (issue 37's per-step target)
#   seam_spy.json       with SPY_IMPLS: the seam's host time by part per implementation, from
#                       a py-spy profile of one engine_e2e.py run each (bench/lab/spy_seam.py)
#   session.log
#
#   bench/device/engine_session.sh OUT
#
# Environment: E2E_RUNS (default "gqa-small:sysprompt:64"; each run
# "model:workload:requests[:impl,impl...]"), E2E_ARGS (extra engine_e2e.py
# arguments), E2E_TIMEOUT (seconds per run, default 240), SKIP (space-separated steps to skip:
# tests e2e planloop spy), PAT_GIT_SHA (the measured commit), SPY_IMPLS (implementations to
# profile, e.g. "paged|pat paged|fi-decode"; needs py-spy on PATH), SPY_ARGS (more py-spy
# record options, default "--nonblocking --idle"), SPY_RATE (samples per second, default
# 2000), SPY_RUN (the run, default "gqa-small:sysprompt:64").
set -uo pipefail
cd "$(dirname "$0")/../.."
out="$1"
. bench/device/session_setup.sh
skip=" ${SKIP:-} "
want() { [[ "$skip" != *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if want tests; then
    timeout 240 python3 -m pytest -q tests/test_transformers_integration.py \
        tests/test_bench_engine_e2e.py 2>&1 | tail -25 > "$out/engine_tests.log"
    tail -3 "$out/engine_tests.log"
fi
if want e2e; then
    for run in ${E2E_RUNS:-gqa-small:sysprompt:64}; do
        IFS=: read -r model workload nreq impls <<< "$run"
        timeout "${E2E_TIMEOUT:-240}" python3 bench/engine_e2e.py --model "$model" \
            --workload "$workload" --requests "$nreq" ${E2E_ARGS:-} \
            ${impls:+--impls "${impls//,/ }"} \
            --out "$out/e2e_${model}_${workload}_${nreq}.json" 2>&1 | tail -14
    done
fi
if want planloop; then
    timeout 200 python3 bench/plan_loop.py --backend cuda --requests 32,128,256 --steps 200 \
        --no-fresh --out "$out/plan_loop_cuda.json" 2>&1 | tail -8
    timeout 100 python3 bench/plan_loop.py --backend cuda --requests 128 --steps 200 \
        --no-fresh --profile --out "$work/profile.json" > /dev/null 2>&1 &&
        python3 -c "import json, sys; print('\n'.join(json.load(open(sys.argv[1]))['rows'][0]
            ['profile']))" "$work/profile.json" > "$out/plan_profile.txt"
fi
if want spy && [ -n "${SPY_IMPLS:-}" ] && command -v py-spy > /dev/null; then
    IFS=: read -r model workload nreq <<< "${SPY_RUN:-gqa-small:sysprompt:64}"
    profiles=()
    for impl in $SPY_IMPLS; do
        tag="${impl#*|}"
        # one process per implementation: the seam's shared parts are told apart by process
        timeout "${E2E_TIMEOUT:-240}" py-spy record ${SPY_ARGS:---nonblocking --idle} \
            --rate "${SPY_RATE:-2000}" \
            --threads --format raw -o "$work/$tag.txt" -- \
            python3 bench/engine_e2e.py --model "$model" --workload "$workload" \
            --requests "$nreq" --new-tokens 128 --warmup-tokens 4 --profile-tokens 0 \
            --repeats 1 --impls "$impl" --reference "$impl" --check-tokens 1 \
            --out "$work/spy_e2e_$tag.json" 2>&1 | tail -3
        profiles+=("$work/$tag.txt")
    done
    steps=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['impls'][0]
        ['decode_steps'])" "$work/spy_e2e_${tag}.json")
    layers=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['config']
        ['model_config']['num_hidden_layers'])" "$work/spy_e2e_${tag}.json")
    python3 bench/lab/spy_seam.py "${profiles[@]}" --rate "${SPY_RATE:-2000}" --steps "$steps" \
        --layers "$layers" --out "$out/seam_spy.json"
fi
