"""The request rule against its measurements, and the simulator as the alternative judge (CPU).

    python bench/lab/request_rule_check.py --kernel-lab A.json [B.json ...] \
        [--trace RESULT.json STEPS.npz [--trace ...]] [--gpu h100] [--out FILE.json]

For every measured pair of plans of one step, the ``pat`` packer's plan with the rule off and
the per-request plan (one CTA per request writing its output, no merge: the ``query`` packing,
which is what :func:`pat_core.packers.request_packing` builds), this prints
which one measured faster, whether the default planner (:class:`pat_core.Planner`, the rule as
it is now) picks that one, and whether :func:`sim.simulate` (graph timing, the packaged
constants) predicts it.  Differences under ``--tie`` (default 0.5%) count as ties, right either
way.  Pairs whose per-request plan needs a split (a request of several slots) are left out:
the rule cannot take them.

Measurements:

* ``--kernel-lab``: ``bench/lab/kernel_lab.py`` JSON files; a pair is the rows of one
  ``(workload, heads)`` with packer ``query`` (per request: label ``finish-0`` in files
  measured before the one launch path, where the ``query`` plan's ``default`` row still ran a
  merge; label ``default`` in later files) and packer ``pat`` / label ``request-off`` (or
  ``default`` in files that have no ``request-off`` row for it, measured before the rule
  existed).
* ``--trace``: a ``bench/trace_replay.py time`` result run with ``--methods pat
  pat@request-off`` and the steps file it timed; a pair is one step and head configuration
  where the two methods planned differently (``num_ctas`` or ``total_bytes``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/request_rule_check.py
    sys.path.insert(0, str(ROOT))

from bench.common import heads_of  # noqa: E402


def kernel_lab_pairs(path) -> list:
    """``(name, block_tables, seq_lens, page_size, heads, per_request_us, pat_us)`` per pair."""
    from pat_core.workloads import build_tree_batch
    rows = json.loads(Path(path).read_text())["rows"]
    by = {}
    for r in rows:
        if "graph_us" in r:
            by.setdefault((r["workload"], r["heads"]), {})[(r["packer"], r["label"])] = r
    out = []
    for (spec, heads), m in by.items():
        req = m.get(("query", "finish-0")) or m.get(("query", "default"))
        pat = m.get(("pat", "request-off")) or m.get(("pat", "default"))
        if req is None or pat is None:
            continue
        b = build_tree_batch(spec, page_size=16)
        out.append((f"{spec} {heads}", b.block_tables, b.seq_lens, 16, heads_of(heads),
                    req["graph_us"], pat["graph_us"]))
    return out


def trace_pairs(result_path, steps_path) -> list:
    from bench.trace_replay import load_steps
    meta, steps = load_steps(steps_path)
    ps = meta["config"]["page_size"]
    by = {}
    for r in json.loads(Path(result_path).read_text())["rows"]:
        if "graph_us" in r:
            by.setdefault((r["step"], r["heads"]), {})[r["method"]] = r
    out = []
    for (step, heads), m in sorted(by.items()):
        on, off = m.get("pat"), m.get("pat@request-off")
        if on is None or off is None or (on["num_ctas"], on["total_bytes"]) == (
                off["num_ctas"], off["total_bytes"]):
            continue
        i = [k for k, (s, _, _) in enumerate(steps) if s["step"] == step][0]
        _, table, lens = steps[i]
        out.append((f"{Path(steps_path).stem} step {step} {heads}", table, lens, ps,
                    heads_of(heads), on["graph_us"], off["graph_us"]))
    return out


def judge(pairs, gpu="h100", tie=0.005) -> list:
    from pat_core import Planner, Tuning
    from sim.model import simulate
    rows = []
    for name, table, lens, ps, (hq, hk), req_us, pat_us in pairs:
        args = (table, lens, hq, hk, 128, ps)
        req = Planner("query", gpu).plan(*args)
        if req.num_slots != req.batch_size:
            continue
        pat = Planner("pat", gpu, Tuning(request_share=0.0)).plan(*args)
        chosen = Planner("pat", gpu).plan(*args)
        rule_takes = chosen.one_cta_per_request
        sim_req, sim_pat = simulate(req).latency_us, simulate(pat).latency_us
        gain = pat_us / req_us - 1          # > 0: the per-request plan measured faster
        rows.append(dict(pair=name, per_request_us=req_us, pat_us=pat_us, gain=gain,
                         rule_takes=bool(rule_takes), sim_per_request_us=sim_req,
                         sim_pat_us=sim_pat,
                         rule_right=bool(abs(gain) < tie or rule_takes == (gain > 0)),
                         sim_right=bool(abs(gain) < tie or (sim_req < sim_pat) == (gain > 0))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel-lab", nargs="*", default=[])
    ap.add_argument("--trace", nargs=2, action="append", default=[],
                    metavar=("RESULT", "STEPS"))
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--tie", type=float, default=0.005)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pairs = [p for f in args.kernel_lab for p in kernel_lab_pairs(f)]
    pairs += [p for res, steps in args.trace for p in trace_pairs(res, steps)]
    rows = judge(pairs, args.gpu, args.tie)
    print(f"{'pair':44s} {'per req':>8s} {'pat':>8s} {'gain':>7s} rule  {'sim req':>8s} "
          f"{'sim pat':>8s} sim")
    for r in rows:
        print(f"{r['pair'][:44]:44s} {r['per_request_us']:8.1f} {r['pat_us']:8.1f} "
              f"{r['gain']:+7.3f} {'req' if r['rule_takes'] else 'pat'} "
              f"{'ok ' if r['rule_right'] else 'BAD'} {r['sim_per_request_us']:8.1f} "
              f"{r['sim_pat_us']:8.1f} {'ok' if r['sim_right'] else 'BAD'}")
    n = len(rows)
    print(f"rule right on {sum(r['rule_right'] for r in rows)} of {n}; simulator right on "
          f"{sum(r['sim_right'] for r in rows)} of {n} (ties within {args.tie:.1%} count as right)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=args.gpu, tie=args.tie, rows=rows),
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
