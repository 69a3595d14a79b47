#!/usr/bin/env bash
# A/B of two source trees in one GPU-machine call: the same kernel_lab cases run on this tree
# and on a baseline tree (an exported commit, e.g. `git archive REV pat_core cuda_src bench |
# tar -x -C DIR`), alternating A, B, A so a drift of the machine shows; then one table of the
# ratios.
#   bench/kernel_ab.sh OUT BASE_DIR [kernel_lab.py options...]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bench/kernel_ab.sh OUT BASE_DIR [kernel_lab.py options...]" >&2
    exit 2
fi
out="$1"; base="$2"; shift 2
mkdir -p "$out"
out="$(cd "$out" && pwd)"   # absolute: the baseline runs from its own folder
export PYTHONUNBUFFERED=1
python3 bench/kernel_lab.py --out "$out" --tag _new1 "$@" > "$out/new1.log" 2>&1
echo "new (1): exit $?"
(cd "$base" && python3 bench/kernel_lab.py --out "$out" --tag _base "$@") > "$out/base.log" 2>&1
echo "base: exit $?"
python3 bench/kernel_lab.py --out "$out" --tag _new2 "$@" > "$out/new2.log" 2>&1
echo "new (2): exit $?"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for tag in ("new1", "base", "new2"):
    f = out / f"kernel_lab_{tag}.json"
    runs[tag] = json.loads(f.read_text())["rows"] if f.exists() else []
def key(r):
    t = r.get("tile")
    return (r["workload"], r["heads"], r["packer"], "x".join(map(str, t)) if t else "-",
            r["label"])
idx = {t: {key(r): r for r in rows} for t, rows in runs.items()}
print(f"{'case':64s} {'base':>8s} {'new1':>8s} {'new2':>8s} {'new/base':>8s} ok")
for k, rb in idx["base"].items():
    tb = rb.get("graph_us")
    t1 = idx["new1"].get(k, {}).get("graph_us")
    t2 = idx["new2"].get(k, {}).get("graph_us")
    news = [t for t in (t1, t2) if t]
    ratio = min(news) / tb if news and tb else float("nan")
    ok = all(idx[t].get(k, {}).get("correct") for t in ("new1", "new2") if k in idx[t])
    f = lambda x: f"{x:8.1f}" if x else "       -"
    print(f"{' '.join(map(str, k)):64s} {f(tb)} {f(t1)} {f(t2)} {ratio:8.3f} {ok}")
PY
