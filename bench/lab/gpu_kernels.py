"""Kernel benchmark: pat and query packing on the paper's workloads, against copy bandwidth.

    python3 bench/lab/gpu_kernels.py --out bench/results/gpu_kernels_h100.json

For each workload spec (tree-spec format, see pat_core.workloads), head config and packer: plan once, then time
``backend.run`` (forward launches + merge) with CUDA events, after warm-up, median of ``--iters``
runs, the L2 flushed (a 256 MB buffer rewritten) before every timed run.  Reported:

* ``time_us``: median latency.
* ``eff_bw_gbs``: (unique KV bytes, each token read once + q + out) / time: the bytes any
  kernel must move, so packing that avoids re-reads raises it and a query-centric kernel on a
  sharing batch cannot exceed the copy bandwidth by re-reading.
* ``floor_us``: those bytes / measured device-to-device copy bandwidth; ``time / floor`` is the gap.
* ``moved_bw_gbs``: the plan's own bytes (KV per CTA + partials + q + out) / time.

Device name, git sha and versions go in the JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/gpu_kernels.py
    sys.path.insert(0, str(ROOT))

from bench.common import git_sha, graph_times, l2_flusher, time_events, unique_kv_tokens  # noqa: E402
from bench.common import copy_bandwidth as _copy_bandwidth_bytes  # noqa: E402

from pat_core.workloads import DESIGN_WORKLOADS, HEAD_CONFIGS  # noqa: E402


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus written)."""
    return _copy_bandwidth_bytes(nbytes, iters) / 1e9


WORKLOADS = DESIGN_WORKLOADS
HEADS = HEAD_CONFIGS
PACKERS = ("pat", "query")


def environment() -> dict:
    import cupy
    import torch
    info = {"device": torch.cuda.get_device_name(), "git_sha": git_sha(),
            "torch": torch.__version__, "cupy": cupy.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "cuda_runtime": torch.version.cuda}
    try:
        info["driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        pass
    return info


def bench_workload(backend, spec, hq, hk, packers=PACKERS, head_dim=128, page_size=16,
                   iters=20, copy_bw=None, flush=None, tile=None, check=True) -> list:
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(spec, page_size=page_size, seed=0)
    B = b.batch_size
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((b.num_pages, page_size, hk, head_dim), generator=g, device="cuda",
                    dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn((B, hq, head_dim), generator=g, device="cuda", dtype=torch.float16)
    uniq = unique_kv_tokens(b.block_tables, b.seq_lens, page_size)
    must_bytes = uniq * hk * head_dim * 2 * 2 + 2 * B * hq * head_dim * 2
    rows, outs = [], {}
    for packer in packers:
        w = PrefixAttentionWrapper(backend="cuda", packer=packer)
        w._gpu_backend = backend
        t0 = time.perf_counter()
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, head_dim, page_size,
                      kv_data_type="float16", tile=tile)
        plan_ms = (time.perf_counter() - t0) * 1e3
        backend.warmup(plan)
        out = torch.empty((B, hq, head_dim), dtype=torch.float16, device="cuda")
        fn = lambda: backend.run(plan, q, k, v, out=out)  # noqa: E731
        ts = time_events(fn, iters, flush=flush)
        ms = float(np.median(ts))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host_us = (time.perf_counter() - t0) / 10 * 1e6   # enqueue cost per call
        torch.cuda.synchronize()
        try:
            gts = graph_times(fn, iters, flush)
            graph_us = float(np.median(gts)) * 1e3
        except Exception as e:  # capture not possible: report eager numbers only
            graph_us = float("nan")
            print(f"    graph capture failed: {type(e).__name__}: {e}", flush=True)
        st = plan.stats()
        outs[packer] = out.clone()
        row = {"workload": spec, "heads": f"{hq}:{hk}", "packer": packer, "batch": B,
               "time_us": ms * 1e3, "time_us_min": float(np.min(ts)) * 1e3,
               "time_us_p90": float(np.percentile(ts, 90)) * 1e3, "iters": iters,
               "host_us": host_us, "tile_override": list(tile) if tile else None,
               "graph_us": graph_us,
               "plan_ms": plan_ms, "unique_kv_tokens": uniq, "must_bytes": must_bytes,
               "eff_bw_gbs": must_bytes / (ms * 1e-3) / 1e9,
               "moved_bytes": st["total_bytes"],
               "moved_bw_gbs": st["total_bytes"] / (ms * 1e-3) / 1e9,
               "num_ctas": st["num_ctas"], "tiles": st["tiles"],
               "groups": plan.num_groups}
        if copy_bw:
            row["floor_us"] = must_bytes / (copy_bw * 1e9) * 1e6
            row["time_over_floor"] = row["time_us"] / row["floor_us"]
            row["eff_bw_frac_copy"] = row["eff_bw_gbs"] / copy_bw
            row["graph_over_floor"] = graph_us / row["floor_us"]
        rows.append(row)
    if check and len(outs) > 1:
        base = outs[packers[0]].float()
        for p in packers[1:]:
            diff = float((outs[p].float() - base).abs().max())
            for r in rows:
                if r["packer"] == p:
                    r["max_abs_diff_vs_" + packers[0]] = diff
    del k, v, q
    torch.cuda.empty_cache()
    return rows


def summarize(rows, copy_bw) -> dict:
    """Targets: 256_4096 query >= 85% of copy; pat never slower than query on sharing batches;
    geomean(time / floor) of pat on sharing batches <= 1.5."""
    by = {}
    for r in rows:
        by[(r["workload"], r["heads"], r["packer"])] = r
    s = {"copy_bw_gbs": copy_bw}
    q256 = [r for r in rows if r["workload"] == "256_4096" and r["packer"] == "query"]
    if q256:
        s["query_256_4096_frac_copy"] = {r["heads"]: r["eff_bw_frac_copy"] for r in q256}
    sharing = [w for w in {r["workload"] for r in rows} if "_" in w and "," in w.split("_")[0]]
    ratios, gratios, slower = [], [], []
    for (w, h, p), r in by.items():
        if p != "pat" or w not in sharing:
            continue
        ratios.append(r["time_over_floor"])
        if r.get("graph_over_floor", float("nan")) == r.get("graph_over_floor"):
            gratios.append(r["graph_over_floor"])
        qr = by.get((w, h, "query"))
        if qr and r["time_us"] > qr["time_us"]:
            slower.append(f"{w} {h}: pat {r['time_us']:.1f} us > query {qr['time_us']:.1f} us")
    if ratios:
        s["pat_sharing_geomean_time_over_floor"] = float(math.exp(np.mean(np.log(ratios))))
    if gratios:
        s["pat_sharing_geomean_graph_over_floor"] = float(math.exp(np.mean(np.log(gratios))))
    gslower = []
    for (w, h, p), r in by.items():
        qr = by.get((w, h, "query"))
        if p == "pat" and w in sharing and qr and r.get("graph_us", 0) > qr.get("graph_us", 0):
            gslower.append(f"{w} {h}: pat {r['graph_us']:.1f} us > query {qr['graph_us']:.1f} us")
    s["pat_slower_than_query_graph"] = gslower
    if q256:
        s["query_256_4096_graph_frac_copy"] = {
            r["heads"]: r["must_bytes"] / (r["graph_us"] * 1e-6) / 1e9 / copy_bw for r in q256}
    s["pat_slower_than_query"] = slower
    return s


def print_table(rows):
    print(f"{'workload':26s} {'heads':5s} {'packer':6s} {'us':>8s} {'graph':>8s} {'floor':>7s} "
          f"{'x':>5s} {'xg':>5s} {'ctas':>5s} tiles")
    for r in rows:
        print(f"{r['workload']:26s} {r['heads']:5s} {r['packer']:6s} {r['time_us']:8.1f} "
              f"{r.get('graph_us', float('nan')):8.1f} {r.get('floor_us', 0):7.1f} "
              f"{r.get('time_over_floor', 0):5.2f} {r.get('graph_over_floor', 0):5.2f} "
              f"{r['num_ctas']:5d} {r['tiles']}")


def run(workloads=WORKLOADS, heads=HEADS, packers=PACKERS, iters=20, out=None, backend=None):
    from pat_core.cuda_backend import CudaBackend
    backend = backend or CudaBackend()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw:.0f} GB/s", flush=True)
    flush = l2_flusher()
    rows = []
    for spec in workloads:
        for hq, hk in heads:
            rows += bench_workload(backend, spec, hq, hk, packers, iters=iters, copy_bw=copy_bw,
                                   flush=flush)
            print(f"  {spec} {hq}:{hk} " + " ".join(
                f"{r['packer']}={r['time_us']:.1f}us" for r in rows[-len(packers):]), flush=True)
    result = {"env": environment(), "method": {
        "timer": "CUDA events around backend.run (forward + merge); graph_us: the same call "
                 "captured once in a CUDA graph and replayed (no host launch gaps)",
        "iters": iters,
        "statistic": "median", "warmup": 3, "l2_flush": "256 MB buffer rewrite before each run",
        "head_dim": 128, "dtype": "float16", "page_size": 16, "kv_layout": "NHD"},
        "summary": summarize(rows, copy_bw), "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


# n for m = 16 (query-centric CTAs) by KV length: the data behind the selector's KV-length table
SWEEP_N = tuple(
    (spec, (32, 8), "query", (16, n), {})
    for spec in ("512_256", "256_1024", "256_4096") for n in (16, 32, 64, 128))

# 128-row tiles are compute bound with mma.sync: the same pat plans with the tile capped at
# 64 or 32 rows (every CTA forced to that tile; the packer re-packs under the cap)
SWEEP = (
    # (workload, heads, packer, tile or None, {(m, n): (warps, stages)})
    ("1,1024_1024,16", (32, 8), "pat", None, {}),
    ("1,1024_1024,16", (32, 8), "pat", (64, 128), {}),
    ("1,1024_1024,16", (32, 8), "pat", (64, 64), {}),
    ("1,1024_1024,16", (32, 8), "pat", (32, 64), {}),
    ("1,8,64,512_128,512,64,32", (32, 8), "pat", None, {}),
    ("1,8,64,512_128,512,64,32", (32, 8), "pat", (64, 128), {}),
    ("1,8,64,512_128,512,64,32", (32, 8), "pat", (64, 64), {}),
    ("1,8,64,512_128,512,64,32", (32, 8), "pat", (32, 64), {}),
    ("1,16_2048,128", (32, 8), "pat", None, {}),
    ("1,16_2048,128", (32, 8), "pat", (64, 128), {}),
    ("1,16_2048,128", (32, 8), "pat", (64, 64), {}),
    ("1,16_2048,128", (32, 8), "pat", (32, 64), {}),
    ("1,4,64_256,1024,64", (32, 8), "pat", None, {}),
    ("1,4,64_256,1024,64", (32, 8), "pat", (64, 128), {}),
    ("1,4,64_256,1024,64", (32, 8), "pat", (64, 64), {}),
    ("1,4,64_256,1024,64", (32, 8), "pat", (32, 64), {}),
)


def sweep(backend=None, cases=SWEEP, iters=20, copy_bw=None):
    """Time forced tiles with chosen (warps, stages): the data behind the variant defaults."""
    from pat_core import cuda_compile as cc
    from pat_core.cuda_backend import CudaBackend
    backend = backend or CudaBackend()
    copy_bw = copy_bw or copy_bandwidth()
    flush = l2_flusher()
    rows = []
    for spec, (hq, hk), packer, tile, over in cases:
        cc.VARIANT_OVERRIDES.clear()
        cc.VARIANT_OVERRIDES.update(over)
        try:
            r = bench_workload(backend, spec, hq, hk, (packer,), iters=iters, copy_bw=copy_bw,
                               flush=flush, tile=tile, check=False)[0]
            r["variant"] = (cc.FwdVariant.make(tile[0], tile[1], 128, "float16").key if tile
                            else "default")
        except Exception as e:
            r = {"workload": spec, "heads": f"{hq}:{hk}", "packer": packer, "tile": tile,
                 "error": f"{type(e).__name__}: {e}"[:400]}
        finally:
            cc.VARIANT_OVERRIDES.clear()
        rows.append(r)
        print(f"  sweep {spec} {packer} {r.get('variant', tile)}: "
              f"{r.get('time_us', float('nan')):.1f} us (graph {r.get('graph_us', float('nan')):.1f}) "
              f"{100 * r.get('eff_bw_frac_copy', float('nan')):.0f}% of copy "
              f"host {r.get('host_us', float('nan')):.0f} us {r.get('tiles', '')}", flush=True)
    return {"copy_bw_gbs": copy_bw, "rows": rows}


def _host_cost(fn, calls: int, profile: bool = True):
    """``(us, report)``: host microseconds per call of ``fn`` over ``calls`` calls after 10
    warm-up calls, and a cProfile report (25 lines by own time) of another ``calls`` calls."""
    from bench.common import host_us, profile_calls
    for _ in range(10):
        fn()
    us = host_us(fn, calls)
    return us, (profile_calls(fn, calls) if profile else "")


def host_overhead(backend=None, spec="1,4,64_256,1024,64", heads=(32, 8), calls=200):
    """Host cost per call of backend.run on a small plan and of the wrapper's run() (with and
    without ``out=``), profiles of both, and one bare launch (packed and through CuPy)."""
    import ctypes
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    from pat_core.cuda_backend import CudaBackend
    backend = backend or CudaBackend()
    b = build_tree_batch(spec, page_size=16, seed=0)
    hq, hk = heads
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)
    k = torch.randn((b.num_pages, 16, hk, 128), device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn((b.batch_size, hq, 128), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    run_us, prof_backend = _host_cost(lambda: backend.run(plan, q, k, v, out=out), calls)
    # bare launches of the prepared forward kernel: packed cuLaunchKernel vs CuPy's generic call
    from pat_core.cuda_launch import _Launch
    st = backend.state_for(plan)               # the plan's device state (run() wrote it)
    prep = next(iter(st.prepared.values()))
    ln = st.live_launches(prep)[0][0]          # the plan's first forward launch
    sp = torch.cuda.current_stream().cuda_stream
    t0 = time.perf_counter()
    for _ in range(calls):
        ln(sp)
    fwd_launch_us = (time.perf_counter() - t0) / calls * 1e6
    slow = _Launch(ln.fn, ln.grid, ln.block, ln.params, ln.smem, fast=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        slow(sp)
    cupy_launch_us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    # the wrapper's run() as users call it: input checks, then the backend (with and without
    # an output to write into)
    wrap_us, prof_wrapper = _host_cost(lambda: w.run(q, (k, v)), calls)
    wrap_out_us, _ = _host_cost(lambda: w.run(q, (k, v), out=out), calls, profile=False)
    return {"run_us": run_us, "groups": plan.num_groups, "fwd_launch_us": fwd_launch_us,
            "cupy_launch_us": cupy_launch_us, "fwd_param_bytes": ctypes.sizeof(ln.params),
            "wrapper_run_us": wrap_us, "wrapper_run_out_us": wrap_out_us,
            "profile": prof_backend + "\n# wrapper run(q, (k, v))\n" + prof_wrapper}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = ap.parse_args(argv)
    res = run(args.workloads, iters=args.iters, out=args.out)
    print_table(res["rows"])
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
