"""What a CUDA-graph replay costs before any work: the timing harness's own floor.

Times a graph of one trivial kernel (each block reads one int and exits; ``--grid`` blocks)
three ways, as ``compare.py`` times every method:

* ``event``: CUDA events around ``graph.replay()`` with the L2 flush before each run (the
  comparison's method; the flush keeps the GPU busy while the host submits the replay);
* ``event-noflush``: the same without the flush (the host's submission time is inside);
* ``span``: the profiler's GPU span of the replay (first kernel start to last kernel end;
  see ``common.kernel_spans``), which leaves the submission latency out.

    python bench/lab/launch_floor.py --out DIR [--reps 200]

Writes ``DIR/launch_floor.json`` (device, git sha, versions) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/launch_floor.py
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--grid", type=int, nargs="*", default=[132, 1320])
    args = ap.parse_args(argv)
    import cupy as cp
    import torch
    from bench.common import TRIVIAL_KERNEL_SRC, git_sha, kernel_spans, l2_flusher, time_events
    kern = cp.RawKernel(TRIVIAL_KERNEL_SRC, "trivial")
    live = cp.zeros(1, dtype=cp.int32)
    flush = l2_flusher(128 << 20)
    rows = []
    for grid in args.grid:
        def body():
            s = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            kern((grid,), (32,), (live,), stream=s)
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        torch.cuda.synchronize()
        row = dict(grid=grid)
        row["event_us"] = float(np.median(time_events(g.replay, args.reps, flush=flush))) * 1e3
        row["event_noflush_us"] = float(np.median(time_events(g.replay, args.reps))) * 1e3
        row["span_us"] = float(np.median(kernel_spans(g.replay, args.reps, flush=flush))) * 1e3
        rows.append(row)
    dev = torch.cuda.get_device_properties(0)
    out = dict(benchmark="launch_floor", device=dev.name, git_sha=git_sha(), reps=args.reps,
               versions=dict(python=platform.python_version(), torch=torch.__version__,
                             cuda=torch.version.cuda, cupy=cp.__version__), rows=rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "launch_floor.json", "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"{'grid':>6} {'event':>8} {'event-noflush':>14} {'span':>8}  (us, median)")
    for r in rows:
        print(f"{r['grid']:6d} {r['event_us']:8.2f} {r['event_noflush_us']:14.2f} "
              f"{r['span_us']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
