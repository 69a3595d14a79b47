"""Run one workload with one method a few times, eagerly: the target for a profiler.

    ncu -k regex:'pat_fwd|fasttree' python3 bench/lab/profile_case.py 1,1024_1024,16 32:8 pat
    python3 bench/lab/profile_case.py SPEC HEADS fasttree --fasttree DIR

``SPEC``: a tree-spec workload (:mod:`pat_core.workloads`); ``HEADS``: ``HQ:HK``; method
``pat`` (optionally ``--tuning LABEL``, a planner tuning of ``bench/lab/kernel_lab.py``),
``query``, ``fasttree`` or ``fi-decode`` (FlashInfer's batch decode, importable from the
environment, e.g. from the folder ``bench/lab/gpu_compare.sh`` installs it into, on
``PYTHONPATH``).  The output is checked against float64 attention before the runs, so a
profile is never taken of a wrong kernel.  Prints the plan's tiles and the median eager time;
``--timeline`` also prints each kernel's start and duration in a CUDA-graph replay (from the
profiler, after all timings: the profiler slows later launches).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/profile_case.py
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("heads", help="HQ:HK")
    ap.add_argument("method", choices=("pat", "query", "fasttree", "fi-decode"))
    ap.add_argument("--tuning", default="default", help="planner tuning label (kernel_lab)")
    ap.add_argument("--fasttree", metavar="DIR", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-dtype", default="float16", choices=("float16", "float8_e4m3fn"),
                    help="the cache's dtype (FP8: scales 0.5 and 0.75; q stays float16)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-len", type=int, default=1,
                    help="query tokens per request, causal among themselves (pat only)")
    ap.add_argument("--tile", default=None, help="M,N: force pat's tile")
    ap.add_argument("--layout", default=None,
                    help="WARPS,STAGES,ROWS_PER_WARP: the forced tile's kernel layout")
    ap.add_argument("--timeline", action="store_true",
                    help="also capture a CUDA graph and print the device timeline of its "
                         "median replay (each kernel's start and duration, L2 flushed)")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from bench.compare import (make_fasttree, make_fi_decode, load_fasttree, reference_fp64,
                         rel_err, torch_attention)
    from bench.common import time_events
    from bench.lab.kernel_lab import apply_tuning
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch

    hq, hk = (int(x) for x in args.heads.split(":"))
    d, ps = args.head_dim, 16
    b = build_tree_batch(args.spec, page_size=ps, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((b.num_pages, ps, hk, d), generator=g, device="cuda", dtype=torch.float16)
    v = torch.randn(k.shape, generator=g, device="cuda", dtype=torch.float16)
    fp8 = args.kv_dtype != "float16"
    sc = dict(k_scale=0.5, v_scale=0.75) if fp8 else {}
    if fp8:
        k, v = (k / 0.5).to(torch.float8_e4m3fn), (v / 0.75).to(torch.float8_e4m3fn)
    ql = args.q_len
    if ql > 1 and args.method != "pat":
        ap.error("--q-len > 1 runs pat only")
    q = torch.randn((b.batch_size * ql, hq, d), generator=g, device="cuda", dtype=torch.float16)
    if args.method == "fasttree":
        if not args.fasttree:
            ap.error("fasttree needs --fasttree DIR")
        fn, info = make_fasttree(torch, load_fasttree(args.fasttree), b, args.spec, k, v, q,
                                 hq, hk, d)
        if fn is None:
            print("fasttree skipped:", info)
            return 1
        print(info)
    elif args.method == "fi-decode":
        import os
        os.environ.setdefault("NVCC_APPEND_FLAGS", "-static-global-template-stub=false")
        import flashinfer
        fw, info = make_fi_decode(torch, flashinfer, b, hq, hk, d, ps, torch.float16, k.dtype)
        print(f"flashinfer {getattr(flashinfer, '__version__', '?')} decode {info}")
        fn = lambda: fw.run(q, (k, v), **sc)  # noqa: E731
    else:
        w = PrefixAttentionWrapper(backend="cuda", packer=args.method)
        apply_tuning(args.tuning, w.planner)
        tile = tuple(int(x) for x in args.tile.split(",")) if args.tile else None
        if args.layout:
            from pat_core import cuda_compile as cc
            if tile is None:
                ap.error("--layout needs --tile")
            cc.VARIANT_OVERRIDES[tile] = tuple(int(x) for x in args.layout.split(","))
        qo = np.arange(b.batch_size + 1, dtype=np.int32) * ql if ql > 1 else None
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type=args.kv_dtype,
                      q_data_type="float16", tile=tile, qo_indptr=qo)
        st = plan.stats()
        print(f"{st['num_ctas']} CTAs, tiles {st['tiles']}, {st['total_bytes'] / 1e6:.1f} MB")
        fn = lambda: w.run(q, (k, v), **sc)  # noqa: E731
    out = fn()
    ref = reference_fp64(torch, q, k, v, b.block_tables, b.seq_lens, ps, q_len=ql, **sc)
    err = rel_err(torch, out, ref)
    plain = rel_err(torch, torch_attention(torch, q, k, v, b.block_tables, b.seq_lens, ps,
                                           q_len=ql, **sc), ref)
    print(f"rel err {err:.2e} (plain torch {plain:.2e})")
    if err > max(2 * plain, 2.0 ** -11):
        print("WRONG OUTPUT: not profiling")
        return 1
    torch.cuda.synchronize()
    ts = time_events(fn, args.runs, flush=None)
    print(f"{args.method} {args.spec} {args.heads}: median eager {np.median(ts) * 1e3:.1f} us")
    if args.timeline:
        from bench.common import kernel_timeline, l2_flusher
        flush = l2_flusher(128 << 20)
        gr = torch.cuda.CUDAGraph()
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(gr):
            fn()
        torch.cuda.synchronize()
        tg = time_events(gr.replay, 20, flush=flush)   # events first: the profiler comes last
        runs = kernel_timeline(gr.replay, 20, flush)
        spans = [max(s + d for _, s, d in r) for r in runs]
        med = runs[int(np.argsort(spans)[len(spans) // 2])]
        print(f"graph replay {np.median(tg) * 1e3:.1f} us (events), span {np.median(spans):.1f} us;"
              " median replay's kernels:")
        for name, s0, dur in med:
            print(f"  {s0:8.2f} +{dur:7.2f} us  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
