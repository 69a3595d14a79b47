"""Multi-token queries on the CUDA backend's host side: the device buffer (the plan's token view
with causal limits and flags, ``StaticLayout.pack``), the multi-token kernel variants' names,
the graph-safe ``max_num_qo_tokens`` limit.  No GPU: the packed buffer is run through the CPU
executor's tile loop exactly as the kernels read it, against the float64 reference."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core import cuda_compile as cc
from pat_core.executor import _ROUND, _run_ctas, nhd_view
from pat_core.inputs import MAX_QO_LEN
from pat_core.merge import merge_partials
from pat_core.reference import dense_attention, relative_error
from pat_core.static_plan import StaticLayout, StaticLimits, reachable_tiles
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import head_configs, prefix_batches
from strategies import qo_indptrs


def _limits_for(plan, multi=True, **over):
    kw = dict(max_batch_size=plan.batch_size,
              max_num_pages=max(1, plan.cta_pages.shape[0] - plan.num_ctas),
              max_ctas=plan.num_ctas, max_partials=plan.num_partial_rows,
              max_num_qo_tokens=plan.num_qo_tokens if multi else None)
    kw.update(over)
    return StaticLimits(**kw)


def _run_packed(layout, buf, q, kc, vc, group, page_size, sm_scale):
    """What the forward and merge kernels compute from a packed device buffer: every live CTA
    of every launch-set variant (its tile's ``n``), over the buffer's request tables, causal
    limits and flags, then the merge over its ``req_slot_indptr`` (q rows = its batch)."""
    u = layout.unpack(buf)
    C = int(u["live"][:, 1].sum())
    cta_n = np.zeros(C, dtype=np.int32)
    for v, (first, count) in enumerate(u["live"].tolist()):
        cta_n[first:first + count] = layout.tiles[v][1]
    rows = int(u["req_slot_indptr"][-1])
    hq, d = q.shape[1], q.shape[2]
    o = np.full((rows, hq, d), np.nan, dtype=np.float32)
    lse = np.full((rows, hq), np.nan, dtype=np.float32)
    if layout.limits.multi_token:
        lim, causal = u["cta_kv_limit"], u["cta_causal"]
    else:                        # the one-token kernels: no limits, nothing masked
        lim = np.repeat(u["cta_kv_len"], np.diff(u["cta_req_indptr"])).astype(np.int32)
        causal = np.zeros(C, dtype=np.int32)
    bits, min_exp = _ROUND["float32"]
    _run_ctas(q, kc, vc, u["cta_req_indptr"], u["cta_req"], u["cta_slot"], u["cta_kv_start"],
              u["cta_kv_len"], u["cta_page_indptr"], u["cta_pages"], cta_n, page_size, group,
              np.float32(sm_scale), bits, min_exp, lim, causal, o, lse)
    assert not np.isnan(o).any(), "every partial row is written"
    return merge_partials(o, lse, u["req_slot_indptr"])


@given(prefix_batches(max_requests=10, max_node_pages=2), head_configs(),
       st.sampled_from(PACKERS), st.booleans(), st.data())
def test_packed_token_view_matches_dense(b, heads, packer, split, data):
    """The device buffer of a multi-token plan (token view, CTAs regrouped by launch variant,
    each pair's limit and each CTA's flag moved with it), run as the kernels read it, equals
    float64 dense attention with the causal rule, for q row and LSE."""
    hq, hk = heads
    d = 32
    qo = data.draw(qo_indptrs(b.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    planner = Planner(packer, "h100")
    plan = planner.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
                        kv_data_type="float32", qo_indptr=qo, split="mean" if split else False)
    # launch-set order differs from the plan's tile order, so CTAs get regrouped
    tiles = sorted({(int(m), int(n)) for m, n in plan.tile_configs.tolist()})
    layout = StaticLayout(_limits_for(plan), tiles)
    buf = layout.pack(plan)
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, d, seed=1)
    q = np.random.default_rng(2).standard_normal((int(qo[-1]), hq, d)).astype(np.float32)
    out, lse = _run_packed(layout, buf, q, nhd_view(k, "NHD"), nhd_view(v, "NHD"), hq // hk,
                           b.page_size, plan.sm_scale)
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   return_lse=True, qo_indptr=qo)
    assert relative_error(out, ref) < 1e-5
    assert np.allclose(lse, ref_lse, rtol=0, atol=1e-4)
    u = layout.unpack(buf)
    assert u["batch_size"] == plan.num_qo_tokens          # the merge's rows: query tokens
    assert np.array_equal(u["req_slot_indptr"], plan.token_slot_indptr)


def test_one_token_plan_packs_as_before():
    """A one-token plan in a one-token layout: the buffer holds the Plan's own arrays, no
    causal arrays (the layout is that of before multi-token queries); in a multi-token layout
    the same arrays plus limits = kv_len and flags 0 (nothing masked)."""
    b = build_tree_batch("1,4,16_128,40,33", page_size=16)
    plan = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 64, 16, split="mean")
    tiles = sorted({(int(m), int(n)) for m, n in plan.tile_configs.tolist()})
    one = StaticLayout(_limits_for(plan, multi=False), tiles)
    assert one.size["cta_kv_limit"] == 0 and one.size["cta_causal"] == 0
    multi = StaticLayout(_limits_for(plan), tiles)
    u1, um = one.unpack(one.pack(plan)), multi.unpack(multi.pack(plan))
    for name in ("cta_req_indptr", "cta_req", "cta_slot", "cta_kv_start", "cta_kv_len",
                 "cta_page_indptr", "cta_pages", "req_slot_indptr", "live"):
        assert np.array_equal(u1[name], um[name]), name
    assert u1["batch_size"] == um["batch_size"] == plan.batch_size
    assert np.array_equal(um["cta_kv_limit"],
                          np.repeat(um["cta_kv_len"], np.diff(um["cta_req_indptr"])))
    assert not um["cta_causal"].any()
    assert np.array_equal(np.sort(u1["cta_slot"]), np.arange(plan.num_slots))


def test_multitoken_limits_named():
    """A multi-token plan needs a layout with max_num_qo_tokens, and its tokens and partial
    rows are checked against the limits, each refusal naming its limit."""
    b = build_tree_batch("1,4_200,40", page_size=16)
    qo = np.concatenate([[0], np.cumsum([3, 1, 4, 2])]).astype(np.int32)
    plan = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 8, 8, 64, 16, qo_indptr=qo)
    assert plan.multi_token and plan.num_partial_rows > plan.num_slots
    tiles = sorted({(int(m), int(n)) for m, n in plan.tile_configs.tolist()})
    StaticLayout(_limits_for(plan), tiles).pack(plan)
    with pytest.raises(ValueError, match="max_num_qo_tokens"):
        StaticLayout(_limits_for(plan, multi=False, max_partials=10**4), tiles).pack(plan)
    with pytest.raises(ValueError, match="max_num_qo_tokens=9.*query tokens|query tokens.*"
                                         "max_num_qo_tokens=9"):
        StaticLayout(_limits_for(plan, max_num_qo_tokens=9), tiles).pack(plan)
    with pytest.raises(ValueError, match="max_partials"):
        StaticLayout(_limits_for(plan, max_partials=plan.num_partial_rows - 1), tiles).pack(plan)
    with pytest.raises(ValueError, match="max_num_qo_tokens=3 is less than max_batch_size"):
        StaticLimits(4, 10, 8, 8, max_num_qo_tokens=3)
    with pytest.raises(ValueError, match="max_num_qo_tokens"):
        StaticLimits(4, 10, 8, 8, max_num_qo_tokens=0)
    lim = StaticLimits.make(8, 100, max_num_qo_tokens=32)
    assert lim.multi_token and lim.max_tokens == 32
    assert lim.max_partials == 4 * 32 + lim.max_ctas
    assert lim.max_cta_rows(4) == 32 * 4
    assert not StaticLimits.make(8, 100).multi_token and StaticLimits.make(8, 100).max_tokens == 8
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        PrefixAttentionWrapper(backend="cpu", max_num_qo_tokens=4)


def test_multitoken_layout_sized_by_tokens():
    lay = StaticLayout(StaticLimits(5, 50, 7, 9, max_num_qo_tokens=20), ((16, 16), (32, 64)))
    assert lay.size["req_slot_indptr"] == 21
    assert lay.size["cta_kv_limit"] == 9 and lay.size["cta_causal"] == 7
    spans = sorted((lay.offset[f], lay.offset[f] + lay.size[f]) for f in lay.offset)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 == b0
    assert lay.offset["cta_pages"] == max(lay.offset.values())


def test_reachable_tiles_cover_multitoken_rows():
    """A graph-safe bucket of multi-token steps reaches the tiles its CTAs' token rows need."""
    sel = Planner("pat", "h100").tile_selector(128, "float16")
    lim = StaticLimits.make(4, 100, max_num_qo_tokens=32)
    ms = {m for m, _ in reachable_tiles(sel, max_rows=lim.max_cta_rows(4))}
    assert 128 in ms
    assert {m for m, _ in reachable_tiles(sel, max_rows=StaticLimits.make(4, 100)
                                          .max_cta_rows(4))} == {16}


def test_causal_variant_names():
    """The multi-token variant of a tile: key suffix ``_mt``, the kernel's CAUSAL template
    argument (after the KV type, spelled out), the same layout and shared memory; the
    one-token variants' names do not change."""
    for kv in (None, "float8_e4m3fn"):
        one = cc.FwdVariant.make(64, 64, 128, "bfloat16", kv_dtype=kv)
        mt = cc.FwdVariant.make(64, 64, 128, "bfloat16", kv_dtype=kv, causal=True)
        assert mt.key == one.key + "_mt" and mt != one
        assert (mt.warps, mt.stages, mt.rows_per_warp, mt.smem_bytes) == \
            (one.warps, one.stages, one.rows_per_warp, one.smem_bytes)
        kvt = "pat::fp8_e4m3" if kv else "__nv_bfloat16"
        assert mt.name_expression.endswith(f", {kvt}, true>")
        assert mt.traits.endswith(f", {kvt}, true>")
        assert "true" not in one.name_expression and "true" not in one.traits
    one = cc.FwdVariant.make(16, 64, 128, "float16")
    assert one.name_expression == (f"pat_fwd_kernel<128, __half, 16, 64, {one.warps}, "
                                   f"{one.stages}, {one.rows_per_warp}>")
    mt = dataclasses.replace(one, causal=True)
    fused = cc.FusedVariant(128, "float16", (mt, cc.FwdVariant.make(32, 64, 128, "float16",
                                                                    causal=True)))
    assert "_mt_" in fused.key and fused.name_expression.count(", true>") == 2
    assert "_mt" not in cc.FusedVariant(128, "float16", (one,)).key


def test_causal_code_only_in_causal_variants():
    """The kernels' causal mask sits behind the CAUSAL template argument (so the one-token
    variants compile to the code they had), and FwdParams keeps its older fields' offsets
    (the two multi-token pointers come last)."""
    src = cc.cuda_src_dir()
    walk = (src / "pat_mma_walk.cuh").read_text() + (src / "pat_wg_walk.cuh").read_text()
    assert walk.count("if constexpr (Tr::CAUSAL)") == 2
    assert walk.count("mask_causal<") == 2
    fwd = (src / "pat_fwd.cuh").read_text()
    assert "if constexpr (Tr::CAUSAL) rows = causal_rows<Tr>" in fwd
    from pat_core import kernel_params as kp
    names = [f for f, _ in kp.FwdParams._fields_]
    assert names[-2:] == ["cta_kv_limit", "cta_causal"]
    assert kp.FwdParams.merge.offset == 208 and kp.FwdParams.cta_kv_limit.offset == 264
