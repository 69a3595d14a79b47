"""``python -m pat_core demo``: plan one batch with every packer, run it, check it, print a table.

On a machine without a GPU the forward pass is the tile-faithful CPU executor; with a CUDA
device and CuPy (``--backend cuda``) it is the real kernels.  The simulator's view of the same
batch is ``python -m sim compare`` (the simulator imports pat_core, never the reverse).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _parse_heads(s: str):
    try:
        a, b = s.split(":")
        hq, hk = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads must look like 32:8, got {s!r}") from None
    if hq < 1 or hk < 1 or hq % hk:
        raise argparse.ArgumentTypeError(f"--heads {s}: both >= 1 and the first a multiple of "
                                         f"the second")
    return hq, hk


def demo(args) -> int:
    from . import PACKERS, PrefixAttentionWrapper
    from .reference import dense_attention, lowp_attention, relative_error
    from .workloads import build_tree_batch, random_kv_cache

    hq, hk = args.heads
    if args.head_dim < 1 or args.page_size < 1:
        raise SystemExit("--head-dim and --page-size must be >= 1")
    batch = build_tree_batch(args.tree, args.page_size, seed=args.seed)
    dtype = {"float16": np.float16, "float32": np.float32}[args.dtype]
    k, v = random_kv_cache(batch.num_pages, args.page_size, hk, args.head_dim, dtype=dtype,
                           seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    q = rng.standard_normal((batch.batch_size, hq, args.head_dim)).astype(dtype)
    t0 = time.perf_counter()
    ref = dense_attention(q, (k, v), batch.block_tables, batch.seq_lens, args.page_size)
    t_ref = time.perf_counter() - t0
    tol_note = "fp32: rel err <= 1e-5"
    tol = 1e-5
    if args.dtype == "float16":
        base = relative_error(lowp_attention(q, (k, v), batch.block_tables, batch.seq_lens,
                                             args.page_size), ref)
        tol = 2 * base
        tol_note = f"fp16: rel err <= 2 x plain fp16 ({base:.2e})"

    print(f"batch {args.tree}: {batch.batch_size} requests, {int(batch.seq_lens.sum())} tokens "
          f"listed, {batch.num_pages} pages of {args.page_size}; heads {hq}:{hk}, "
          f"head_dim {args.head_dim}, {args.dtype}; backend {args.backend}")
    header = (f"{'packer':<8} {'CTAs':>6} {'slots':>6} {'KV MB':>9} {'total MB':>9} "
              f"{'vs query':>8} {'plan ms':>8} {'run s':>7} {'rel err':>9}  ok  tiles")
    print(header)
    print("-" * len(header))
    rows = []
    failed = False
    query_total = None
    for packer in ("query",) + tuple(p for p in PACKERS if p != "query"):
        w = PrefixAttentionWrapper(backend=args.backend, packer=packer, gpu=args.gpu)
        t0 = time.perf_counter()
        plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, args.head_dim,
                      args.page_size, kv_data_type=args.dtype)
        t_plan = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        if args.backend == "cuda":
            import cupy as cp
            out = cp.asnumpy(w.run(cp.asarray(q), (cp.asarray(k), cp.asarray(v))))
        else:
            out = w.run(q, (k, v))
        t_run = time.perf_counter() - t0
        err = relative_error(out, ref)
        ok = err <= tol
        failed |= not ok
        st = plan.stats()
        if query_total is None:
            query_total = st["total_bytes"]
        tiles = " ".join(f"{k}:{v}" for k, v in st["tiles"].items())
        print(f"{packer:<8} {st['num_ctas']:>6} {st['num_slots']:>6} "
              f"{st['kv_bytes'] / 1e6:>9.2f} {st['total_bytes'] / 1e6:>9.2f} "
              f"{st['total_bytes'] / query_total:>8.3f} {t_plan:>8.2f} {t_run:>7.2f} "
              f"{err:>9.2e}  {'yes' if ok else 'NO '} {tiles}")
        rows.append((packer, st, err))
    forest = plan.extra.get("forest")
    if forest is not None:
        kvb = 2 * args.head_dim * hk * (2 if args.dtype == "float16" else 4)
        print(f"unique KV (each shared token once): {forest.unique_tokens() * kvb / 1e6:.2f} MB;"
              f" dense reference {t_ref:.2f} s; tolerance {tol_note}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pat_core",
                                 description="pat: prefix-aware decode attention")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="plan a tree batch with every packer, run, check, report")
    d.add_argument("--tree", default="1,4,16_128,256,1024",
                   help="tree spec: node counts per level _ tokens per level node")
    d.add_argument("--heads", type=_parse_heads, default=(32, 8), help="num_qo:num_kv")
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    d.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--gpu", default=None, help="GPU model to plan for (h100, h200, a100)")
    d.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
