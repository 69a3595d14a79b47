"""What choosing between the ``pat`` and ``query`` packers by the simulator would have gained,
judged on measured calibration files (no GPU needed).

For every sharing configuration (workload, page size, heads) of each file that holds both
packers' graph-replay timings, :func:`sim.choose.choose_packer`'s rule is applied to the
simulator's predictions of the two measured plans (the packaged constants of the file's GPU):
:func:`sim.choose.pick`, which keeps ``pat`` unless ``query`` is predicted faster by more than
the margin.  The measured time
of the chosen plan over ``pat``'s is then summarised per file, margin and workload set (the
file's fit / validation split): geometric mean, best, worst, how many configurations changed.

    python bench/lab/sim_choice_check.py bench/results/calibration_h100_v13.json \\
        bench/results/calibration_h200_v7.json --margins 0 0.02 0.05 [--json OUT.json]

The packaged constants were fitted to some of these files' fit workloads; their validation
workloads were never fitted on, so read those rows as the out-of-sample check.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:     # run as a script: python bench/lab/sim_choice_check.py
    sys.path.insert(0, ROOT)

from sim.calibration import Prepared, load_measurements  # noqa: E402
from sim.choose import pick  # noqa: E402
from sim.constants import load_constants  # noqa: E402


def check(path: str, margins) -> list:
    """Rows ``{file, gpu, margin, set, n, geomean, best, worst, changed}`` for one file."""
    data = load_measurements([path])
    gpu = data.get("gpu", "h100")
    fit = set(data["split"]["fit"])
    recs = [r for r in data["records"] if r["timing"] == "graph"
            and r["method"] in ("pat", "query")]
    prep = Prepared(recs, gpu)
    pred = prep.predict(recs, load_constants(gpu))
    by = collections.defaultdict(dict)
    for r, p in zip(recs, pred):
        if prep.sharing(r):
            key = (r["workload"], r["page_size"], r["num_qo_heads"], r["num_kv_heads"])
            by[key][r["method"]] = (r["measured_us"], float(p))
    rows = []
    for margin in margins:
        for name, keep in (("fit", True), ("validation", False)):
            ratios = []
            for key, m in by.items():
                if (key[0] in fit) != keep or len(m) < 2:
                    continue
                chosen = pick({k: p for k, (_, p) in m.items()}, "pat", margin)
                ratios.append(m[chosen][0] / m["pat"][0])
            if not ratios:
                continue
            rows.append(dict(file=os.path.basename(path), gpu=gpu, margin=margin, set=name,
                             n=len(ratios),
                             geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)),
                             best=min(ratios), worst=max(ratios),
                             changed=sum(1 for x in ratios if x != 1.0)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="calibration files (bench/calibrate.py output)")
    ap.add_argument("--margins", nargs="+", type=float, default=[0.0, 0.02, 0.05])
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    bad = [m for m in args.margins if not 0 <= m < 1]
    if bad:
        ap.error(f"--margins: each must be in [0, 1), got {bad}")
    rows = []
    for f in args.files:
        if not os.path.isfile(f):
            ap.error(f"files: no such file {f!r}")
        rows += check(f, args.margins)
    print("chosen plan's measured time / pat's (graph replay, sharing configurations)")
    print(f"{'file':<28} {'margin':>6} {'set':<10} {'n':>3} {'geomean':>8} {'best':>6} "
          f"{'worst':>6} {'changed':>7}")
    for r in rows:
        print(f"{r['file']:<28} {r['margin']:>6.2f} {r['set']:<10} {r['n']:>3} "
              f"{r['geomean']:>8.3f} {r['best']:>6.3f} {r['worst']:>6.3f} {r['changed']:>7}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
