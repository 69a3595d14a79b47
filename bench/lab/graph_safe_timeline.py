"""Where a graph-safe replay's launches run: per launch, when its blocks start and end and on
which SMs the blocks that ran an item sat.

A graph-safe wrapper (``use_cuda_graph=True``) replays its whole launch set on every step: one
forward launch per tile of the set, each over a grid of every block that can be resident, then
the merge, chained as programmatic dependent launches.  This script builds the kernels with
the per-block clock records (``-DPAT_BLOCK_CLOCK``, ``cuda_src/pat_common.cuh``), replays one
step (a CUDA graph, clean L2 flush, as ``bench/calibrate.py`` times it) and summarises each
launch of the replay whose forward span is the median of ``--reps``:

* ``blocks``: blocks recorded (at most ``--cap``); ``items``: the launch's work items (the
  plan's CTAs of that tile x KV heads); block ``b < items`` ran item ``b`` first;
* ``sms`` / ``max_per_sm``: distinct SMs of the blocks that ran an item, and the most such
  blocks on one SM (a launch whose items land two to an SM takes longer than one whose items
  each have an SM);
* ``start`` / ``end``: first block start and last block end (µs from the replay's first
  block), ``item_us``: median duration of the blocks that ran an item.

``--plain`` does the same for the plain wrapper's graph of the step (its launches are only the
plan's tiles, each grid at most one block per item).  ``--carveout P`` asks every forward
kernel the script loads for a P% shared-memory carveout (the driver's default otherwise; the
library never sets one).  Every output is checked against float64 attention first.

    python bench/lab/graph_safe_timeline.py --out DIR [--max-batch-size 512] [--plain]
        [--carveout 100] 1_8192@32:8 8_4096@32:8

Writes ``DIR/graph_safe_timeline.json`` and prints one block of rows per case.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:     # run as a script: python bench/lab/graph_safe_timeline.py
    sys.path.insert(0, ROOT)

from bench.lab.block_timeline import (case_inputs, clock_arrays,  # noqa: E402
                                      clock_defines, recorded_replays)


def launch_rows(arrays: dict, items: dict) -> list:
    """One summary dict per module that recorded blocks in this replay (see the module
    docstring); ``items``: ``{variant key: work items}`` of the plan's forward launches (a
    forward key not in it had none; the merge's blocks all count as working)."""
    rows = []
    for key, arr in arrays.items():
        a = arr.get()[0]
        live = np.nonzero(a[:, 0])[0]
        if live.size == 0:
            continue
        merge = key.startswith("pat_merge")
        n = live.size if merge else int(items.get(key, 0))
        work = live[live < n] if not merge else live
        sms = a[work, 5].astype(np.int64)
        dur = a[work, 2].astype(np.int64) - a[work, 0].astype(np.int64)
        rows.append({"key": key, "blocks": int(live.size), "items": n,
                     "sms": int(np.unique(sms).size),
                     "max_per_sm": int(np.bincount(sms).max()) if sms.size else 0,
                     "start": int(a[live, 0].min()), "end": int(a[live, 2].max()),
                     "item_us": float(np.median(dur)) / 1e3 if dur.size else 0.0})
    t0 = min((r["start"] for r in rows), default=0)
    for r in rows:
        r["start"], r["end"] = (r["start"] - t0) / 1e3, (r["end"] - t0) / 1e3
    return sorted(rows, key=lambda r: r["start"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="SPEC@HQ:HK (page size --page-size)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--max-batch-size", type=int, default=512)
    ap.add_argument("--max-num-pages", type=int, default=65536)
    ap.add_argument("--plain", action="store_true", help="also the plain wrapper's graph")
    ap.add_argument("--carveout", type=int, default=None,
                    help="preferred shared-memory carveout (percent) of every forward kernel")
    ap.add_argument("--reps", type=int, default=7, help="replays recorded per case")
    ap.add_argument("--cap", type=int, default=4096, help="blocks recorded per launch")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    cases = []
    for text in args.cases:
        spec, _, heads = text.partition("@")
        try:
            hq, hk = (int(x) for x in heads.split(":"))
        except ValueError:
            ap.error(f"case {text!r}: write SPEC@HQ:HK")
        cases.append((text, spec, hq, hk))
    if args.carveout is not None and not 0 <= args.carveout <= 100:
        ap.error(f"--carveout must be 0..100, got {args.carveout}")
    for name in ("reps", "cap", "max_batch_size", "max_num_pages"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    import torch
    import pat_core
    from bench.common import capture_graph, git_sha, l2_flusher, time_events, write_result
    from bench.compare import reference_fp64, rel_err
    from pat_core import cuda_compile as cc
    from pat_core.cuda_backend import CudaBackend

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    clocked = CudaBackend(defines=clock_defines(args.cap))
    if args.carveout is not None:
        load = clocked._function

        def carved(variant):
            fn = load(variant)
            if variant.key.startswith("pat_fwd"):
                fn.preferred_shared_memory_carveout = args.carveout
            return fn
        clocked._function = carved
    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    flush = l2_flusher(2 * int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)))
    d, ps = args.head_dim, args.page_size
    results = []
    for text, spec, hq, hk in cases:
        batch, q, k, v = case_inputs(torch, spec, hq, hk, d, ps)
        ref = reference_fp64(torch, q, k, v, batch.block_tables, batch.seq_lens, ps)
        for mode in (("plain", "graph-safe") if args.plain else ("graph-safe",)):
            kw = {} if mode == "plain" else dict(use_cuda_graph=True,
                                                 max_batch_size=args.max_batch_size,
                                                 max_num_pages=args.max_num_pages)
            w = pat_core.PrefixAttentionWrapper(backend="cuda", **kw)
            w._gpu_backend = clocked            # every kernel compiled with the clock records
            plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, d, ps,
                          kv_data_type="float16")
            err = rel_err(torch, w.run(q, (k, v)), ref)
            if not err < 2e-2:
                print(f"{text} {mode}: wrong result (relative error {err:.3g})",
                      file=sys.stderr)
                return 1
            per_tile = Counter(tuple(int(x) for x in plan.tile_configs[c])
                               for c in plan.cta_tile.tolist())
            items = {cc.FwdVariant.make(m, n, d, "float16", arch=arch).key: c * hk
                     for (m, n), c in per_tile.items()}
            graph = capture_graph(lambda: w.run(q, (k, v)))
            us = statistics.median(t * 1e3 for t in time_events(graph.replay, 30, flush=flush))
            arrays = clock_arrays(args.cap)
            reps = recorded_replays(torch, graph, arrays, flush, args.reps,
                                    lambda: launch_rows(arrays, items))
            spans = [max((r["end"] for r in rows if not r["key"].startswith("pat_merge")),
                         default=0.0) for rows in reps]
            rows = reps[int(np.argsort(spans)[len(spans) // 2])]
            results.append({"case": text, "mode": mode, "replay_us": round(us, 2),
                            "rel_err": err, "launches": rows})
            print(f"{text} {mode}: replay {us:.1f} us")
            for r in rows:
                print(f"  {r['key']:44s} blocks {r['blocks']:5d} items {r['items']:5d} "
                      f"sms {r['sms']:3d} max/SM {r['max_per_sm']:2d} start {r['start']:6.2f} "
                      f"end {r['end']:6.2f} item {r['item_us']:6.2f} us")
    out = {"device": torch.cuda.get_device_name(0), "git_sha": git_sha(),
           "torch": torch.__version__, "max_batch_size": args.max_batch_size,
           "carveout": args.carveout, "head_dim": d, "page_size": ps, "results": results}
    write_result(os.path.join(args.out, "graph_safe_timeline.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
