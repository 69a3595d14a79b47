"""Does the simulator pick the faster of a fold plan (finisher phase) and the same CTAs with a
merge?  CPU only: re-plans every pair measured by ``kernel_lab.py --cases finish-many |
finish-pairs | finish-pairs-2`` exactly as it was timed, simulates both plans and compares the
predicted ratio with the measured one (best of the files' passes, graph replay).

    python3 bench/fold_sim_check.py [--out FILE.json] [KERNEL_LAB_JSON ...]

Default inputs: ``bench/results/round19/kernel_lab_finish_*.json``.  Labels: ``finish-all``
(share 1.0: every request's leaf CTA finishes it), ``finish-pairs-off`` (no fold), ``default``
(the plan of the commit that measured it: no fold in the ``finish-many`` files, which predate the
large-merge rule; the rule's fold in the ``finish-pairs`` files, whose changed plans all fold
with share 1.0 too — including the four that today's rule, with its first-phase bound, no
longer folds: the plan scored is the plan timed).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

from common import heads_of  # noqa: E402

from pat_core import Planner, Tuning  # noqa: E402
from pat_core.workloads import build_tree_batch  # noqa: E402
from sim import simulate  # noqa: E402

FOLD, NO_FOLD = Tuning(finish_share=1.0), Tuning(finish_pairs=None)


def tuning_for(label: str, case_set: str) -> Tuning:
    if label == "finish-all":
        return FOLD
    if label == "finish-pairs-off":
        return NO_FOLD
    if label == "default":
        return NO_FOLD if case_set == "finish-many" else FOLD
    raise ValueError(f"no plan known for label {label!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--out", default=None, help="write the rows and the score as JSON")
    ap.add_argument("--gpu", default="h100")
    args = ap.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "bench", "results", "round19",
                                                        "kernel_lab_finish_*.json")))
    if not files:
        print("no kernel_lab finish files given or found", file=sys.stderr)
        return 2
    meas: dict = {}
    for f in files:
        d = json.load(open(f))
        for r in d["rows"]:
            key = (r["workload"], heads_of(r["heads"]), r.get("set") or "")
            if r.get("graph_us"):          # a row without a graph time has nothing to score
                meas.setdefault(key, {}).setdefault(r["label"], []).append(r["graph_us"])
    rows, right = [], 0
    for (spec, (hq, hk), case_set), labs in meas.items():
        if len(labs) != 2:
            continue
        b = build_tree_batch(spec)
        res = {}
        for lab, ts in labs.items():
            plan = Planner("pat", args.gpu, tuning_for(lab, case_set)).plan(
                b.block_tables, b.seq_lens, hq, hk, 128, 16)
            res[lab] = dict(measured_us=min(ts), predicted_us=simulate(plan).latency_us,
                            fold=plan.finish_from >= 0, groups=plan.num_groups)
        fold = [lab for lab in res if res[lab]["fold"]]
        plain = [lab for lab in res if not res[lab]["fold"]]
        if len(fold) != 1 or len(plain) != 1:
            continue
        f, p = res[fold[0]], res[plain[0]]
        m_ratio = f["measured_us"] / p["measured_us"]
        p_ratio = f["predicted_us"] / p["predicted_us"]
        ok = (m_ratio < 1) == (p_ratio < 1)
        right += ok
        rows.append(dict(workload=spec, heads=f"{hq}:{hk}", set=case_set, fold=f, merge=p,
                         measured_fold_over_merge=m_ratio, predicted_fold_over_merge=p_ratio,
                         right=bool(ok)))
        print(f"{spec:46s} {hq}:{hk:<3d} fold/merge measured {m_ratio:.3f} predicted "
              f"{p_ratio:.3f}  {'right' if ok else 'WRONG'}")
    errs = [abs(x[k]["predicted_us"] / x[k]["measured_us"] - 1) for x in rows
            for k in ("fold", "merge")]
    score = dict(pairs=len(rows), right=right, median_abs_error=float(np.median(errs)))
    print(f"faster plan predicted right on {right} of {len(rows)} pairs; median |pred/meas - 1| "
          f"{score['median_abs_error']:.1%}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"files": [os.path.relpath(f, ROOT) for f in files], "gpu": args.gpu,
                       "score": score, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
