"""How long a CUDA-graph replay of a pat step takes beyond its kernels: the simulator's graph start.

    python3 bench/lab/graph_start.py --out DIR [--reps 3]

For each of a fixed list of the simulator's *fit-set* workloads (never its validation set),
``bench/lab/profile_case.py --timeline`` replays the step's graph and reports the replay's time
(CUDA events, L2 flushed, median of 20) and its GPU span (first kernel start to last kernel
end, from the profiler's trace, median of 20).  The difference is what the replay costs outside
its kernels: the latency before the first kernel starts plus the few hundred ns after the last
ends.  The simulator issues a step's first launch at ``graph_start_ns + graph_launch_ns``, so

    graph_start_ns = median over workloads (replay - span) - graph_launch_ns

with ``graph_launch_ns`` the forked-launch interval ``bench/calibrate.py`` measures.  The two
medians of one workload come from different replays, so one difference can be off by tens of
µs (a slow replay on one side); the median over the list is what is used.  Writes
``graph_start_<gpu>.json`` (per-workload numbers, the median, device, git sha) into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/graph_start.py
    sys.path.insert(0, str(ROOT))

# fit-set workloads of bench/calibrate.py's split, small to large (the list was fixed before any
# of these differences was looked at against the model)
CASES = (("1,16_2048,128", "32:8"), ("1,16_2048,128", "64:8"),
         ("1,2,8,128_512,128,256,32", "32:8"), ("1,4,64_256,1024,64", "32:8"),
         ("3,24,96_1024,64,512", "32:8"), ("1,1024_1024,16", "32:8"),
         ("1,32,256_64,64,1024", "32:8"), ("128_2048", "32:8"), ("256_4096", "32:8"),
         ("1,4,16,64,256,1024_1024,256,128,64,32,32", "32:8"))
LINE = re.compile(r"graph replay ([0-9.]+) us \(events\), span ([0-9.]+) us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3, help="profile_case.py --runs (eager runs)")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from bench.lab.kernel_lab import environment
    from pat_core.gpus import detect_gpu_name
    rows = []
    for spec, heads in CASES:
        res = subprocess.run([sys.executable, str(ROOT / "bench" / "lab" / "profile_case.py"), spec,
                              heads, "pat", "--runs", str(args.reps), "--timeline"],
                             capture_output=True, text=True)
        m = LINE.search(res.stdout)
        row = {"workload": spec, "heads": heads}
        if m is None:
            row["error"] = (res.stdout + res.stderr)[-400:]
        else:
            row.update(replay_us=float(m.group(1)), span_us=float(m.group(2)))
            row["outside_us"] = row["replay_us"] - row["span_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r["outside_us"] for r in rows if "outside_us" in r]
    name = torch.cuda.get_device_name()
    res = {"benchmark": "graph_start", "device": name, "gpu": detect_gpu_name(name),
           "env": environment(), "rows": rows,
           "median_outside_us": float(np.median(ok)) if ok else None,
           "method": __doc__.split("\n\n")[1].strip()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"graph_start_{res['gpu']}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    if ok:
        print(f"median replay - span over {len(ok)} workloads: "
              f"{res['median_outside_us']:.2f} us -> {path.name}")
    else:
        print(f"no workload gave a timeline -> {path.name}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
