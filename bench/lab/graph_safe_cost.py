"""Where graph-safe mode's fixed cost goes: launches in a CUDA graph, measured by leaving parts out.

Graph-safe mode (``use_cuda_graph=True``) replays a fixed launch set: one pull-mode forward
launch per reachable tile plus the merge, chained on the caller's stream.  On small steps its replay
is ~20 us slower than a graph captured for the step's own plan (bench/NOTES.md).  This script
times, on the same step and in one process (CUDA events, L2 flushed, median):

* ``exact``: a graph captured for the step's own plan (the usual path);
* ``gs-all``: graph-safe mode with every reachable tile (what a wrapper whose
  ``max_batch_size`` allows 128-row CTAs gets);
* ``gs-used``: graph-safe mode whose launch set is only the tiles this plan uses (what fewer
  launches would buy);
* ``gs-bucket``: the launch set a wrapper with ``max_batch_size`` = this batch gets (tiles up
  to the rows such a batch can put in one CTA);
* ``exact-compact`` / ``gs-bucket-compact``: the same with the KV-length table
  ``--compact`` (default: no 16-token tiles), the plan's own graph and the graph-safe one;
* ``gs-bucket-fused``: the bucket's launch set as one fused pull launch (every tile in one
  kernel) plus the merge; ``gs-used-fused``: the plan's own tiles as one fused pull launch
  (the pull form's cost without the bucket's other variants); ``gs-bucket-fused-lean``: what
  a graph-safe wrapper of this bucket runs: the fused launch over the bucket's tiles under the
  planner tuning the wrapper sets for it (KV tile table, tiles left out, row cap:
  ``static_plan.graph_safe_tile_table``, ``fused_pull_exclusions``, ``fused_pull_max_rows``;
  ``--lean-table`` / ``--lean-exclude`` / ``--lean-max-rows`` override), the step planned
  the same way;
  ``gs-big`` / ``gs-big-fused``: a bucket ``--big`` times larger (a small step in a larger
  bucket), per-tile launches and fused;

and, without pat, graphs of ``K`` trivial kernels (each block reads one int and exits) forked
over ``K`` streams or chained on one, for the per-launch cost of a graph node; also with the
graph-safe launch set's block sizes and shared memory (with and without a 100% preferred
shared-memory carveout on the kernel).  Every pat row is checked against float64 attention
first.

    python bench/lab/graph_safe_cost.py --out DIR [--specs ...] [--heads 32:8 ...] [--reps 30]
                                    [--cases gs-bucket-fused gs-used-fused ...]

Writes ``DIR/graph_safe_cost.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/graph_safe_cost.py
    sys.path.insert(0, str(ROOT))

CASES = ("gs-all", "gs-used", "gs-bucket", "gs-bucket-fused", "gs-used-fused",
         "gs-bucket-fused-lean",
         "gs-bucket-compact", "gs-big", "gs-big-fused")
SPECS = ("1,3,12_16,64,128", "1,4,16_128,256,1024", "1,16_2048,128", "1,4,64_256,1024,64",
         "1,2,4,8,16,32,64_256,128,64,64,32,32,32")

# (threads, dynamic shared memory) of the graph-safe launch set at head_dim 128 (fp16, H100)
_GS_SHAPES = ((128, 98304), (128, 65536), (128, 81920), (64, 49152), (64, 40960), (256, 106496),
              (128, 57344), (64, 32768), (128, 69632), (64, 36864), (32, 20480))


def _f(x) -> str:
    return "   wrong" if x is None else f"{x:8.1f}"


def _g(row, key) -> str:
    """``_f`` of a row's entry, blank when its case was not run (``--cases``)."""
    return _f(row[key]) if key in row else "       -"


def time_graph(torch, fn, reps, flush):
    from bench.common import graph_times
    return float(np.median(graph_times(fn, reps, flush=flush))) * 1e3


def graph_timeline(fn, flush, runs=10) -> dict:
    """Kernels of one graph replay of ``fn`` (captured as ``time_graph`` does:
    ``common.capture_graph``), from the profiler's trace: per kernel (in launch order) its name
    and median start and duration in us, and the median span from the first kernel's start to
    the last one's end."""
    from bench.common import capture_graph, kernel_timeline
    tl = kernel_timeline(capture_graph(fn).replay, runs, flush)
    n = min(len(r) for r in tl)
    kernels = [dict(name=tl[0][i][0][:60],
                    start_us=float(np.median([r[i][1] for r in tl])),
                    dur_us=float(np.median([r[i][2] for r in tl]))) for i in range(n)]
    span = float(np.median([max(st + d for _, st, d in r) for r in tl]))
    return dict(kernels=kernels, span_us=span)


def micro(torch, cp, reps):
    """Graph replay time of K trivial launches, forked over K streams or chained on one."""
    from bench.common import TRIVIAL_KERNEL_SRC, time_events
    kern = cp.RawKernel(TRIVIAL_KERNEL_SRC, "trivial")
    kern.max_dynamic_shared_size_bytes = max(sm for _, sm in _GS_SHAPES)
    live = cp.zeros(1, dtype=cp.int32)
    rows = []
    cases = [(grid, k, mode, "plain") for grid in (132, 1320) for k in (1, 2, 4, 8, 12)
             for mode in ("forked", "chained")]
    cases += [(1320, 11, mode, shapes) for mode in ("forked", "chained")
              for shapes in ("gs-shapes", "gs-shapes-carveout100")]
    for grid, k, mode, shapes in cases:
        # 9: CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (-1: the driver's default)
        try:
            cp.cuda.driver.funcSetAttribute(kern.kernel.ptr, 9,
                                            100 if shapes.endswith("carveout100") else -1)
        except Exception as e:  # noqa: BLE001 (reported; the row still runs)
            print(f"carveout attribute: {e}")
        dims = _GS_SHAPES if shapes.startswith("gs") else ((32, 0),) * k
        streams = [torch.cuda.Stream() for _ in range(k)]

        def body():
            cur = torch.cuda.current_stream()
            if mode == "chained":
                s = cp.cuda.ExternalStream(cur.cuda_stream)
                for th, sm in dims:
                    kern((grid,), (th,), (live,), stream=s, shared_mem=sm)
                return
            ev = torch.cuda.Event()
            ev.record(cur)
            joins = []
            for st, (th, sm) in zip(streams, dims):
                st.wait_event(ev)
                kern((grid,), (th,), (live,), stream=cp.cuda.ExternalStream(st.cuda_stream),
                     shared_mem=sm)
                j = torch.cuda.Event()
                j.record(st)
                joins.append(j)
            for j in joins:
                cur.wait_event(j)

        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        torch.cuda.synchronize()
        us = float(np.median(time_events(g.replay, reps))) * 1e3
        rows.append(dict(kind="micro", grid=grid, launches=k, mode=mode, shapes=shapes,
                         graph_us=us))
        print(f"micro grid {grid:5d} K {k:2d} {mode:8s} {shapes:22s} {us:7.2f} us")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--specs", nargs="+", default=list(SPECS))
    ap.add_argument("--heads", nargs="+", default=["32:8", "32:32"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compact", default="96:32,inf:64", metavar="TABLE",
                    help="the other KV-length table the compact rows use, as MAX_LEN:N pairs "
                         "(last MAX_LEN 'inf'); default: no 16-token tiles")
    ap.add_argument("--lean-table", default=None, metavar="TABLE",
                    help="KV-length table the gs-bucket-fused-lean row plans with, as "
                         "--compact, or 'gpu' for the GPU's (default: what a graph-safe "
                         "wrapper of the bucket uses, static_plan.graph_safe_tile_table)")
    ap.add_argument("--lean-exclude", nargs="+", default=None, metavar="MxN",
                    help="tiles the gs-bucket-fused-lean row's planner leaves out (instead of "
                         "the wrapper's own exclusions), e.g. 32x32 32x64")
    ap.add_argument("--lean-max-rows", type=int, default=None, metavar="M",
                    help="cap the gs-bucket-fused-lean row's CTAs at M query rows "
                         "(Tuning.max_rows; default: the wrapper's rule, "
                         "static_plan.fused_pull_max_rows)")
    ap.add_argument("--big", type=int, default=4,
                    help="size of the larger bucket of the gs-big rows, in multiples of the step")
    ap.add_argument("--no-micro", dest="micro", action="store_false",
                    help="skip the trivial-kernel graphs")
    ap.add_argument("--timeline", action="store_true",
                    help="also record each case's kernels in a graph replay (profiler trace; "
                         "the profiler slows later host launches, so take timings from a run "
                         "without it)")
    ap.add_argument("--cases", nargs="+", default=None, choices=CASES,
                    help="graph-safe cases to run (default: all; exact and exact-compact "
                         "always run)")
    args = ap.parse_args(argv)
    def table_arg(name, text):
        try:
            t = tuple((1 << 62 if a == "inf" else int(a), int(b))
                      for a, b in (x.split(":") for x in text.split(",")))
        except ValueError:
            ap.error(f"--{name}: expected MAX_LEN:N pairs, got {text!r}")
        if t[-1][0] != 1 << 62:
            ap.error(f"--{name}: the last MAX_LEN must be 'inf'")
        return t

    compact = table_arg("compact", args.compact)
    lean_table = (args.lean_table if args.lean_table in (None, "gpu")
                  else table_arg("lean-table", args.lean_table))
    try:
        lean_exclude = (None if args.lean_exclude is None else
                        tuple(tuple(int(x) for x in t.lower().split("x"))
                              for t in args.lean_exclude))
        if lean_exclude is not None and any(len(t) != 2 for t in lean_exclude):
            raise ValueError
    except ValueError:
        ap.error(f"--lean-exclude: tiles as MxN, got {args.lean_exclude}")

    import cupy as cp
    import torch

    import pat_core
    from bench.common import git_sha, l2_flusher
    from bench.compare import reference_fp64, rel_err, torch_attention
    from pat_core.static_plan import StaticLayout, StaticLimits, reachable_tiles
    from pat_core.workloads import build_tree_batch

    flush = l2_flusher()
    rows = micro(torch, cp, 200) if args.micro else []
    d, ps, dtype = 128, 16, torch.float16
    for heads in args.heads:
        hq, hk = (int(x) for x in heads.split(":"))
        for spec in args.specs:
            b = build_tree_batch(spec, page_size=ps)
            g = torch.Generator(device="cuda").manual_seed(0)
            k = torch.randn((b.num_pages, ps, hk, d), generator=g, device="cuda", dtype=dtype)
            v = torch.randn(k.shape, generator=g, device="cuda", dtype=dtype)
            q = torch.randn((b.batch_size, hq, d), generator=g, device="cuda", dtype=dtype)
            ref = reference_fp64(torch, q, k, v, b.block_tables, b.seq_lens, ps)
            tol = max(2 * rel_err(torch, torch_attention(torch, q, k, v, b.block_tables,
                                                         b.seq_lens, ps), ref), 2.0 ** -11)
            row = dict(kind="step", spec=spec, heads=heads, batch=b.batch_size)
            w = pat_core.PrefixAttentionWrapper(backend="cuda", packer="pat")
            plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16")
            row["tiles"] = plan.stats()["tiles"]
            fn = lambda: w.run(q, (k, v))  # noqa: E731
            fn()   # throwaway (the first graph after the reference can be slow)
            row["exact"] = time_graph(torch, fn, args.reps, flush)
            if args.timeline:
                row["exact-timeline"] = graph_timeline(fn, flush)
            # the --compact KV-length table (default n in {32, 64}: no 16-token tiles)
            wc = pat_core.PrefixAttentionWrapper(backend="cuda", packer="pat")
            wc.planner.tuning = dataclasses.replace(wc.planner.tuning, kv_tile_table=compact)
            plan_c = wc.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16")
            row["tiles-compact"] = plan_c.stats()["tiles"]
            fnc = lambda: wc.run(q, (k, v))  # noqa: E731
            fnc()
            torch.cuda.synchronize()
            row["exact-compact-error"] = rel_err(torch, fnc(), ref)
            row["exact-compact"] = time_graph(torch, fnc, args.reps, flush) \
                if row["exact-compact-error"] <= tol else None

            entries = int(((b.seq_lens.astype(np.int64) + ps - 1) // ps).sum())
            out = torch.empty_like(q)
            # limits of a wrapper whose max_batch_size is this batch (its bucket)
            lim = StaticLimits.make(b.batch_size, entries, max(plan.num_ctas, plan_c.num_ctas),
                                    max(plan.num_slots, plan_c.num_slots))
            max_rows = lim.max_cta_rows(plan.group_size)
            sel = w.planner.tile_selector(d, "float16", None)
            sel_c = wc.planner.tile_selector(d, "float16", None)
            cta_tiles = plan.tile_configs[plan.cta_tile]
            used = tuple(sorted({tuple(int(x) for x in t) for t in cta_tiles},
                                key=lambda t: (-t[0], -t[1])))   # reachable_tiles' order
            big = StaticLimits.make(args.big * lim.max_batch_size, args.big * entries,
                                    args.big * lim.max_ctas, args.big * lim.max_partials)
            bucket = reachable_tiles(sel, max_rows=max_rows)
            # the lean fused set: the tuning a graph-safe wrapper of this bucket gives its
            # planner (KV tile table, tiles left out, row cap), --lean-table / --lean-max-rows
            # named first, and the step planned under it
            wl = pat_core.PrefixAttentionWrapper(
                backend="cuda", packer="pat", use_cuda_graph=True, max_batch_size=b.batch_size,
                max_num_pages=max(entries, 1), max_ctas=lim.max_ctas,
                max_partials=lim.max_partials)
            wl._gpu_backend.graph_fused = "on"
            lt = (wl.planner.gpu.kv_tile_table if lean_table == "gpu" else lean_table)
            wl.planner.tuning = dataclasses.replace(wl.planner.tuning, kv_tile_table=lt,
                                                    max_rows=args.lean_max_rows,
                                                    exclude_tiles=lean_exclude)
            wl._graph_safe_tuning(hq, hk, d, "float16", None)
            tun = wl.planner.tuning
            row["lean-table"] = None if tun.kv_tile_table is None else \
                [list(x) for x in tun.kv_tile_table]
            row["lean-excluded"] = [list(t) for t in (tun.exclude_tiles or ())]
            row["lean-max-rows"] = tun.max_rows
            plan_l = wl.planner.plan(b.block_tables, b.seq_lens, hq, hk, d, ps,
                                     kv_data_type="float16")
            lean = reachable_tiles(wl.planner.tile_selector(d, "float16"),
                                   max_rows=wl._static_max_rows(plan.group_size))
            row["lean-tiles"] = [list(t) for t in lean]
            lim_l = StaticLimits.make(b.batch_size, entries, max(lim.max_ctas, plan_l.num_ctas),
                                      max(lim.max_partials, plan_l.num_slots))
            big_tiles = reachable_tiles(sel, max_rows=big.max_cta_rows(plan.group_size))
            # (name, tiles, wrapper, plan, limits, fused)
            cases = (("gs-all", reachable_tiles(sel), w, plan, lim, False),
                     ("gs-used", used, w, plan, lim, False),
                     ("gs-bucket", bucket, w, plan, lim, False),
                     ("gs-bucket-fused", bucket, w, plan, lim, True),
                     ("gs-used-fused", used, w, plan, lim, True),
                     ("gs-bucket-fused-lean", lean, wl, plan_l, lim_l, True),
                     ("gs-bucket-compact", reachable_tiles(sel_c, compact, max_rows), wc, plan_c,
                      lim, False),
                     ("gs-big", big_tiles, w, plan, big, False),
                     ("gs-big-fused", big_tiles, w, plan, big, True))
            for name, tiles, wr, pl, limits, fused in cases:
                if args.cases is not None and name not in args.cases:
                    continue
                be = wr._gpu_backend
                st = be.static_state(StaticLayout(limits, tiles), hq, hk, d, ps, "float16",
                                     pl.sm_scale, fused=fused)
                st.write(pl, torch.cuda.current_stream().cuda_stream)
                row[f"{name}-launches"] = (1 if fused else len(tiles)) + 1
                key = name
                gfn = lambda: be.run_static(st, q, k, v, out=out)  # noqa: E731
                gfn()
                torch.cuda.synchronize()
                err = rel_err(torch, out, ref)
                if err > tol:
                    row[key] = None
                    row[key + "-error"] = err
                    print(f"{spec} {heads} {key}: WRONG ({err:.2e})")
                    continue
                row[key] = time_graph(torch, gfn, args.reps, flush)
                if args.timeline:
                    row[key + "-timeline"] = graph_timeline(gfn, flush)
            rows.append(row)
            print(f"{spec:40s} {heads:5s} exact {_f(row['exact'])} compact "
                  f"{_f(row['exact-compact'])} | all {_g(row, 'gs-all')} | "
                  f"used({row.get('gs-used-launches', '-')}) {_g(row, 'gs-used')} | "
                  f"bucket({row.get('gs-bucket-launches', '-')}) {_g(row, 'gs-bucket')} | "
                  f"bucket-compact({row.get('gs-bucket-compact-launches', '-')}) "
                  f"{_g(row, 'gs-bucket-compact')} | fused {_g(row, 'gs-bucket-fused')} "
                  f"used-fused {_g(row, 'gs-used-fused')} lean({len(lean)}) "
                  f"{_g(row, 'gs-bucket-fused-lean')} | "
                  f"big({row.get('gs-big-launches', '-')}) {_g(row, 'gs-big')} fused "
                  f"{_g(row, 'gs-big-fused')}")
            for key in [k for k in row if k.endswith("-timeline")]:
                t = row[key]
                print(f"    {key[:-9]:20s} span {t['span_us']:6.1f} us: " + ", ".join(
                    f"{kk['name'][:28]} @{kk['start_us']:.1f} {kk['dur_us']:.1f}"
                    for kk in t["kernels"]))
            del k, v, q, ref
            torch.cuda.empty_cache()
    res = dict(benchmark="graph_safe_cost", device=torch.cuda.get_device_name(),
               git_sha=git_sha(), versions=dict(python=platform.python_version(),
                                                torch=torch.__version__, cupy=cp.__version__,
                                                pat=pat_core.__version__),
               reps=args.reps, compact_table=[list(x) for x in compact],
               lean_table=(lean_table if lean_table in (None, "gpu")
                           else [list(x) for x in lean_table]),
               method_note="CUDA events around graph replay, L2 flushed before each pat replay "
               "(not the micro rows), median", rows=rows)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "graph_safe_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
