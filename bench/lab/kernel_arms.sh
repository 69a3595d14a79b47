#!/usr/bin/env bash
# Several build variants of the kernels timed side by side in one GPU-machine call: each arm is
# this tree compiled with its own tuning defines (kernel_lab.py --defines: cuda_src/pat_traits.cuh's
# constants), or another source tree (an exported commit),
# and runs the same kernel_lab cases; the arms run in order and then in reverse (A B C C B A), so
# a drift of the machine shows; then one table of graph µs per case and arm, best of the two
# passes, with each arm's ratio to the first and whether every row was correct.
#   bench/lab/kernel_arms.sh OUT ARM [ARM ...] -- [kernel_lab.py options...]
# ARM is NAME=DEFINES (defines separated by commas, e.g. "ovl=PAT_WG_OVERLAP=1,PAT_X=0"; empty
# for the tree as it is; an item "env:VAR=VALUE" sets an environment variable of the arm's run
# instead, e.g. "smem=env:PAT_SMEM_CARVEOUT=100") or NAME@DIR (a source tree with its own
# bench/lab/kernel_lab.py, or bench/kernel_lab.py in trees older than the lab folder).
# OUT and DIR are taken relative to the folder the script is called from.  Exit status: 2 for
# bad arguments, 1 when some arm's run failed (the table still prints), else 0.
set -uo pipefail
usage() { echo "usage: bench/lab/kernel_arms.sh OUT ARM [ARM ...] -- [kernel_lab.py options...]" >&2
          exit 2; }
if [ $# -lt 2 ]; then usage; fi
out="$1"; shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
arms=()
names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    arm="$1"; shift
    if [[ "$arm" == *@* ]]; then
        name="${arm%%@*}"; dir="${arm#*@}"
        [ -d "$dir" ] || { echo "arm $name: no folder $dir" >&2; exit 2; }
        arm="$name@$(cd "$dir" && pwd)"
    elif [[ "$arm" == *=* ]]; then
        name="${arm%%=*}"
    else
        echo "arm '$arm': write NAME=DEFINES (NAME= for the tree as it is) or NAME@DIR" >&2
        exit 2
    fi
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "arm name '$name': letters, digits, . _ -" >&2; exit 2; }
    for n in "${names[@]}"; do [ "$n" != "$name" ] || { echo "arm name '$name' twice" >&2; exit 2; }; done
    arms+=("$arm"); names+=("$name")
done
[ ${#arms[@]} -gt 0 ] || usage
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
failed=0

run_arm() {  # run_arm ARM PASS
    local arm="$1" pass="$2" name dir defs
    shift 2
    if [[ "$arm" == *@* ]]; then
        name="${arm%%@*}"; dir="${arm#*@}"; defs=""
    else
        name="${arm%%=*}"; dir="$PWD"; defs="${arm#*=}"; defs="${defs//,/ }"
    fi
    local t0=$SECONDS envs=() d keep=()
    for d in $defs; do
        if [[ "$d" == env:* ]]; then envs+=("${d#env:}"); else keep+=("$d"); fi
    done
    defs="${keep[*]}"
    local lab=bench/lab/kernel_lab.py
    [ -f "$dir/$lab" ] || lab=bench/kernel_lab.py          # a tree from before bench/lab/
    # trees older than CudaBackend(defines=...) read PAT_NVRTC_DEFINES instead of --defines
    (cd "$dir" && env "${envs[@]}" PAT_NVRTC_DEFINES="$defs" python3 "$lab" \
        --out "$out" --tag "_${name}_${pass}" ${defs:+--defines $defs} "$@") \
        > "$out/${name}_${pass}.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || failed=1
    echo "arm $name pass $pass: exit $rc ($((SECONDS - t0)) s)"
}

# ARMS_SUMMARY_ONLY=1: only the table, from the files an earlier (perhaps cut-off) call left
if [ -z "${ARMS_SUMMARY_ONLY:-}" ]; then
    for arm in "${arms[@]}"; do run_arm "$arm" 1 "$@"; done
    for ((i = ${#arms[@]} - 1; i >= 0; i--)); do run_arm "${arms[$i]}" 2 "$@"; done
fi

python3 - "$out" "${names[@]}" <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
def key(r):
    t = r.get("tile")
    return (r["workload"], f'{r["heads"][0]}:{r["heads"][1]}' if isinstance(r["heads"], list)
            else str(r["heads"]), r["packer"], "x".join(map(str, t)) if t else "-", r["label"])
rows = {}
for n in names:
    for p in (1, 2):
        f = out / f"kernel_lab_{n}_{p}.json"
        if not f.exists():
            continue
        for r in json.loads(f.read_text())["rows"]:
            d = rows.setdefault(key(r), {}).setdefault(n, {"t": [], "ok": True})
            if r.get("graph_us"):
                d["t"].append(r["graph_us"])
            d["ok"] &= bool(r.get("correct"))
summary = []
print(f"{'case':70s} " + " ".join(f"{n:>10s}" for n in names) + "  ratios to " + names[0])
for k, arms in rows.items():
    best = {n: min(a["t"]) if a["t"] else None for n, a in arms.items()}
    cells = " ".join(f"{best.get(n) or float('nan'):10.1f}" for n in names)
    b0 = best.get(names[0])
    ratios = " ".join(f"{(best[n] / b0 if best.get(n) and b0 else float('nan')):.3f}"
                      for n in names[1:])
    bad = [n for n, a in arms.items() if not a["ok"]]
    print(f"{' '.join(k):70s} {cells}  {ratios}" + (f"  WRONG: {bad}" if bad else ""))
    summary.append({"case": list(k), "best_graph_us": best, "correct": {n: a["ok"] for n, a in arms.items()}})
(out / "arms_summary.json").write_text(json.dumps({"arms": names, "rows": summary}, indent=1))
PY
exit $failed
