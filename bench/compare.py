"""pat against FlashInfer and FastTree on one GPU: every method checked, then timed, in one run.

Methods
-------
``pat``, ``query``, ``node``, ``compute``      our kernels with that packer
``pat-fixed``                                  pat packing, one 64x128 tile for every CTA
``fi-decode``                                  FlashInfer BatchDecodeWithPagedKVCacheWrapper
                                               (tensor cores when the GQA group >= 4)
``fi-cascade``                                 FlashInfer MultiLevelCascadeAttentionWrapper,
                                               one level per tree level
``fasttree``                                   the FastTree paper's Triton kernel
                                               (``FastTree.py`` of flashserve/PAT's benchmark/,
                                               given with ``--fasttree DIR``; not part of pat)

FastTree reads a flat token tensor, not a paged cache: its tree is derived from the block table
(``bench/fasttree_map.py``) and its K/V are gathered once, untimed, from the very cache the other
methods read, so it computes the same batch from the same values; its schedule comes from its
own ``fasttree_preparation`` with its authors' benchmark settings.  It runs single-root trees at
GQA group 1 or 4; elsewhere its row carries the reason instead of a time.

Method: every method's output is compared with a float64 reference computed on the
GPU; a method whose error exceeds twice that of a plain same-dtype PyTorch implementation is
reported as wrong and not timed.  Timing: CUDA events around ``run`` only, warm-up first
(FlashInfer's JIT, Triton's and our compiles happen there), L2 flushed before every timed run,
median of ``--reps``, eager and CUDA-graph replay.  Each configuration first runs its first
method once untimed (``--no-throwaway`` skips it): the method timed first after the float64
reference got a slower graph replay on long batches.  The device's copy bandwidth is measured in
the same run; the floor of a batch is (unique KV + q + out bytes) / copy bandwidth.

    python bench/compare.py --out bench/results/compare_h100 [--sets design deep]
        [--workloads ...] [--heads 32:32 32:8] [--page-sizes 16 32] [--fasttree DIR]

Workloads: ``--sets`` picks named sets of ``pat_core.workloads.WORKLOAD_SETS`` (each its tree
specs x its head configs; default ``design deep``, the development set); ``--workloads``
replaces the sets' specs, ``--heads`` their head configs.  ``--time-budget S`` stops starting
new configurations after S seconds and still writes the report.

Writes ``results.json`` (device, versions, git sha, one row per workload x heads x page size x
method), ``summary.md`` and plots (see the report section below) into ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time

import numpy as np

if __package__ in (None, ""):     # run as a script: python bench/compare.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (copy_bandwidth, flush_mode, git_sha, l2_flusher,  # noqa: E402
                          time_events, unique_kv_tokens)
from bench.fasttree_map import (FASTTREE_COST, FASTTREE_KV_SPLITS,  # noqa: E402
                                FASTTREE_KV_TILES, FASTTREE_PARA_THRESH1,
                                FASTTREE_PARA_THRESH2, FASTTREE_Q_TILES, Unsupported,
                                batch_token_tree, fasttree_nodes, fasttree_reason, same_shape)

OUR_METHODS = ("pat", "query", "node", "compute", "pat-fixed")
FI_METHODS = ("fi-decode", "fi-cascade")
FT_METHODS = ("fasttree",)
ALL_METHODS = OUR_METHODS + FI_METHODS + FT_METHODS
# what FastTree.py must define (flashserve/PAT benchmark/FastTree.py)
FASTTREE_API = ("FastTreeParams", "KVTreeNode", "generate_tree", "fasttree_preparation",
                "fasttree_decode")


# ---------------------------------------------------------------------------- GPU helpers
def torch_attention(torch, q, k, v, table, seq_lens, page_size, dtype=None, *, q_len: int = 1,
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """Paged attention in torch on the GPU (NHD caches), one request at a time, computed in
    ``dtype`` throughout: ``torch.float64`` for the reference, ``None`` for q's own dtype (the
    plain same-dtype implementation whose error sets the tolerance).

    ``q`` is ``[B * q_len, hq, d]``: request ``r`` owns rows ``r * q_len : (r + 1) * q_len`` and
    its token ``j`` sees KV positions ``< seq_len - q_len + 1 + j`` (causal; ``q_len = 1`` is
    decode).  ``k``/``v`` may be FP8: their values times ``k_scale``/``v_scale`` are the keys and
    values."""
    dtype = dtype or q.dtype
    hq, d = q.shape[1], q.shape[2]
    B = q.shape[0] // q_len
    hk = k.shape[2]
    g = hq // hk
    out = torch.empty((B * q_len, hq, d), dtype=dtype, device="cuda")
    scale = 1.0 / math.sqrt(d)
    for r in range(B):
        L = int(seq_lens[r])
        pages = torch.as_tensor(table[r, : -(-L // page_size)], device="cuda", dtype=torch.long)
        kk = k[pages].reshape(-1, hk, d)[:L].to(dtype).transpose(0, 1) * k_scale   # [hk, L, d]
        vv = v[pages].reshape(-1, hk, d)[:L].to(dtype).transpose(0, 1) * v_scale
        qr = q[r * q_len:(r + 1) * q_len].to(dtype)                    # [q_len, hq, d]
        qr = qr.reshape(q_len, hk, g, d).permute(1, 0, 2, 3).reshape(hk, q_len * g, d)
        s = torch.matmul(qr, kk.transpose(1, 2)) * scale                # [hk, q_len * g, L]
        if q_len > 1:
            tok = torch.arange(q_len, device="cuda").repeat_interleave(g)[:, None]
            pos = torch.arange(L, device="cuda")[None, :]
            s = s.masked_fill(pos >= L - q_len + 1 + tok, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), vv)                  # [hk, q_len * g, d]
        out[r * q_len:(r + 1) * q_len] = o.reshape(hk, q_len, g, d).permute(1, 0, 2, 3) \
            .reshape(q_len, hq, d)
    return out


def reference_fp64(torch, q, k, v, table, seq_lens, page_size, **kw):
    """Float64 attention on the GPU: the ground truth of every check here (``kw``: those of
    :func:`torch_attention`)."""
    return torch_attention(torch, q, k, v, table, seq_lens, page_size, torch.float64, **kw)


def rel_err(torch, x, ref) -> float:
    x = x.double()
    return float(torch.linalg.norm(x - ref) / torch.linalg.norm(ref))


def capture_graph(torch, fn, ref, tol):
    """A CUDA graph replaying ``fn``, checked against ``ref``; or a string saying why not."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn()
        torch.cuda.current_stream().wait_stream(s)
        out.fill_(float("nan"))       # a buffer the eager runs already filled proves nothing
        g.replay()
        torch.cuda.synchronize()
        err = rel_err(torch, out, ref)
        if not err <= max(tol, 2.0 ** -11):
            return f"graph replay wrong: err {err:.2e}"
        return g
    except Exception as e:  # not capturable: reported, eager timing stands
        torch.cuda.synchronize()
        return f"not capturable: {type(e).__name__}: {e}"[:200]


# ---------------------------------------------------------------------------- cascade levels
def cascade_levels(batch):
    """Per tree level: ``(qo_indptr, kv_indptr, kv_indices, last_page_len)`` int32 arrays, or
    ``None`` when some level's node owns no whole page (FlashInfer cannot start mid-page).

    Page ``k`` of a request belongs to the node holding the page's last token; nodes of one level
    own contiguous request ranges (tree specs order requests that way).
    """
    ps = batch.page_size
    paths = batch.paths
    B = len(paths)
    depth = len(paths[0])
    if any(len(p) != depth for p in paths):
        return None
    node_lens = batch.node_lens
    levels = []
    for lvl in range(depth):
        qo = [0]
        kv_ptr = [0]
        idx = []
        last = []
        r = 0
        while r < B:
            node = paths[r][lvl]
            r2 = r
            while r2 < B and paths[r2][lvl] == node:
                r2 += 1
            p = paths[r]
            ends = np.cumsum(node_lens[p])
            L = int(ends[-1])
            lo = 0 if lvl == 0 else int(ends[lvl - 1])
            hi = int(ends[lvl])
            k_first = None
            pages = []
            for k in range(-(-L // ps)):
                last_pos = min((k + 1) * ps, L) - 1
                if lo <= last_pos < hi:
                    pages.append(int(batch.block_tables[r, k]))
                    if k_first is None:
                        k_first = k
            if not pages:
                return None
            # a node's first page may start with its parent's tail tokens (a copy-on-write
            # page): they are read here and not at the parent's level, so each token once
            last_tok = min((k_first + len(pages)) * ps, L) - (k_first + len(pages) - 1) * ps
            idx.extend(pages)
            kv_ptr.append(len(idx))
            last.append(last_tok)
            qo.append(r2)
            r = r2
        levels.append(tuple(np.array(a, dtype=np.int32) for a in (qo, kv_ptr, idx, last)))
    return levels


# ---------------------------------------------------------------------------- methods
def make_ours(torch, pat_core, method, batch, hq, hk, d, ps, dtype_name):
    from sim.methods import method_options   # method -> (packer, planner keywords)
    packer, kw = method_options(method, d)
    w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer)
    plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, d, ps, kv_data_type=dtype_name,
                  **kw)
    return w, plan


def make_fi_decode(torch, flashinfer, batch, hq, hk, d, ps, dtype, kv_dtype=None):
    """FlashInfer's batch decode wrapper planned for ``batch`` (``kv_dtype``: the cache's dtype
    when it differs from ``dtype``, e.g. ``torch.float8_e4m3fn``)."""
    from pat_core.inputs import BlockTable
    bt = BlockTable.from_padded(batch.block_tables, batch.seq_lens, ps)
    indptr, indices, last = bt.to_csr()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    tc = (hq // hk) >= 4
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(torch.as_tensor(indptr, device="cuda"), torch.as_tensor(indices, device="cuda"),
           torch.as_tensor(last, device="cuda"), hq, hk, d, ps, q_data_type=dtype,
           kv_data_type=kv_dtype or dtype)
    return w, {"tensor_cores": tc}


def make_fi_prefill(torch, flashinfer, batch, hq, hk, d, ps, dtype, q_len, kv_dtype=None):
    """FlashInfer's paged prefill wrapper, causal, ``q_len`` query tokens per request: the
    usual verify step of speculative decoding."""
    from pat_core.inputs import BlockTable
    bt = BlockTable.from_padded(batch.block_tables, batch.seq_lens, ps)
    indptr, indices, last = bt.to_csr()
    cu = lambda a: torch.as_tensor(a, device="cuda", dtype=torch.int32)  # noqa: E731
    qo = cu(np.arange(len(batch.seq_lens) + 1) * q_len)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(qo, cu(indptr), cu(indices), cu(last), hq, hk, d, ps, causal=True,
           q_data_type=dtype, kv_data_type=kv_dtype or dtype)
    return w, {}


def make_fi_cascade(torch, flashinfer, batch, hq, hk, d, ps, dtype):
    levels = cascade_levels(batch)
    if levels is None:
        return None, {"skipped": "a tree level owns no whole page"}
    # the cascade wrapper reads its workspace before writing all of it: an uninitialised
    # buffer gives NaN rows (seen on an H100 with 0.2.5), a zeroed one the right answer
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.MultiLevelCascadeAttentionWrapper(len(levels), ws, "NHD")
    cu = lambda a: torch.as_tensor(a, device="cuda")  # noqa: E731
    w.plan([cu(l[0]) for l in levels], [cu(l[1]) for l in levels], [cu(l[2]) for l in levels],
           [cu(l[3]) for l in levels], hq, hk, d, ps, q_data_type=dtype)
    return w, {"levels": len(levels)}


def load_fasttree(folder: str):
    """Import ``folder/FastTree.py`` (flashserve/PAT's benchmark/FastTree.py) by path.

    Exits with a message naming what is wrong when the file is missing, does not import
    (FastTree needs Triton and torch), or lacks a function this harness calls."""
    path = os.path.join(folder, "FastTree.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--fasttree {folder}: no FastTree.py there (take benchmark/FastTree.py "
                         "from the flashserve/PAT repository)")
    spec = importlib.util.spec_from_file_location("FastTree", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["FastTree"] = mod          # as an import would: Triton reads jitted source
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules["FastTree"]
        raise SystemExit(f"--fasttree: importing {path} failed ({type(e).__name__}: {e}); "
                         "it needs triton and torch") from e
    missing = [n for n in FASTTREE_API if not hasattr(mod, n)]
    if missing:
        raise SystemExit(f"--fasttree: {path} lacks {', '.join(missing)}: not the FastTree.py "
                         "this harness was written for")
    return mod


def make_fasttree(torch, ft, batch, spec, k, v, q, hq, hk, d, tiles="prepared"):
    """FastTree on the batch every method runs: ``(fn, info)``, ``fn()`` returning its output
    ``[batch, hq, d]``; or ``(None, {"skipped": reason})`` where FastTree does not apply.

    ``k``, ``v``: the paged caches ``[pages, page_size, hk, d]``; ``q``: ``[batch, hq, d]``.
    The flat K/V FastTree reads are gathered from them here, once (not timed).  Its schedule is
    its own ``fasttree_preparation`` with its authors' settings.  That function may switch the
    tile sizes (both phases to one size when a phase has too little parallelism); the kernel is
    then launched with the sizes it switched to (``params.TSQs``/``TSKs``), since the schedule
    was cut for those.  The authors' drivers pass their starting sizes instead, which gives
    wrong results whenever a switch makes a phase's query tiles larger than the size passed
    (e.g. ``1,16_16384,16`` at 32:8); ``tiles="authors"`` does that, for comparison.
    """
    if tiles not in ("prepared", "authors"):
        raise ValueError(f"tiles must be 'prepared' or 'authors', got {tiles!r}")
    try:
        tree = batch_token_tree(batch.block_tables, batch.seq_lens, batch.page_size)
    except Unsupported as e:
        return None, {"skipped": str(e)}
    reason = fasttree_reason(tree, hq, hk, d)
    if reason:
        return None, {"skipped": reason}
    g = hq // hk
    q_tiles0, kv_tiles0 = list(FASTTREE_Q_TILES[g]), list(FASTTREE_KV_TILES)
    params = ft.FastTreeParams()
    params.set_values(*FASTTREE_COST)
    params.set_q_tile_sizes(list(q_tiles0))
    params.set_kv_tile_sizes(list(kv_tiles0))
    params.set_kv_group_num(g)
    nodes = fasttree_nodes(tree, ft.KVTreeNode)
    B = batch.batch_size
    aux, assignment = ft.fasttree_preparation(
        nodes, [int(x) for x in tree.kv_ptrs], B, hq, hk, d, list(FASTTREE_KV_SPLITS),
        list(FASTTREE_PARA_THRESH1), list(FASTTREE_PARA_THRESH2), params, "cuda")
    switched = list(params.TSQs) != q_tiles0 or list(params.TSKs) != kv_tiles0
    q_tiles, kv_tiles = ((list(params.TSQs), list(params.TSKs)) if tiles == "prepared" else
                         (q_tiles0, kv_tiles0))
    src = torch.as_tensor(tree.flat_src, device="cuda", dtype=torch.long)
    if int(tree.flat_src.max()) >= k.shape[0] * k.shape[1]:
        raise RuntimeError("fasttree: flat token map points past the cache")
    k_flat = k.reshape(-1, hk, d).index_select(0, src)          # [tokens, hk, d], contiguous
    v_flat = v.reshape(-1, hk, d).index_select(0, src)
    qc = q.contiguous()
    out = torch.full((B, hq, d), float("nan"), dtype=q.dtype, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def fn():
        ft.fasttree_decode(qc, k_flat, v_flat, out, *aux, q_tiles, kv_tiles, scale)
        return out

    info = dict(ft_nodes=tree.num_nodes, ft_levels=int(tree.depth.max()) + 1,
                ft_tokens=int(tree.kv_ptrs[-1]), ft_vnodes=int(aux[1].numel()),
                ft_phase_vnodes=[int(x) for x in aux[11]], ft_q_tiles=q_tiles,
                ft_kv_tiles=kv_tiles, ft_tiles_switched=switched,
                ft_merged_into_parent=int(sum(assignment)))
    if isinstance(spec, str) and spec.count("_") == 1:
        # the same tree as FastTree's own generator builds from the spec? (a record, not a
        # requirement: a page boundary inside a node changes the page-level tree)
        try:
            sizes, lens = ([int(x) for x in part.split(",")] for part in spec.split("_"))
            info["ft_tree_is_generate_tree"] = same_shape(tree, ft.generate_tree(sizes, lens))
        except Exception as e:  # a record only
            info["ft_tree_is_generate_tree"] = f"{type(e).__name__}: {e}"[:120]
    return fn, info


# ---------------------------------------------------------------------------- configurations
def parse_heads(text: str):
    """``"32:8"`` -> ``(32, 8)``; ValueError naming the argument otherwise."""
    try:
        a, b = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ValueError(f"--heads: expected QO:KV like 32:8, got {text!r}") from None
    if a < 1 or b < 1 or a % b:
        raise ValueError(f"--heads {text}: need positive head counts with QO a multiple of KV")
    return a, b


def select_configs(sets=("design", "deep"), workloads=None, heads=None, page_sizes=(16, 32)):
    """``[(spec, (hq, hk), page_size), ...]`` in run order, without duplicates.

    ``sets``: names of ``pat_core.workloads.WORKLOAD_SETS`` (each its specs x its head
    configs); ``workloads``: tree specs replacing the sets' specs (crossed with ``heads``, or
    with every head config of the selected sets); ``heads``: ``"QO:KV"`` strings replacing the
    sets' head configs.  Every spec is parsed here, so a typo fails before the GPU work.
    """
    from pat_core.workloads import WORKLOAD_SETS, parse_tree_spec
    sets = list(sets or ())
    bad = [x for x in sets if x not in WORKLOAD_SETS]
    if bad:
        raise ValueError(f"--sets: unknown {bad}; known: {sorted(WORKLOAD_SETS)}")
    if not page_sizes or any(int(p) < 1 for p in page_sizes):
        raise ValueError(f"--page-sizes: need positive page sizes, got {page_sizes}")
    hs = [parse_heads(h) for h in heads] if heads else None
    pairs = []
    if workloads:
        if not hs:
            hs = [h for x in (sets or ["design"]) for h in WORKLOAD_SETS[x][1]]
        pairs = [(w, h) for w in workloads for h in hs]
    else:
        if not sets:
            raise ValueError("no workloads: give --sets or --workloads")
        for x in sets:
            specs, hcfg = WORKLOAD_SETS[x]
            pairs += [(w, h) for w in specs for h in (hs or hcfg)]
    for w, _ in pairs:
        parse_tree_spec(w)
    out = []
    for w, h in pairs:
        for ps in page_sizes:
            c = (w, tuple(h), int(ps))
            if c not in out:
                out.append(c)
    return out


def parse_args(argv=None):
    """compare.py's options (see the module docstring); checks them without a GPU."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--sets", nargs="*", default=["design", "deep"],
                    help="named workload sets (pat_core.workloads.WORKLOAD_SETS)")
    ap.add_argument("--workloads", nargs="*", default=None,
                    help="tree specs replacing the sets' specs")
    ap.add_argument("--heads", nargs="*", default=None,
                    help="QO:KV head configs replacing the sets' head configs")
    ap.add_argument("--page-sizes", nargs="*", type=int, default=[16, 32])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--methods", nargs="*", default=None,
                    help=f"subset of {', '.join(ALL_METHODS)} (default: all that can run)")
    ap.add_argument("--fasttree", metavar="DIR", default=None,
                    help="folder holding FastTree.py (flashserve/PAT benchmark/FastTree.py)")
    ap.add_argument("--fasttree-tiles", choices=("prepared", "authors"), default="prepared",
                    help="launch FastTree with the tile sizes its preparation settled on "
                         "(default) or, as its authors' drivers do, with the starting ones")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-throwaway", dest="throwaway", action="store_false",
                    help="time the methods without a throwaway run of the first one per "
                         "configuration")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="start no new configuration after S seconds (report still written)")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)
    if args.methods is None:
        args.methods = list(OUR_METHODS + FI_METHODS) + (["fasttree"] if args.fasttree else [])
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; known: {', '.join(ALL_METHODS)}")
    if "fasttree" in args.methods and not args.fasttree:
        ap.error("--methods fasttree needs --fasttree DIR (the folder holding FastTree.py)")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    try:
        args.configs = select_configs(args.sets, args.workloads, args.heads, args.page_sizes)
    except ValueError as e:
        ap.error(str(e))
    return args


# ---------------------------------------------------------------------------- main loop
def bytes_floor(batch, hq, hk, d, elem):
    uniq = unique_kv_tokens(batch.block_tables, batch.seq_lens, batch.page_size)
    return uniq * hk * 2 * d * elem + 2 * batch.batch_size * hq * d * elem


def main(argv=None):
    args = parse_args(argv)
    ft = load_fasttree(args.fasttree) if "fasttree" in args.methods else None
    import torch

    import pat_core
    from pat_core.workloads import build_tree_batch

    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    d = args.head_dim
    flashinfer = None
    fi_version = None
    if not args.no_flashinfer and any(m in FI_METHODS for m in args.methods):
        os.environ.setdefault("NVCC_APPEND_FLAGS", "-static-global-template-stub=false")
        try:
            import flashinfer
            fi_version = getattr(flashinfer, "__version__", "unknown")
        except Exception as e:  # reported, not fatal: our methods still run
            print("flashinfer unavailable:", e, flush=True)
            flashinfer = None
    triton_version = None
    if ft is not None:
        import triton
        triton_version = triton.__version__
    dev = torch.cuda.get_device_properties(0)
    if any(m in OUR_METHODS for m in args.methods):
        from pat_core.cuda_backend import CudaBackend
        t0 = time.time()
        CudaBackend().warmup(jobs=min(16, os.cpu_count() or 1))   # fills the kernel cache
        print(f"compiled our kernels in {time.time() - t0:.1f}s", flush=True)
    bw = copy_bandwidth(2 << 30, 10)
    print(f"device {dev.name}; copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    flush = l2_flusher(128 << 20)
    elem = 2
    rows = []
    configs = args.configs
    not_run = []
    t_start = time.time()
    print(f"{len(configs)} configurations x {len(args.methods)} methods", flush=True)
    for ci, (wl, (hq, hk), ps) in enumerate(configs):
        heads = f"{hq}:{hk}"
        if args.time_budget is not None and time.time() - t_start > args.time_budget:
            not_run = [dict(workload=w, heads=list(h), page_size=p) for w, h, p in configs[ci:]]
            print(f"time budget {args.time_budget:.0f}s spent: {len(not_run)} configurations "
                  "not run", flush=True)
            break
        batch = build_tree_batch(wl, ps, seed=ci)
        gen = torch.Generator(device="cuda").manual_seed(ci)
        kshape = (batch.num_pages, ps, hk, d)
        k = torch.randn(kshape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        v = torch.randn(kshape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        q = torch.randn((batch.batch_size, hq, d), generator=gen, device="cuda",
                        dtype=torch.float32).to(dtype)
        ref = reference_fp64(torch, q, k, v, batch.block_tables, batch.seq_lens, ps)
        base_err = rel_err(torch, torch_attention(torch, q, k, v, batch.block_tables,
                                                  batch.seq_lens, ps), ref)
        tol = 2 * base_err
        floor_bytes = bytes_floor(batch, hq, hk, d, elem)
        floor_us = floor_bytes / bw * 1e6
        # a throwaway run of the first method: the first method timed after the float64
        # reference got a slow graph replay on long batches (bench/NOTES.md, round 8)
        first = list(args.methods[:1]) if args.throwaway else []
        for j, method in enumerate(first + list(args.methods)):
            row = dict(throwaway=j < len(first), workload=wl, heads=[hq, hk], page_size=ps,
                       method=method, batch=batch.batch_size, floor_bytes=floor_bytes,
                       floor_us=floor_us, tol=tol)
            try:
                if method in OUR_METHODS:
                    w, plan = make_ours(torch, pat_core, method, batch, hq, hk, d, ps,
                                        args.dtype)
                    st = plan.stats()
                    row.update(num_ctas=st["num_ctas"], total_bytes=st["total_bytes"],
                               tiles=st["tiles"])
                    fn = lambda: w.run(q, (k, v))  # noqa: E731
                elif method == "fasttree":
                    fn, info = make_fasttree(torch, ft, batch, wl, k, v, q, hq, hk, d,
                                             args.fasttree_tiles)
                    row.update(info)
                    if fn is None:
                        rows.append(row)
                        continue
                elif flashinfer is None:
                    row["skipped"] = "flashinfer unavailable"
                    rows.append(row)
                    continue
                elif method == "fi-decode":
                    w, info = make_fi_decode(torch, flashinfer, batch, hq, hk, d, ps, dtype)
                    row.update(info)
                    fn = lambda: w.run(q, (k, v))  # noqa: E731
                else:
                    w, info = make_fi_cascade(torch, flashinfer, batch, hq, hk, d, ps, dtype)
                    row.update(info)
                    if w is None:
                        rows.append(row)
                        continue
                    fn = lambda: w.run(q, (k, v))  # noqa: E731
                out = fn()
                torch.cuda.synchronize()
                err = rel_err(torch, out, ref)
                row["rel_err"] = err
                row["correct"] = bool(err <= max(tol, 2.0 ** -11))
                if not row["correct"]:
                    print(f"  WRONG {method} on {wl} {heads} ps{ps}: err {err:.2e} > {tol:.2e}",
                          flush=True)
                    rows.append(row)
                    continue
                ts = [t * 1e3 for t in time_events(fn, args.reps, warmup=3, flush=flush)]
                lat = float(np.median(ts))
                row.update(latency_eager_us=lat, latency_p10_us=float(np.percentile(ts, 10)),
                           latency_p90_us=float(np.percentile(ts, 90)))
                # the same call captured in a CUDA graph and replayed: kernel time without the
                # host's launch cost (how serving engines run decode steps)
                gr = capture_graph(torch, fn, ref, tol)
                if isinstance(gr, str):
                    row["graph"] = gr
                else:
                    tg = [t * 1e3 for t in time_events(gr.replay, args.reps, warmup=0,
                                                       flush=flush)]
                    row["latency_graph_us"] = float(np.median(tg))
                    lat = row["latency_graph_us"]
                row.update(latency_us=lat, timing="graph" if "latency_graph_us" in row
                           else "eager", eff_bandwidth=floor_bytes / (lat * 1e-6),
                           floor_ratio=lat / floor_us)
            except Exception as e:  # a method that fails is reported, the run goes on
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"  ERROR {method} on {wl} {heads} ps{ps}: {row['error']}", flush=True)
            rows.append(row)
        rows[:] = [r for r in rows if not r.pop("throwaway", False)]
        with open(os.path.join(args.out, "partial_rows.json"), "w") as fh:
            json.dump(rows, fh)                      # survives a run cut short
        done = ci + 1
        el = time.time() - t_start
        bar = "#" * int(30 * done / len(configs))
        print(f"[{bar:<30}] {done}/{len(configs)} {wl} {heads} ps{ps}  "
              f"{el:.0f}s elapsed, ~{el / done * (len(configs) - done):.0f}s left", flush=True)
        fn = w = out = None                   # FastTree's gathered K/V live in its closure
        del k, v, q, ref
        torch.cuda.empty_cache()
    # speed-ups against each baseline of the same configuration
    by_cfg = {}
    for r in rows:
        by_cfg.setdefault((r["workload"], tuple(r["heads"]), r["page_size"]), {})[r["method"]] = r
    for cfg, methods in by_cfg.items():
        for r in methods.values():
            if "latency_us" not in r:
                continue
            for base in ("query",) + FI_METHODS + FT_METHODS:
                b = methods.get(base)
                if b and "latency_us" in b:
                    r[f"speedup_vs_{base}"] = b["latency_us"] / r["latency_us"]
    result = dict(
        benchmark="compare", device=dev.name, sm_count=dev.multi_processor_count,
        copy_bandwidth=bw, git_sha=git_sha(), l2_flush=flush_mode(),
        dtype=args.dtype,
        head_dim=d, reps=args.reps,
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      cuda=torch.version.cuda, flashinfer=fi_version,
                      triton=triton_version, numpy=np.__version__, pat=pat_core.__version__,
                      cupy=_cupy_version()),
        command=" ".join([os.path.basename(sys.argv[0]) or "compare.py"] +
                         (list(argv) if argv is not None else sys.argv[1:])),
        methods=list(args.methods),
        fasttree_settings=_fasttree_settings(args.fasttree_tiles) if ft else None,
        rows=rows, not_run=not_run,
    )
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", path, flush=True)
    for line in plot_all(result, args.out):
        print(line)
    return result


def _fasttree_settings(tiles):
    return dict(launch_tiles=tiles,
                q_tiles={str(g): list(t) for g, t in FASTTREE_Q_TILES.items()},
                kv_tiles=list(FASTTREE_KV_TILES), kv_splits=list(FASTTREE_KV_SPLITS),
                para_thresh1=list(FASTTREE_PARA_THRESH1),
                para_thresh2=list(FASTTREE_PARA_THRESH2), alpha_beta_gamma=list(FASTTREE_COST),
                source="flashserve/PAT benchmark/FastTree.py, its authors' benchmark settings")


def _cupy_version():
    try:
        import cupy
        return cupy.__version__
    except Exception:
        return None


# ---------------------------------------------------------------- report
# Plots and the markdown summary of a result (plot_all, called by main):
#
# * ``perf_<heads>.png``: performance per workload normalised to pat (latency of pat / latency of
#   the method; pat = 1, higher is faster), bars per method, one figure per head config, as in the
#   PAT paper's kernel figure;
# * ``bandwidth.png``: effective bandwidth of each method against the copy bandwidth (the floor);
# * ``fasttree.png``: pat's speed-up over FastTree per configuration where both were timed;
# * ``summary.md``: the headline numbers, time / floor per method, pat against FastTree per
#   configuration, and one latency table per page size.

ORDER = ("pat", "query", "node", "compute", "pat-fixed", "pat-serial", "fi-decode", "fi-cascade",
         "fasttree")
FI = ("fi-decode", "fi-cascade")
SHARING_FREE = ("128_2048", "256_4096")


def _geo(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def _by_config(result):
    by = {}
    for r in result["rows"]:
        by.setdefault((r["workload"], tuple(r["heads"]), r["page_size"]), {})[r["method"]] = r
    return by


def _pair(a, b):
    """Latencies of two timed rows, like with like: graph replay when both have it, else
    eager; ``(a_us, b_us, "graph" | "eager")``."""
    if "latency_graph_us" in a and "latency_graph_us" in b:
        return a["latency_graph_us"], b["latency_graph_us"], "graph"
    if "latency_eager_us" in a and "latency_eager_us" in b:
        return a["latency_eager_us"], b["latency_eager_us"], "eager"
    return a["latency_us"], b["latency_us"], a.get("timing", "?")


def _status(r) -> str:
    """Why a row has no time: the skip reason, "wrong", "error", or "" when timed."""
    if r is None:
        return "not run"
    if "latency_us" in r:
        return ""
    if "skipped" in r:
        return r["skipped"]
    if r.get("correct") is False:
        return f"wrong (rel. err {r.get('rel_err', float('nan')):.1e})"
    if "error" in r:
        return "error: " + r["error"][:80]
    return "no time"


def fasttree_table(result) -> list:
    """pat against FastTree per configuration (every configuration with a FastTree row, run
    or not): dicts with workload, heads, page_size, pat_us, fasttree_us, speedup (FastTree time /
    pat time, > 1 means pat is faster), pat_eager_us, fasttree_eager_us, speedup_eager, timing;
    times are None and ``status`` says why where one side has none."""
    out = []
    for (wl, heads, ps), m in _by_config(result).items():
        ft = m.get("fasttree")
        if ft is None:
            continue
        pat = m.get("pat")
        row = dict(workload=wl, heads=list(heads), page_size=ps, pat_us=None, fasttree_us=None,
                   speedup=None, pat_eager_us=None, fasttree_eager_us=None, speedup_eager=None,
                   timing=None, status=_status(ft) or (_status(pat) and "pat: " + _status(pat)))
        if pat is not None and "latency_us" in pat and "latency_us" in ft:
            p, f, how = _pair(pat, ft)
            row.update(pat_us=p, fasttree_us=f, speedup=f / p, timing=how)
            if "latency_eager_us" in pat and "latency_eager_us" in ft:
                pe, fe = pat["latency_eager_us"], ft["latency_eager_us"]
                row.update(pat_eager_us=pe, fasttree_eager_us=fe, speedup_eager=fe / pe)
        out.append(row)
    return out


def floor_ratios(result, methods=None) -> dict:
    """Geometric mean of latency / floor per method over the sharing configurations:
    ``{method: {"all": (geomean, n), "fasttree_set": (geomean, n)}}``; "all" over every
    sharing configuration where the method was timed, "fasttree_set" over those where FastTree
    was timed too (the like-for-like set)."""
    by = _by_config(result)
    methods = methods or [m for m in ORDER if any(r["method"] == m for r in result["rows"])]
    out = {}
    for meth in methods:
        every, common = [], []
        for (wl, _, _), m in by.items():
            r = m.get(meth)
            if wl in SHARING_FREE or r is None or "latency_us" not in r:
                continue
            every.append(r["latency_us"] / r["floor_us"])
            if "latency_us" in m.get("fasttree", {}):
                common.append(r["latency_us"] / r["floor_us"])
        out[meth] = {"all": (_geo(every), len(every)), "fasttree_set": (_geo(common),
                                                                        len(common))}
    return out


def headline(result) -> dict:
    """Targets of the comparison, computed from the rows."""
    sp_best, floor_ratio, nosh, wins, total = [], [], [], 0, 0
    for (wl, heads, ps), m in _by_config(result).items():
        pat = m.get("pat")
        if pat is None or "latency_us" not in pat:
            continue
        fis = [_pair(pat, m[b])[:2] for b in FI if b in m and "latency_us" in m[b]]
        if wl in SHARING_FREE:
            if "fi-decode" in m and "latency_us" in m["fi-decode"]:
                p, f, _ = _pair(pat, m["fi-decode"])
                nosh.append(f / p)
            continue
        floor_ratio.append(pat["latency_us"] / pat["floor_us"])
        if fis:
            total += 1
            wins += all(p < f for p, f in fis)
            sp_best.append(min(f / p for p, f in fis))
    ftt = [x for x in fasttree_table(result) if x["speedup"] is not None]
    sp_ft = [x["speedup"] for x in ftt]
    sp_fte = [x["speedup_eager"] for x in ftt if x["speedup_eager"] is not None]
    return dict(sharing_configs=total, pat_faster_than_all_fi=wins,
                geomean_speedup_vs_best_fi=_geo(sp_best),
                geomean_floor_ratio=_geo(floor_ratio),
                min_nosharing_ratio_vs_fi_decode=min(nosh) if nosh else float("nan"),
                fasttree_configs=len(ftt),
                pat_faster_than_fasttree=int(sum(x > 1 for x in sp_ft)),
                geomean_speedup_vs_fasttree=_geo(sp_ft),
                geomean_speedup_vs_fasttree_eager=_geo(sp_fte),
                min_speedup_vs_fasttree=min(sp_ft) if sp_ft else float("nan"))


def plot_all(result, out_dir) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "latency_us" in r]
    lines = []
    heads_all = sorted({tuple(r["heads"]) for r in result["rows"]})
    ps_all = sorted({r["page_size"] for r in result["rows"]})
    wls = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    methods = [m for m in ORDER if any(r["method"] == m for r in rows)]
    lat = {(r["workload"], tuple(r["heads"]), r["page_size"], r["method"]): r["latency_us"]
           for r in rows}
    ps0 = ps_all[0]
    for heads in heads_all:
        fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(wls)), 4))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            vals = []
            for wl in wls:
                p = lat.get((wl, heads, ps0, "pat"))
                x = lat.get((wl, heads, ps0, m))
                vals.append(p / x if p and x else 0.0)
            ax.bar(np.arange(len(wls)) + i * width, vals, width, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(wls)) + 0.4 - width / 2)
        ax.set_xticklabels(wls, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("performance normalised to pat")
        ax.set_title(f"{result['device']}: heads {heads[0]}:{heads[1]}, page {ps0}, "
                     f"{result['dtype']}, d={result['head_dim']}")
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        path = os.path.join(out_dir, f"perf_{heads[0]}_{heads[1]}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines.append(f"wrote {path}")
    # bandwidth vs floor
    fig, ax = plt.subplots(figsize=(8, 4))
    for m in methods:
        xs = [r["floor_us"] for r in rows if r["method"] == m]
        ys = [r["eff_bandwidth"] / 1e12 for r in rows if r["method"] == m]
        ax.scatter(xs, ys, s=12, label=m)
    ax.axhline(result["copy_bandwidth"] / 1e12, color="k", ls="--", lw=1,
               label="copy bandwidth")
    ax.set_xscale("log")
    ax.set_xlabel("floor latency (us): bytes that must move / copy bandwidth")
    ax.set_ylabel("effective bandwidth (TB/s)")
    ax.set_title(f"{result['device']}: effective bandwidth vs the floor")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = os.path.join(out_dir, "bandwidth.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    lines.append(f"wrote {path}")
    # pat over FastTree, per configuration
    ftt = [x for x in fasttree_table(result) if x["speedup"] is not None]
    if ftt:
        fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(ftt)), 4))
        xs = np.arange(len(ftt))
        sp = [x["speedup"] for x in ftt]
        ax.bar(xs, sp, 0.8, color=["tab:green" if v > 1 else "tab:red" for v in sp])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x['workload']} {x['heads'][0]}:{x['heads'][1]} p{x['page_size']}"
                            for x in ftt], rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("FastTree time / pat time")
        ax.set_title(f"{result['device']}: pat over FastTree ({sum(v > 1 for v in sp)} of "
                     f"{len(sp)} faster, geomean {_geo(sp):.2f}x)")
        fig.tight_layout()
        path = os.path.join(out_dir, "fasttree.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines.append(f"wrote {path}")
    # summary
    h = headline(result)
    heads_lines = [
        f"- sharing configs where pat beats both FlashInfer methods: "
        f"{h['pat_faster_than_all_fi']} / {h['sharing_configs']}",
        f"- geometric-mean speed-up of pat over the faster FlashInfer method (sharing): "
        f"{h['geomean_speedup_vs_best_fi']:.2f}x",
        (f"- sharing configs where pat beats FastTree: {h['pat_faster_than_fasttree']} / "
         f"{h['fasttree_configs']}; geometric-mean speed-up of pat over FastTree "
         f"{h['geomean_speedup_vs_fasttree']:.2f}x "
         f"(eager {h['geomean_speedup_vs_fasttree_eager']:.2f}x), "
         f"worst {h['min_speedup_vs_fasttree']:.2f}x" if h["fasttree_configs"] else
         "- FastTree: no configuration timed"),
        f"- geometric mean of pat latency / floor (sharing): {h['geomean_floor_ratio']:.2f}",
        f"- worst no-sharing ratio fi-decode / pat: {h['min_nosharing_ratio_vs_fi_decode']:.3f}"]
    ver = result.get("versions", {})
    md = [f"# pat vs FlashInfer and FastTree on {result['device']}", "",
          f"git {result['git_sha'][:10]}, {result['dtype']}, head_dim {result['head_dim']}, "
          f"median of {result['reps']}, L2 flushed ({result.get('l2_flush', 'dirty')}); "
          f"copy bandwidth "
          f"{result['copy_bandwidth'] / 1e12:.2f} TB/s; versions {ver}", ""]
    if result.get("command"):
        md += [f"command: `{result['command']}`", ""]
    md += heads_lines + [""]
    if result.get("not_run"):
        md += [f"**{len(result['not_run'])} configurations not run** (time budget).", ""]
    # time / floor per method
    fr = floor_ratios(result, methods)
    md += ["## latency / floor, geometric mean over sharing configurations", "",
           "(graph replay where captured, else eager; \"FastTree's set\": the configurations "
           "where FastTree was timed)", "",
           "| method | all sharing configs | n | FastTree's set | n |", "|---|---|---|---|---|"]
    for m in methods:
        (ga, na), (gc, nc) = fr[m]["all"], fr[m]["fasttree_set"]
        md.append(f"| {m} | {ga:.2f} | {na} | {gc:.2f} | {nc} |" if nc else
                  f"| {m} | {ga:.2f} | {na} | - | 0 |")
    md.append("")
    ftt = fasttree_table(result)
    if ftt:
        md += ["## pat vs FastTree per configuration", "",
               "speed-up = FastTree time / pat time (> 1: pat faster); graph replay when both "
               "were captured, else eager", "",
               "| workload | heads | page | pat us | FastTree us | speed-up | eager speed-up |"
               " timing / why not |", "|---|---|---|---|---|---|---|---|"]
        for x in ftt:
            f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
            md.append(f"| {x['workload']} | {x['heads'][0]}:{x['heads'][1]} | "
                      f"{x['page_size']} | {f(x['pat_us'], '.1f')} | "
                      f"{f(x['fasttree_us'], '.1f')} | {f(x['speedup'], '.2f')} | "
                      f"{f(x['speedup_eager'], '.2f')} | {x['timing'] or x['status']} |")
        md.append("")
    for ps in ps_all:
        md.append(f"## page size {ps}: latency in us (floor, then each method; * = wrong, "
                  f"- = not run)")
        md.append("")
        md.append("| workload | heads | floor | " + " | ".join(methods) + " |")
        md.append("|---|---|---|" + "---|" * len(methods))
        for wl in wls:
            for heads in heads_all:
                cells = []
                floor = next((r["floor_us"] for r in result["rows"] if r["workload"] == wl
                              and tuple(r["heads"]) == heads and r["page_size"] == ps), None)
                if floor is None:
                    continue
                for m in methods:
                    r = next((r for r in result["rows"] if r["workload"] == wl and
                              tuple(r["heads"]) == heads and r["page_size"] == ps and
                              r["method"] == m), None)
                    if r is None or ("latency_us" not in r and r.get("correct", True)):
                        cells.append("-")
                    elif "latency_us" not in r:
                        cells.append("*")
                    else:
                        cells.append(f"{r['latency_us']:.1f}")
                md.append(f"| {wl} | {heads[0]}:{heads[1]} | {floor:.1f} | " +
                          " | ".join(cells) + " |")
        md.append("")
    reasons = {}
    for r in result["rows"]:
        if "latency_us" not in r and r.get("skipped"):
            reasons.setdefault((r["method"], r["skipped"]), 0)
            reasons[(r["method"], r["skipped"])] += 1
    if reasons:
        md += ["## not run, and why", ""]
        md += [f"- {m}: {why} ({n} configs)" for (m, why), n in sorted(reasons.items())]
        md.append("")
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")
    lines.append(f"wrote {path}")
    lines.extend(heads_lines)
    return lines


if __name__ == "__main__":
    main()
