"""Planning overhead on the CPU: full plan(), identical re-plan, length-only decode step.

Batches are 4- and 5-level prefix trees with 256, 1024 and 4096 requests (the last level's node
count).  Each timing is the median of repeated calls after one warm-up call (Numba compiles or
loads its cache there).  Writes JSON with the machine, versions and git sha.

    python bench/lab/plan_overhead.py --out bench/results/plan_overhead.json

Targets: <= 1 ms at 256 requests and <= 5 ms at 1024 for a full plan, growing linearly in
pages; identical re-plan <= 0.2 ms; length-only step <= 1 ms at 1024 requests.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:     # run as a script: python bench/lab/plan_overhead.py
    sys.path.insert(0, ROOT)

from bench.common import cpu_name, git_sha, write_result  # noqa: E402

import numba  # noqa: E402

import pat_core  # noqa: E402
from pat_core import Planner  # noqa: E402
from pat_core.workloads import build_tree_batch  # noqa: E402

TREES = {
    256: ["1,4,16,64,256_1024,512,256,128,100", "1,8,64,256_2048,256,128,100"],
    1024: ["1,4,16,64,1024_1024,512,256,128,100", "1,8,64,1024_2048,256,128,100"],
    4096: ["1,4,16,256,4096_1024,512,256,128,100", "1,8,64,4096_2048,256,128,100"],
}


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--packer", default="pat")
    ap.add_argument("--heads", default="32:8")
    args = ap.parse_args(argv)
    hq, hk = (int(x) for x in args.heads.split(":"))
    rows = []
    for nreq, specs in TREES.items():
        for spec in specs:
            b = build_tree_batch(spec, page_size=16, seed=0)
            total_pages = int((-(-b.seq_lens // 16)).sum())
            planner = Planner(args.packer, "h100")
            call = lambda: planner.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)  # noqa
            call()                                          # warm-up (Numba cache load)

            def full():
                planner._cache = None                       # force the whole chain
                call()
            t_full = median_time(full, args.reps)
            call()
            t_same = median_time(call, args.reps * 3)
            assert planner.last_path == "reuse"
            # decode steps: each request grows by one token inside its last page
            room = (-(-b.seq_lens // 16)) * 16 - b.seq_lens
            lens = [b.seq_lens.copy()]
            cur = b.seq_lens.copy()
            for _ in range(int(room.min())):
                cur = cur + 1
                lens.append(cur.copy())
            t_len = float("nan")
            if len(lens) > 1:
                ts = []
                for i in range(1, len(lens)):
                    planner.plan(b.block_tables, lens[i - 1], hq, hk, 128, 16)
                    t0 = time.perf_counter()
                    planner.plan(b.block_tables, lens[i], hq, hk, 128, 16)
                    ts.append(time.perf_counter() - t0)
                    assert planner.last_path == "lengths"
                t_len = float(np.median(ts))
            st = planner.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16).stats()
            rows.append(dict(requests=nreq, tree=spec, total_pages=total_pages,
                             num_ctas=st["num_ctas"], full_ms=t_full * 1e3,
                             replan_same_ms=t_same * 1e3, length_step_ms=t_len * 1e3))
            print(f"{nreq:>5} req  {spec:<38} pages {total_pages:>7}  CTAs {st['num_ctas']:>5}"
                  f"  full {t_full * 1e3:7.3f} ms  same {t_same * 1e3:6.3f} ms  "
                  f"lengths {t_len * 1e3:6.3f} ms", flush=True)
    result = dict(
        benchmark="plan_overhead", packer=args.packer, heads=[hq, hk], head_dim=128,
        page_size=16, reps=args.reps, git_sha=git_sha(),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), platform=platform.platform()),
        versions=dict(python=platform.python_version(), numpy=np.__version__,
                      numba=numba.__version__, pat=pat_core.__version__),
        targets_ms=dict(full_256=1.0, full_1024=5.0, replan_same=0.2, length_step_1024=1.0),
        rows=rows,
    )
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
