"""Small plans run once each on the GPU, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool=memcheck python3 bench/device/sanitize_case.py [--warpgroup-only |
        --features]

Each case prints its plan's shape and whether the output is finite; the sanitizer's SUMMARY
line is the verdict.  Run from the repository root (bench/device/device_session.sh and
bench/lab/gpu_check.py do).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def sanitize_case(warpgroup_only: bool = False):
    """Small plans run once each on CuPy arrays (no torch): for compute-sanitizer.
    ``warpgroup_only``: just the forced warpgroup tiles (a quick racecheck of their KV walk)."""
    import cupy
    import numpy as np
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    from pat_core import cuda_compile as cc
    from pat_core.cuda_backend import CudaBackend
    backend = CudaBackend()
    cases = [("1,4,16_100,37,61", 16, 32, 8, 128, "NHD", None),
             ("1,3,9_70,20,33", 1, 12, 4, 64, "HND", None)]
    # the short-KV tiles forced onto CTAs of many tiles
    cases += [("1,4,16_100,37,61", 16, 32, 8, 128, "NHD", t) for t in ((16, 16), (16, 32))]
    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    if cc.FwdVariant.make(64, 64, 128, "float16", arch=arch).warpgroup:   # every warpgroup tile
        cases += [("1,32_300,20", 16, 32, 8, 128, "NHD", t)
                  for t in ((64, 16), (64, 32), (64, 64), (64, 128), (128, 16), (128, 32),
                            (128, 64), (128, 128))]
        # the 64-row tiles on two token slices (two warpgroups, 8 warps; (m, n, warps))
        cases += [("1,32_300,20", 16, 32, 8, 128, "NHD", t)
                  for t in ((64, 32, 8), (64, 64, 8), (64, 128, 8))]
    if warpgroup_only:
        cases = [c for c in cases if c[6] is not None and c[6][0] >= 64]
    else:
        # the pat packer's per-request plans (every request one slot: each forward item writes
        # its request's output, no merge), and one slot per request with more items than
        # resident blocks (blocks draw items; the merge runs only to reset the counters)
        cases += [("1,8_16,240", 16, 8, 2, 64, "NHD", None),
                  ("128_40", 16, 32, 8, 128, "NHD", None)]
    for spec, ps, hq, hk, d, layout, tile in cases:
        cc.VARIANT_OVERRIDES.clear()
        if tile is not None and tile[0] >= 64:   # the warpgroup layout, two stages
            warps = tile[2] if len(tile) > 2 else tile[0] // 16
            tile = tile[:2]
            cc.VARIANT_OVERRIDES[tile] = (warps, 2, cc.WG_ROWS)
        b = build_tree_batch(spec, page_size=ps, seed=2)
        w = PrefixAttentionWrapper(backend="cuda", packer="pat", kv_layout=layout)
        w._gpu_backend = backend
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16",
                      tile=tile)
        assert spec != "1,8_16,240" or plan.one_cta_per_request
        rng = np.random.default_rng(0)
        shape = (b.num_pages, ps, hk, d) if layout == "NHD" else (b.num_pages, hk, ps, d)
        k = cupy.asarray(rng.standard_normal(shape).astype(np.float16))
        v = cupy.asarray(rng.standard_normal(shape).astype(np.float16))
        q = cupy.asarray(rng.standard_normal((b.batch_size, hq, d)).astype(np.float16))
        out, lse = w.run(q, (k, v), return_lse=True)
        cupy.cuda.Device().synchronize()
        print(f"{spec} {layout}: groups={plan.num_groups} slots={plan.num_slots} "
              f"batch={plan.batch_size} tiles={plan.stats()['tiles']} "
              f"variants={[v.key for v in backend.variants_for(plan)][:-1]} "
              f"finite={bool(cupy.isfinite(out).all())}")
    cc.VARIANT_OVERRIDES.clear()
    if warpgroup_only:
        return
    # graph-safe launch sets (pull kernels: a block's first item is its own, later ones drawn
    # from a counter), one launch per tile and fused; two plans each, the second with more
    # items than the grid so that blocks draw
    for fused in ("off", "on"):
        w = PrefixAttentionWrapper(backend="cuda", packer="pat", use_cuda_graph=True,
                                   max_batch_size=24, max_num_pages=4096)
        w._gpu_backend.graph_fused = fused
        for spec in ("1,4,16_100,37,61", "1,24_1000,2000"):
            b = build_tree_batch(spec, page_size=16, seed=3)
            plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float16")
            rng = np.random.default_rng(1)
            k = cupy.asarray(rng.standard_normal((4096, 16, 8, 128)).astype(np.float16))
            v = cupy.asarray(rng.standard_normal((4096, 16, 8, 128)).astype(np.float16))
            q = cupy.asarray(rng.standard_normal((24, 32, 128)).astype(np.float16))
            out = cupy.zeros_like(q)
            w.run(q, (k, v), out=out)
            cupy.cuda.Device().synchronize()
            st = w._static
            print(f"graph-safe fused={fused} {spec}: items={plan.num_ctas * 8} "
                  f"grids={st.grids} tiles={len(st.layout.tiles)} "
                  f"finite={bool(cupy.isfinite(out[:b.batch_size]).all())}")


def features_case():
    """The engine features' kernels, one small plan each: an FP8 cache (random e4m3 bytes, no
    NaN codes, scales), a batch-invariant plan over several chunks, head_dim 256, and
    multi-token queries (mixed 1..5 tokens per request, causal)."""
    import dataclasses
    import cupy
    import numpy as np
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    rng = np.random.default_rng(4)
    spec = "1,4,12_300,70,45"
    b = build_tree_batch(spec, page_size=16, seed=5)
    B = b.batch_size
    qo = np.concatenate([[0], np.cumsum(rng.integers(1, 6, B))]).astype(np.int32)
    cases = [("fp8", 128, dict(kv_data_type="float8_e4m3fn", q_data_type="float16"),
              dict(k_scale=0.5, v_scale=1.5), B),
             ("invariant", 128, dict(kv_data_type="float16", batch_invariant=True), {}, B),
             ("hd256", 256, dict(kv_data_type="float16"), {}, B),
             ("qo_indptr", 128, dict(kv_data_type="float16", qo_indptr=qo), {}, int(qo[-1]))]
    for name, d, pkw, rkw, rows in cases:
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        if name == "invariant":                         # several chunks per request
            w.planner.tuning = dataclasses.replace(w.planner.tuning, invariant_chunk=64)
        plan = w.plan(b.block_tables, b.seq_lens, 32, 8, d, 16, **pkw)
        shape = (b.num_pages, 16, 8, d)
        if name == "fp8":
            k, v = (rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(2))
            for x in (k, v):
                x[(x & 0x7F) == 0x7F] = 0                  # no NaN codes
            k, v = cupy.asarray(k), cupy.asarray(v)
        else:
            k, v = (cupy.asarray(rng.standard_normal(shape).astype(np.float16))
                    for _ in range(2))
        q = cupy.asarray(rng.standard_normal((rows, 32, d)).astype(np.float16))
        out = w.run(q, (k, v), **rkw)
        cupy.cuda.Device().synchronize()
        print(f"feature {name} {spec}: ctas={plan.num_ctas} slots={plan.num_slots} "
              f"tiles={plan.stats()['tiles']} finite={bool(cupy.isfinite(out).all())}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warpgroup-only", action="store_true",
                    help="just the forced warpgroup tiles (a quick racecheck of their KV walk)")
    ap.add_argument("--features", action="store_true",
                    help="the engine features' kernels instead (FP8 KV, batch-invariant plans, "
                         "head_dim 256, multi-token queries)")
    args = ap.parse_args(argv)
    if args.features:
        features_case()
    else:
        sanitize_case(args.warpgroup_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
