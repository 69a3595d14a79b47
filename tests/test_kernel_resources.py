"""The kernel resource data file (pat_core/data/kernel_resources.json) is complete and current.

CPU only.  The data checks need no compiler: every variant the backend can launch is listed with
the shared memory the launcher requests, no variant spills (but the graph-safe ones on sm_80, a
few bytes: ``kernel_resources.spill_allowed``) or exceeds its architecture's shared
memory, and the file's source hash matches the CUDA sources (regenerate with
``python3 bench/kernel_resources.py`` after editing ``cuda_src/``).  With ``nvcc`` on PATH, a
subset of variants is recompiled for sm_80 and sm_90 and must match the file.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import kernel_resources as kr
from pat_core import cuda_compile as cc


@pytest.fixture(scope="module")
def data():
    path = cc.resources_path()
    assert path.is_file(), f"{path} missing: run python3 bench/kernel_resources.py"
    return json.loads(path.read_text())


def _families(keys) -> set:
    """``(kind, head_dim, dtype)`` of variant keys (``pat_fwd_d128_f16_...``)."""
    return {tuple(k.split("_")[1:4]) for k in keys}


def test_schema_and_completeness(data):
    assert data["generator"] == "bench/kernel_resources.py"
    assert data["nvcc"] and data["source_hash"]
    want = {v.key: v for v in cc.resource_variants()}
    listed = set(want)
    if data["source_hash"] != cc.source_hash():
        # a file older than the sources (test_source_hash_current fails for that) may lack a
        # kernel family added since (head_dim, dtype); the tile solver estimates those
        # (pat_core.tiles.kernel_resources), and every family it does list must be complete
        listed = {k for k in want if _families([k]) <= _families(data["variants"])}
    assert set(data["variants"]) == listed, "variant list differs from pat_core.cuda_compile"
    for key, rec in data["variants"].items():
        v = want[key]
        assert rec["head_dim"] == v.head_dim and rec["dtype"] == v.dtype
        assert rec["warps"] == v.warps and rec["threads"] == v.threads
        if isinstance(v, cc.FwdVariant):
            assert (rec["m"], rec["n"], rec["stages"]) == (v.m, v.n, v.stages)
        assert rec["kind"] == ("merge" if isinstance(v, cc.MergeVariant) else "forward"), key
        assert set(a for a in ("sm_80", "sm_90") if a in rec) == set(cc.variant_archs(v)), key
        for arch in cc.variant_archs(v):
            r = rec[arch]
            for field in ("registers", "smem_static", "smem_dynamic", "spill_stores",
                          "spill_loads"):
                assert isinstance(r[field], int), (key, arch, field)
            assert r["smem_dynamic"] == v.smem_bytes, f"{key}: launcher smem differs from file"


def test_no_spills_and_within_limits(data):
    bad = []
    for key, rec in data["variants"].items():
        for arch in (("sm_90",) if rec.get("rows_per_warp") == cc.WG_ROWS else ("sm_80", "sm_90")):
            r = rec[arch]
            if (r["spill_stores"] or r["spill_loads"] or r.get("stack_frame", 0)) \
                    and not kr.spill_allowed(rec, arch, r):
                bad.append(f"{key} {arch} spills/stack")
            if r["registers"] > 255:
                bad.append(f"{key} {arch} registers {r['registers']}")
            if arch == "sm_90" and r["smem_static"] + r["smem_dynamic"] > cc.SMEM_LIMIT[arch]:
                bad.append(f"{key} {arch} smem")
    assert not bad, bad


def test_source_hash_current(data):
    assert data["source_hash"] == cc.source_hash(), (
        "cuda_src/ changed since pat_core/data/kernel_resources.json was generated: "
        "run python3 bench/kernel_resources.py")


# a few variants spanning the shapes: smallest, the decode hot path, largest, merge, and
# head_dim 256's largest-ring 16-row tile, its largest tile and its merge
_SUBSET = ("pat_fwd_d64_f16_m16_n16", "pat_fwd_d128_f16_m16_n64", "pat_fwd_d128_bf16_m16_n128",
           "pat_fwd_d128_f16_m128_n128", "pat_merge_d128_bf16", "pat_fwd_d256_f16_m16_n64",
           "pat_fwd_d256_bf16_m128_n64", "pat_merge_d256_f16")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_recompile_subset_matches(data):
    allv = cc.all_fwd_variants() + cc.all_merge_variants()
    subset = [v for v in allv if any(v.key.startswith(p + "_") for p in _SUBSET)]
    assert len(subset) >= len(_SUBSET)   # m >= 64: a warpgroup (sm_90) and an mma.sync layout
    same_nvcc = cc.nvcc_version() == data["nvcc"]
    tasks = [(v, a) for v in subset for a in cc.variant_archs(v)]
    with ThreadPoolExecutor(max_workers=4) as ex:
        got = list(ex.map(lambda t: kr.compile_variant(t[0], t[1]), tasks))
    for (v, arch), r in zip(tasks, got):
        assert (r["spill_stores"] == 0 and r["spill_loads"] == 0) \
            or kr.spill_allowed(kr.variant_record(v), arch, r), (v.key, arch, r)
        assert r["smem_dynamic"] + r["smem_static"] <= cc.SMEM_LIMIT["sm_90"]
        if same_nvcc and v.key in data["variants"]:   # (a stale file may lack a family)
            rec = data["variants"][v.key][arch]
            assert r["registers"] == rec["registers"], (v.key, arch, r, rec)


def test_backend_plan_checks_without_gpu():
    """The CUDA backend module imports without CuPy; its plan checks run on the CPU."""
    import numpy as np
    from pat_core import cuda_backend
    from pat_core.planner import Planner
    from pat_core.workloads import build_tree_batch
    assert isinstance(cuda_backend.is_available(), bool)
    b = build_tree_batch("1,4_40,20", page_size=16)
    plan = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 8, 2, 128, 16)
    cuda_backend._check_plan_tiles(plan)            # a planner's plan passes
    # the node packer lists every request in the root's CTA and again in its leaf's: 8 pairs
    bad = Planner("node", "h100").plan(b.block_tables, b.seq_lens, 8, 2, 128, 16)
    bad.cta_req_indptr = np.array([0, len(bad.cta_req)] + [len(bad.cta_req)] * (bad.num_ctas - 1),
                                  dtype=np.int32)
    bad.tile_configs = np.full_like(bad.tile_configs, 16)
    bad.tile_configs[:, 1] = 16
    # every request in CTA 0 now: more rows than its 16-row tile holds
    assert len(bad.cta_req) * bad.group_size > 16
    with pytest.raises(ValueError, match="rows"):
        cuda_backend._check_plan_tiles(bad)
    odd = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 8, 2, 128, 16)
    odd.tile_configs = np.full_like(odd.tile_configs, 48)
    with pytest.raises(ValueError, match="no CUDA kernel"):
        cuda_backend._check_plan_tiles(odd)
    assert cc.fwd_variant_supported(16, 64, 128) and not cc.fwd_variant_supported(16, 256, 128)


def test_variant_support_follows_layout_overrides():
    """fwd_variant_supported is memoised, but a tile's layout override is part of its key: a
    layout too large for shared memory makes the tile unsupported, and dropping it restores
    the answer."""
    assert cc.fwd_variant_supported(16, 64, 128)
    saved = dict(cc.VARIANT_OVERRIDES)
    try:
        cc.VARIANT_OVERRIDES[(16, 64)] = (1, 8)          # 8 stages of a 64-token K/V tile
        assert not cc.fwd_variant_supported(16, 64, 128)
    finally:
        cc.VARIANT_OVERRIDES.clear()
        cc.VARIANT_OVERRIDES.update(saved)
    assert cc.fwd_variant_supported(16, 64, 128)
