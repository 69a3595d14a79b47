"""pat against FastTree on the same prefix trees, in one GPU run.

    python3 bench/fasttree_compare.py --fasttree DIR --out OUT [--iters 20] [--workloads ...]

``DIR`` holds ``FastTree.py`` from the public flashserve/PAT repository (``benchmark/``), the
Triton kernel of the FastTree paper; it is another project's code and is not part of pat.
FastTree's own data preparation builds each batch (``generate_tree``, ``qkv_preparation``,
``fasttree_preparation``, with its authors' benchmark settings: Q tiles [64, 16] for GQA group 1
and [16, 4] for group 4, KV tiles [32, 32], split sizes [1024, 128], parallelism thresholds
[132, 528] / [132, 132], alpha/beta/gamma 0.66/0.33/0.1).  Its KV lives in one flat token tensor
``[tokens, kv_heads, head_dim]`` with every tree node's tokens contiguous; pat reads the very
same tensor as a paged cache (a zero-copy view ``[tokens / 16, 16, kv_heads, head_dim]``, page
size 16) through block tables that list, for each request, the pages of the nodes on its path
from the root.  Both get the same ``q``.  So both methods compute the same batch from the same
bytes.

Every output is checked against float64 attention (relative error at most twice that of a plain
same-dtype torch implementation, or 2**-11) before it is timed.  Timing: CUDA events, the L2
flushed before every run, median of ``--iters``, eager and CUDA-graph replay.  FastTree runs
only single-root trees at GQA group 1 or 4 (its authors' limits); other cases are recorded with
the reason.  The floor is (unique KV bytes + q + out) / copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

WORKLOADS = ("1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32",
             "1,1024_1024,16", "1,8,64,512_128,512,64,32", "1,32,256_64,64,1024",
             "1,16_16384,16", "1,32_16384,16",
             "1,4,16,64,256_512,256,128,64,32",
             "1,4,16,64,256,1024_1024,256,128,64,32,32",
             "1,2,4,8,16,32,64_256,128,64,64,32,32,32")
HEADS = ((32, 8), (32, 32))
PAGE = 16


def load_fasttree(folder: str):
    path = Path(folder) / "FastTree.py"
    if not path.is_file():
        raise SystemExit(f"--fasttree: {path} not found (FastTree.py from flashserve/PAT's "
                         "benchmark/ folder)")
    spec = importlib.util.spec_from_file_location("FastTree", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["FastTree"] = mod
    spec.loader.exec_module(mod)
    return mod


def tree_block_tables(tree_info, kv_ptrs, page: int = PAGE):
    """Block tables of FastTree's requests over its flat token tensor viewed as pages.

    ``tree_info``: FastTree's node list after ``qkv_preparation`` (each leaf's ``requests``
    holds its request id); ``kv_ptrs``: ``[nodes + 1]`` token offsets of the nodes.  Returns
    ``(block_tables int32 [batch, max_pages], seq_lens int32 [batch])``.
    """
    paths = {}
    for n, node in enumerate(tree_info):
        if node.num_children == 0:
            chain, x = [], n
            while x != -1:
                chain.append(x)
                x = tree_info[x].parent
            paths[node.requests[0]] = chain[::-1]
    batch = len(paths)
    rows, lens = [], []
    for r in range(batch):
        pages = []
        for x in paths[r]:
            a, b = kv_ptrs[x], kv_ptrs[x + 1]
            if a % page or b % page:
                raise ValueError(f"node {x} spans tokens [{a}, {b}), not whole pages of {page}")
            pages += list(range(a // page, b // page))
        rows.append(pages)
        lens.append(len(pages) * page)
    width = max(len(p) for p in rows)
    table = np.zeros((batch, width), dtype=np.int32)
    for r, p in enumerate(rows):
        table[r, : len(p)] = p
    return table, np.asarray(lens, dtype=np.int32)


def fasttree_runner(ft, tree_info, kv_ptrs, q, k_flat, v_flat, hq, hk, d):
    """FastTree's decode as a zero-argument function writing into its own output tensor."""
    import torch
    group = hq // hk
    q_tiles = {1: [64, 16], 4: [16, 4]}[group]
    kv_tiles, splits = [32, 32], [1024, 128]
    params = ft.FastTreeParams()
    params.set_values(0.66, 0.33, 0.1)
    params.set_q_tile_sizes(q_tiles)
    params.set_kv_tile_sizes(kv_tiles)
    params.set_kv_group_num(group)
    batch = q.shape[0]
    aux, _ = ft.fasttree_preparation(tree_info, kv_ptrs, batch, hq, hk, d, splits,
                                     [132, 528], [132, 132], params, "cuda")
    out = torch.empty(batch, hq, d, device="cuda", dtype=q.dtype)
    scale = 1.0 / math.sqrt(d)

    def fn():
        ft.fasttree_decode(q, k_flat, v_flat, out, *aux, q_tiles, kv_tiles, scale)
        return out
    return fn, out


def timed(fn, iters, flush):
    from common import graph_times, time_events
    row = {"eager_us": float(np.median(time_events(fn, iters, flush=flush))) * 1e3}
    try:
        row["graph_us"] = float(np.median(graph_times(fn, iters, flush))) * 1e3
    except Exception as e:  # not capturable: eager stands
        row["graph_us"] = float("nan")
        row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def bench_one(ft, backend, spec, hq, hk, iters, copy_bw, flush, d=128) -> list:
    import torch
    from compare import rel_err, torch_attention
    from common import unique_kv_tokens
    from pat_core import PrefixAttentionWrapper
    levels, lens = spec.split("_")
    sizes, lengths = [int(x) for x in levels.split(",")], [int(x) for x in lens.split(",")]
    torch.manual_seed(0)
    tree = ft.generate_tree(sizes, lengths)
    q, _, _, _, k_flat, v_flat, kv_ptrs = ft.qkv_preparation(tree, hq, hk, d, "cuda",
                                                              torch.float16)
    del _
    torch.cuda.empty_cache()
    table, seq_lens = tree_block_tables(tree, kv_ptrs)
    k_pages = k_flat.view(-1, PAGE, hk, d)
    v_pages = v_flat.view(-1, PAGE, hk, d)
    ref = torch_attention(torch, q, k_pages, v_pages, table, seq_lens, PAGE, torch.float64)
    plain = torch_attention(torch, q, k_pages, v_pages, table, seq_lens, PAGE)
    tol = max(2 * rel_err(torch, plain, ref), 2.0 ** -11)
    uniq = unique_kv_tokens(table, seq_lens, PAGE)
    must = uniq * hk * d * 2 * 2 + 2 * q.shape[0] * hq * d * 2
    base = {"workload": spec, "heads": f"{hq}:{hk}", "batch": int(q.shape[0]),
            "floor_us": must / copy_bw * 1e6, "tol": tol}
    rows = []
    # pat (and its query-centric packing, for reference)
    for packer in ("pat", "query"):
        row = dict(base, method=packer)
        try:
            w = PrefixAttentionWrapper(backend="cuda", packer=packer)
            w._gpu_backend = backend
            plan = w.plan(table, seq_lens, hq, hk, d, PAGE, kv_data_type="float16")
            backend.warmup(plan)
            out = torch.full_like(q, float("nan"))
            fn = lambda: backend.run(plan, q, k_pages, v_pages, out=out)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            row["rel_err"] = rel_err(torch, out, ref)
            row["correct"] = bool(row["rel_err"] <= tol)
            row["tiles"] = plan.stats()["tiles"]
            if row["correct"]:
                row.update(timed(fn, iters, flush))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
    row = dict(base, method="fasttree")
    if hq // hk not in (1, 4):
        row["skipped"] = f"FastTree's benchmark settings cover GQA group 1 and 4, not {hq // hk}"
    elif sizes[0] != 1:
        row["skipped"] = "FastTree runs single-root trees only"
    else:
        try:
            fn, out = fasttree_runner(ft, tree, kv_ptrs, q, k_flat, v_flat, hq, hk, d)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row["rel_err"] = rel_err(torch, out, ref)
            row["correct"] = bool(row["rel_err"] <= tol)
            if row["correct"]:
                row.update(timed(fn, iters, flush))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
    rows.append(row)
    for r in rows:
        for m in ("eager_us", "graph_us"):
            if m in r and r[m] == r[m]:
                r[m.replace("_us", "_over_floor")] = r[m] / r["floor_us"]
    del q, k_flat, v_flat, ref, plain
    torch.cuda.empty_cache()
    return rows


def summarize(rows) -> dict:
    """Geomean time / floor per method (graph replay) over the configs where FastTree ran and
    was correct, pat's speed-up over FastTree per config, and the count where pat is faster."""
    by = {}
    for r in rows:
        by.setdefault((r["workload"], r["heads"]), {})[r["method"]] = r
    ok = [(k, v) for k, v in by.items()
          if all(v.get(m, {}).get("correct") and v[m].get("graph_us", math.nan) ==
                 v[m].get("graph_us") for m in ("pat", "fasttree"))]
    out = {"configs_compared": len(ok)}
    if ok:
        for m in ("pat", "query", "fasttree"):
            vals = [v[m]["graph_over_floor"] for _, v in ok if "graph_over_floor" in v.get(m, {})]
            if vals:
                out[f"geomean_graph_over_floor_{m}"] = float(np.exp(np.mean(np.log(vals))))
        sp = {f"{k[0]} {k[1]}": v["fasttree"]["graph_us"] / v["pat"]["graph_us"] for k, v in ok}
        out["pat_speedup_over_fasttree_graph"] = sp
        out["pat_faster_count"] = int(sum(x > 1 for x in sp.values()))
        out["geomean_speedup_graph"] = float(np.exp(np.mean(np.log(list(sp.values())))))
        spe = [v["fasttree"]["eager_us"] / v["pat"]["eager_us"] for _, v in ok]
        out["geomean_speedup_eager"] = float(np.exp(np.mean(np.log(spe))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fasttree", required=True, help="folder holding FastTree.py")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--launch-mode", default="auto", choices=("auto", "fused", "streams"),
                    help="CudaBackend.launch_mode: one launch per tile group on pool streams, "
                         "every forward CTA in one launch, or chosen per plan")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args(argv)
    ft = load_fasttree(args.fasttree)
    import platform
    import torch
    import triton
    from common import copy_bandwidth, git_sha, l2_flusher
    from pat_core.cuda_backend import CudaBackend
    backend = CudaBackend()
    backend.launch_mode = args.launch_mode
    t0 = time.perf_counter()
    backend.warmup(jobs=16)
    print(f"compiled pat variants in {time.perf_counter() - t0:.1f} s", flush=True)
    copy_bw = copy_bandwidth()
    flush = l2_flusher()
    rows = []
    for spec in args.workloads:
        for hq, hk in HEADS:
            rs = bench_one(ft, backend, spec, hq, hk, args.iters, copy_bw, flush)
            rows += rs
            print(f"{spec:42s} {hq}:{hk:<3d} " + "  ".join(
                f"{r['method']}={r.get('graph_us', math.nan):7.1f}us"
                f"{'' if r.get('correct', True) else ' WRONG'}"
                f"{' (' + r['skipped'][:20] + ')' if 'skipped' in r else ''}"
                f"{' ERR ' + r['error'][:60] if 'error' in r else ''}" for r in rs)
                + f"  floor={rs[0]['floor_us']:.1f}", flush=True)
    res = {"env": {"device": torch.cuda.get_device_name(), "git_sha": git_sha(),
                   "torch": torch.__version__, "triton": triton.__version__,
                   "python": platform.python_version(), "copy_bw_gbs": copy_bw / 1e9},
           "method": "CUDA events, L2 flushed before each run, median of iters; graph = one "
                     "capture replayed; float64 check before timing",
           "iters": args.iters, "summary": summarize(rows), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res["launch_mode"] = args.launch_mode
    (out / f"fasttree_compare{args.tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
