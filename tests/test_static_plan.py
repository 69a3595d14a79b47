"""Graph-safe mode, host half: limits, the fixed buffer layout, packing, and the kernel
parameter structs.  The GPU half (one captured graph replayed over 50 changing steps) is in
tests/test_gpu_graph_safe.py."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core import cuda_compile as cc
from pat_core import kernel_params as kp
from pat_core.executor import execute
from pat_core.plan import Plan
from pat_core.reference import dense_attention, relative_error
from pat_core.static_plan import StaticLayout, StaticLimits, reachable_tiles
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import head_configs, prefix_batches

BIG = StaticLimits(max_batch_size=64, max_num_pages=4096, max_ctas=2048, max_partials=4096)


def _gather_ranges(indptr, order, *values):
    """Reference: the CSR ranges of ``order[0], order[1], ...`` concatenated."""
    lens = (indptr[1:] - indptr[:-1])[order].astype(np.int64)
    new_ptr = np.zeros(order.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=new_ptr[1:])
    starts = indptr[:-1][order].astype(np.int64)
    idx = np.repeat(starts - new_ptr[:-1], lens) + np.arange(int(new_ptr[-1]), dtype=np.int64)
    return (new_ptr.astype(np.int32),) + tuple(v[idx].astype(np.int32) for v in values)


def pack_reference(layout: StaticLayout, plan: Plan) -> np.ndarray:
    """The slow, obvious StaticLayout.pack: a zeroed buffer, CTAs stably sorted by variant,
    every array copied to its offset."""
    buf = np.zeros(layout.offset["cta_pages"] + plan.cta_pages.shape[0], dtype=np.int32)
    vidx = {t: i for i, t in enumerate(layout.tiles)}
    tile_v = np.array([vidx[(int(m), int(n))] for m, n in plan.tile_configs], dtype=np.int64)
    cta_v = tile_v[plan.cta_tile]
    order = np.argsort(cta_v, kind="stable")
    counts = np.bincount(cta_v, minlength=layout.num_variants)
    live = np.zeros((layout.num_variants, 2), dtype=np.int32)
    live[:, 0] = np.concatenate(([0], np.cumsum(counts)[:-1]))
    live[:, 1] = counts
    req_ptr, cta_req, cta_slot = _gather_ranges(plan.cta_req_indptr, order, plan.cta_req,
                                                plan.cta_slot)
    page_ptr, cta_pages = _gather_ranges(plan.cta_page_indptr, order, plan.cta_pages)
    parts = {"live": live.reshape(-1), "live_batch": np.array([plan.batch_size]),
             "cta_req_indptr": req_ptr, "cta_kv_start": plan.cta_kv_start[order],
             "cta_kv_len": plan.cta_kv_len[order], "cta_page_indptr": page_ptr,
             "req_slot_indptr": plan.req_slot_indptr, "cta_req": cta_req,
             "cta_slot": cta_slot, "cta_pages": cta_pages}
    for name, arr in parts.items():
        buf[layout.offset[name]:layout.offset[name] + arr.shape[0]] = arr
    return buf


@settings(max_examples=30, deadline=None)
@given(batch=prefix_batches(), heads=head_configs(), packer=st.sampled_from(PACKERS))
def test_pack_equals_the_reference_into_any_buffer(batch, heads, packer):
    """The compiled pack writes what the reference builds, fresh or into a used buffer (stale
    values in it are overwritten or zeroed up to the last page entry)."""
    b = batch
    hq, hk = heads
    planner = Planner(packer, "h100")
    plan = planner.plan(b.block_tables, b.seq_lens, hq, hk, 64, b.page_size,
                        kv_data_type="float32")
    layout = layout_for(planner, 64, "float32")
    ref = pack_reference(layout, plan)
    np.testing.assert_array_equal(layout.pack(plan), ref)
    used = np.full(layout.total, -7, dtype=np.int32)
    out = layout.pack(plan, out=used)
    assert out.shape == ref.shape and np.shares_memory(out, used)
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="out"):
        layout.pack(plan, out=np.zeros(ref.shape[0] - 1, dtype=np.int32))


def plan_from_buffer(layout: StaticLayout, buf: np.ndarray, like: Plan) -> Plan:
    """The Plan a graph-safe launch set executes: CTAs of variant v are the live range of v,
    run with tile layout.tiles[v] (what the kernels read from the buffer)."""
    u = layout.unpack(buf)
    live = u["live"]
    tiles = np.array(layout.tiles, dtype=np.int32)
    cta_tile = np.repeat(np.arange(layout.num_variants, dtype=np.int32), live[:, 1])
    order = np.arange(cta_tile.shape[0])
    assert np.array_equal(live[:, 0], np.concatenate(([0], np.cumsum(live[:, 1])[:-1])))
    used = np.flatnonzero(live[:, 1] > 0)
    group_indptr = np.concatenate(([0], np.cumsum(live[used, 1]))).astype(np.int32)
    return dataclasses.replace(
        like, batch_size=u["batch_size"], tile_configs=tiles, cta_tile=cta_tile[order],
        group_indptr=group_indptr, group_tile=used.astype(np.int32),
        cta_req_indptr=u["cta_req_indptr"], cta_req=u["cta_req"], cta_slot=u["cta_slot"],
        cta_kv_start=u["cta_kv_start"], cta_kv_len=u["cta_kv_len"],
        cta_page_indptr=u["cta_page_indptr"], cta_pages=u["cta_pages"],
        req_slot_indptr=u["req_slot_indptr"], extra={})


def layout_for(planner: Planner, d: int, dtype: str, limits=BIG) -> StaticLayout:
    return StaticLayout(limits, reachable_tiles(planner.tile_selector(d, dtype)))


@settings(max_examples=40, deadline=None)
@given(prefix_batches(max_requests=12), head_configs(), st.sampled_from(PACKERS),
       st.sampled_from(["h100", "a100"]))
def test_packed_buffer_runs_the_same_attention(b, heads, packer, gpu):
    """Pack a plan into the fixed buffer, read it back the way the kernels do, run it on the CPU
    executor: the result equals the plan's own (bit for bit: the same CTAs, reordered) and the
    float64 reference."""
    hq, hk = heads
    planner = Planner(packer, gpu)
    plan = planner.plan(b.block_tables, b.seq_lens, hq, hk, 64, b.page_size,
                        kv_data_type="float32")
    layout = layout_for(planner, 64, "float32")
    buf = layout.pack(plan)
    assert buf.shape[0] <= layout.total
    again = plan_from_buffer(layout, buf, plan)
    again.validate()
    # each variant's range holds exactly the plan's CTAs of that tile, in the plan's order
    for v, (m, n) in enumerate(layout.tiles):
        mine = np.flatnonzero((plan.cta_mn() == (m, n)).all(axis=1))
        lo, cnt = layout.unpack(buf)["live"][v]
        assert cnt == mine.shape[0]
        assert np.array_equal(again.cta_kv_start[lo:lo + cnt], plan.cta_kv_start[mine])
    rng = np.random.default_rng(0)
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, 64, seed=1)
    q = rng.standard_normal((b.batch_size, hq, 64)).astype(np.float32)
    o1, l1 = execute(plan, q, k, v, return_lse=True)
    o2, l2 = execute(again, q, k, v, return_lse=True)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size)
    assert relative_error(o2, ref) < 1e-5


@settings(max_examples=30, deadline=None)
@given(prefix_batches(max_requests=16), head_configs(), st.sampled_from([64, 128]),
       st.sampled_from(["float16", "float32"]))
def test_reachable_tiles_cover_every_plan(b, heads, d, dtype):
    """The fixed launch set holds every tile the planner gives a CTA."""
    hq, hk = heads
    for packer in PACKERS:
        planner = Planner(packer, "h100")
        plan = planner.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
                            kv_data_type=dtype)
        sel = planner.tile_selector(d, dtype)
        tiles = set(reachable_tiles(sel))
        used = {tuple(t) for t in plan.tile_configs.tolist()}
        assert used <= tiles
        # bounded by the batch: a wrapper whose max_batch_size is this batch still has them
        bounded = set(reachable_tiles(sel, max_rows=b.batch_size * (hq // hk)))
        assert used <= bounded <= tiles
        # the documented page bound: block-table entries plus one per CTA
        entries = int(((b.seq_lens.astype(np.int64) + b.page_size - 1) // b.page_size).sum())
        assert plan.cta_pages.shape[0] <= entries + plan.num_ctas


def test_reachable_tiles_bounded_by_rows():
    """A small batch bucket gets only the row tiles it can reach."""
    sel = Planner("pat", "h100").tile_selector(128, "float16")
    full = reachable_tiles(sel)
    assert {m for m, _ in full} == {16, 32, 64, 128}
    assert {m for m, _ in reachable_tiles(sel, max_rows=4)} == {16}
    assert {m for m, _ in reachable_tiles(sel, max_rows=16)} == {16}
    assert {m for m, _ in reachable_tiles(sel, max_rows=17)} == {16, 32}
    assert {m for m, _ in reachable_tiles(sel, max_rows=64)} == {16, 32, 64}
    assert reachable_tiles(sel, max_rows=1000) == full
    for m, n in full:       # the n choices of a kept m do not change
        if m == 16:
            assert (m, n) in reachable_tiles(sel, max_rows=1)
    with pytest.raises(ValueError, match="max_rows"):
        reachable_tiles(sel, max_rows=0)


def test_limits_are_named():
    b = build_tree_batch("1,4,16_128,40,33", page_size=16)
    planner = Planner("pat", "h100")
    plan = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    tiles = reachable_tiles(planner.tile_selector(128, "float16"))
    ok = StaticLimits(16, plan.cta_pages.shape[0], plan.num_ctas, plan.num_slots)
    StaticLayout(ok, tiles).pack(plan)
    for field, value, word in (("max_batch_size", 15, "requests"),
                               ("max_ctas", plan.num_ctas - 1, "CTAs"),
                               ("max_partials", plan.num_slots - 1, "partial")):
        lim = dataclasses.replace(ok, **{field: value})
        with pytest.raises(ValueError, match=f"{field}=.*{field}") as e:
            StaticLayout(lim, tiles).pack(plan)
        assert word in str(e.value)
    lim = dataclasses.replace(ok, max_num_pages=plan.cta_pages.shape[0] - plan.num_ctas + 1)
    StaticLayout(lim, tiles).pack(plan)
    lim = dataclasses.replace(ok, max_num_pages=plan.cta_pages.shape[0] - plan.num_ctas - 1)
    with pytest.raises(ValueError, match="max_num_pages"):
        StaticLayout(lim, tiles).pack(plan)
    with pytest.raises(ValueError, match="not in the graph-safe launch set"):
        StaticLayout(ok, ((16, 16),)).pack(plan)


def test_limit_arguments_validated():
    with pytest.raises(ValueError, match="max_ctas"):
        StaticLimits(4, 10, 0, 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        StaticLimits(True, 10, 4, 4)
    with pytest.raises(ValueError, match="max_batch_size and max_num_pages"):
        StaticLimits.make(None, 10)
    lim = StaticLimits.make(8, 100)
    assert (lim.max_ctas, lim.max_partials) == (4 * 8 + 256, 4 * 8 + 4 * 8 + 256)
    with pytest.raises(ValueError, match="repeated"):
        StaticLayout(lim, ((16, 16), (16, 16)))
    with pytest.raises(ValueError, match="empty"):
        StaticLayout(lim, ())
    with pytest.raises(ValueError, match="backend='cuda'"):
        PrefixAttentionWrapper(backend="cpu", use_cuda_graph=True, max_batch_size=4,
                               max_num_pages=8)
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        PrefixAttentionWrapper(backend="cpu", max_batch_size=4)
    with pytest.raises(TypeError, match="use_cuda_graph"):
        PrefixAttentionWrapper(backend="cpu", use_cuda_graph="yes")


def test_layout_offsets_disjoint_and_pages_last():
    lay = StaticLayout(StaticLimits(5, 50, 7, 9), ((16, 16), (32, 64)))
    spans = sorted((lay.offset[f], lay.offset[f] + lay.size[f]) for f in lay.offset)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 == b0
    assert spans[-1][1] == lay.total
    assert lay.offset["cta_pages"] == max(lay.offset.values())
    assert lay.size["cta_pages"] == 50 + 7 and lay.size["live"] == 4


# ------------------------------------------------------------------------ kernel parameters
def test_param_structs_match_the_header():
    text = (cc.cuda_src_dir() / "pat_params.cuh").read_text()
    assert kp.check_against_header(text) == []
    # the check can fail: a reordered or retyped field, or a changed size, is reported
    swapped = text.replace("  int group;", "  int group_x;", 1)
    assert any("FwdParams" in x for x in kp.check_against_header(swapped))
    retyped = text.replace("  int page_size;", "  long long page_size;", 1)
    assert any("page_size" in x for x in kp.check_against_header(retyped))
    resized = text.replace("sizeof(MergeParams) == 112", "sizeof(MergeParams) == 104")
    assert any("MergeParams" in x and "bytes" in x for x in kp.check_against_header(resized))


def test_every_kernel_takes_one_struct():
    """The explicit instantiations (nvcc resource report) and the name expressions agree with
    the kernels' single-struct signature."""
    fv = cc.FwdVariant.make(16, 64, 128, "float16")
    assert fv.name_expression == (f"pat_fwd_kernel<128, __half, 16, 64, {fv.warps}, "
                                  f"{fv.stages}, {fv.rows_per_warp}>")
    assert "(const __grid_constant__ pat::FwdParams)" in fv.explicit_instantiation()
    mv = cc.MergeVariant(128, "float16")
    assert "(const __grid_constant__ pat::MergeParams)" in mv.explicit_instantiation()


def test_graph_safe_tile_table_rule():
    """One KV tile width exactly when every CTA fits a 16-row tile; the plans made with it
    stay inside the launch set it gives and compute the same attention."""
    from pat_core.static_plan import (LEAN_EXCLUDED_TILES, LEAN_TILE_TABLE, ONE_N_TABLE,
                                      graph_safe_tile_table)
    lim = lambda b: StaticLimits(b, 4096, 256, 512)   # noqa: E731
    assert graph_safe_tile_table(lim(4), 4) == (ONE_N_TABLE, None)
    assert graph_safe_tile_table(lim(16), 1) == (ONE_N_TABLE, None)
    lean = (LEAN_TILE_TABLE, LEAN_EXCLUDED_TILES)
    assert graph_safe_tile_table(lim(5), 4) == lean
    assert graph_safe_tile_table(lim(17), 1, head_dim=64) == lean
    assert graph_safe_tile_table(lim(17), 1, head_dim=256) == (None, None)
    # a fused bucket: one width as well
    from pat_core.static_plan import FUSED_TILE_TABLE
    assert graph_safe_tile_table(lim(5), 4, fused=True) == (FUSED_TILE_TABLE, None)
    assert graph_safe_tile_table(lim(4), 4, fused=True) == (ONE_N_TABLE, None)
    planner = Planner("pat", "h100")
    planner.tuning = dataclasses.replace(planner.tuning, kv_tile_table=FUSED_TILE_TABLE)
    assert reachable_tiles(planner.tile_selector(128, "float16"), max_rows=48) == (
        (64, 64), (32, 64), (16, 64))
    planner = Planner("pat", "h100")
    planner.tuning = dataclasses.replace(planner.tuning, kv_tile_table=ONE_N_TABLE)
    sel = planner.tile_selector(128, "float16")
    assert reachable_tiles(sel, max_rows=16) == ((16, 64),)
    b = build_tree_batch("1,4_40,3", page_size=16)          # 4 requests, 3- and 16-token CTAs
    plan = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    assert {tuple(t) for t in plan.tile_configs.tolist()} == {(16, 64)}
    k, v = random_kv_cache(b.num_pages, 16, 8, 128, seed=3)
    q = np.random.default_rng(3).standard_normal((b.batch_size, 32, 128)).astype(np.float32)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16)
    assert relative_error(execute(plan, q, k, v), ref) < 1e-5
    # the lean table: short 16-row CTAs on 32-token tiles, every larger CTA on 64-token ones
    planner = Planner("pat", "h100")
    planner.tuning = dataclasses.replace(planner.tuning, kv_tile_table=LEAN_TILE_TABLE,
                                         exclude_tiles=LEAN_EXCLUDED_TILES)
    b = build_tree_batch("1,8,32_512,40,30", page_size=16)   # 32 leaves of 30 tokens
    plan = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    used = {tuple(t) for t in plan.tile_configs.tolist()}
    assert (16, 32) in used and any(m > 16 for m, _ in used), used
    assert all(n == 64 for m, n in used if m > 16), used
    assert used <= set(reachable_tiles(planner.tile_selector(128, "float16"), max_rows=128))
    k, v = random_kv_cache(b.num_pages, 16, 8, 128, seed=4)
    q = np.random.default_rng(4).standard_normal((b.batch_size, 32, 128)).astype(np.float32)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16)
    assert relative_error(execute(plan, q, k, v), ref) < 1e-5


def test_graph_safe_fused_rule():
    """One fused pull launch for buckets of at most FUSED_MAX_BATCH requests (auto), never for
    a single tile, always / never when asked; a bad mode is refused by name."""
    from pat_core.static_plan import FUSED_MAX_BATCH, graph_safe_fused
    lim = lambda b: StaticLimits(b, 4096, 256, 512)   # noqa: E731
    assert graph_safe_fused(lim(FUSED_MAX_BATCH), 9)
    assert not graph_safe_fused(lim(FUSED_MAX_BATCH + 1), 9)
    assert not graph_safe_fused(lim(4), 1)
    assert graph_safe_fused(lim(256), 9, "on") and not graph_safe_fused(lim(2), 9, "off")
    assert not graph_safe_fused(lim(256), 1, "on")
    with pytest.raises(ValueError, match="graph_fused"):
        graph_safe_fused(lim(4), 3, "yes")


def test_fused_pull_exclusions_keep_the_fused_block_small():
    """A fused pull launch set leaves out the tiles that alone fit fewer than two blocks per SM
    while another n of their m stays; the plans made without them use none of them, stay in
    the smaller launch set and compute the same attention."""
    from pat_core.gpus import get_gpu
    from pat_core.static_plan import FUSED_MIN_BLOCKS_PER_SM, fused_pull_exclusions
    from pat_core.tiles import TileSelector, kernel_resources
    gpu = get_gpu("h100")
    sel = TileSelector(128, "float16", "h100")
    tiles = reachable_tiles(sel, max_rows=48)
    ex = fused_pull_exclusions(tiles, 128, "float16", "h100")
    assert ex and set(ex) < set(tiles)
    for m, n in ex:
        assert kernel_resources(m, n, 128, "float16", gpu).ctas_per_sm(gpu) \
            < FUSED_MIN_BLOCKS_PER_SM
    lean = reachable_tiles(TileSelector(128, "float16", "h100", exclude=ex), max_rows=48)
    assert set(lean) == set(tiles) - set(ex)
    assert {m for m, _ in lean} == {m for m, _ in tiles}          # no m lost
    # the largest block of what stays fits FUSED_MIN_BLOCKS_PER_SM per SM on every resource
    res = [kernel_resources(m, n, 128, "float16", gpu) for m, n in lean]
    from sim.occupancy import resource_vector, sm_capacity
    need = resource_vector(max(r.threads for r in res), max(r.registers for r in res),
                           max(r.smem for r in res))
    assert (sm_capacity(gpu) // need).min() >= FUSED_MIN_BLOCKS_PER_SM
    # an m whose every tile is low stays whole
    only_low = tuple(t for t in tiles if t in ex)
    assert fused_pull_exclusions(only_low, 128, "float16", "h100") == ()
    # ... unless the selector has another n for it: with one n per m (the fused table) the
    # alternatives come from the feasible tiles, and (32, 64)'s CTAs take (32, 32)
    from pat_core.static_plan import FUSED_TILE_TABLE
    one = reachable_tiles(sel, kv_tile_table=FUSED_TILE_TABLE, max_rows=48)
    assert one == ((64, 64), (32, 64), (16, 64))
    assert fused_pull_exclusions(one, 128, "float16", "h100") == ()
    assert fused_pull_exclusions(one, 128, "float16", "h100", feasible=sel.feasible) == ex
    planner1 = Planner("pat", "h100")
    planner1.tuning = dataclasses.replace(planner1.tuning, kv_tile_table=FUSED_TILE_TABLE,
                                          exclude_tiles=ex)
    assert reachable_tiles(planner1.tile_selector(128, "float16"), max_rows=48) == (
        (64, 64), (32, 32), (16, 64))
    # the planner with the exclusion: 17-32-row CTAs over long KV take (32, 32), not (32, 64)
    planner = Planner("pat", "h100")
    b = build_tree_batch("1,8_16384,40", page_size=16)         # 8 requests x group 4 = 32 rows
    full = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    assert (32, 64) in {tuple(t) for t in full.tile_configs[full.cta_tile].tolist()}
    planner.tuning = dataclasses.replace(planner.tuning, exclude_tiles=ex)
    plan = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    used = {tuple(t) for t in plan.tile_configs[plan.cta_tile].tolist()}
    assert not used & set(ex) and used <= set(lean)
    k, v = random_kv_cache(b.num_pages, 16, 8, 128, seed=5)
    q = np.random.default_rng(5).standard_normal((b.batch_size, 32, 128)).astype(np.float32)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16)
    assert relative_error(execute(plan, q, k, v), ref) < 1e-5


def test_tile_exclusion_input_checks():
    from pat_core.planner import Tuning
    from pat_core.tiles import TileSelector, feasible_tiles
    with pytest.raises(ValueError, match="exclude_tiles"):
        Tuning(exclude_tiles=(32, 64))
    assert Tuning(exclude_tiles=[[32, 64]]).exclude_tiles == ((32, 64),)
    with pytest.raises(ValueError, match="exclude"):
        TileSelector(128, "float16", "h100", exclude=feasible_tiles(128, "float16", "h100"))
    # a forced tile wins over the exclusion
    planner = Planner("pat", "h100")
    planner.tuning = dataclasses.replace(planner.tuning, exclude_tiles=((32, 64),))
    assert planner.tile_selector(128, "float16", (32, 64)).feasible == ((32, 64),)


def test_fused_pull_max_rows_keeps_the_fused_block_at_two_per_sm():
    """A fused launch set whose block (each resource's maximum over its tiles) fits one per SM
    after the exclusions (128-row tiles next to 16-row ones at head_dim 128 on the H100) caps
    CTA rows below its largest m; plans under the cap use no larger tile and compute the same
    attention.  No cap when the block fits two already, or one m is left."""
    from pat_core.static_plan import (FUSED_MIN_BLOCKS_PER_SM, fused_block_per_sm,
                                      fused_pull_exclusions, fused_pull_max_rows)
    from pat_core.tiles import TileSelector

    def lean(rows):
        t = reachable_tiles(TileSelector(128, "float16", "h100"), max_rows=rows)
        ex = fused_pull_exclusions(t, 128, "float16", "h100")
        return [x for x in t if x not in ex]
    tiles = lean(128)
    top = max(m for m, _ in tiles)
    assert fused_block_per_sm(tiles, 128, "float16", "h100") < FUSED_MIN_BLOCKS_PER_SM
    cap = fused_pull_max_rows(tiles, 128, "float16", "h100")
    assert cap is not None and cap < top
    assert fused_block_per_sm([t for t in tiles if t[0] <= cap], 128, "float16", "h100") \
        >= FUSED_MIN_BLOCKS_PER_SM
    assert fused_pull_max_rows(lean(48), 128, "float16", "h100") is None
    assert fused_pull_max_rows([(128, 64), (128, 32)], 128, "float16", "h100") is None
    planner = Planner("pat", "h100")
    b = build_tree_batch("1,16_1024,40", page_size=16)      # 16 requests x group 8 = 128 rows
    full = planner.plan(b.block_tables, b.seq_lens, 64, 8, 128, 16, kv_data_type="float32")
    assert int(full.tile_configs[full.cta_tile][:, 0].max()) == top
    planner.tuning = dataclasses.replace(planner.tuning, max_rows=cap)
    plan = planner.plan(b.block_tables, b.seq_lens, 64, 8, 128, 16, kv_data_type="float32")
    assert int(plan.tile_configs[plan.cta_tile][:, 0].max()) <= cap
    k, v = random_kv_cache(b.num_pages, 16, 8, 128, seed=7)
    q = np.random.default_rng(7).standard_normal((b.batch_size, 64, 128)).astype(np.float32)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16)
    assert relative_error(execute(plan, q, k, v), ref) < 1e-5


def _graph_safe_wrapper(max_batch, mode="auto"):
    """A graph-safe wrapper's planning half without a GPU: the CPU wrapper given graph-safe
    limits and a stand-in backend that only carries ``graph_fused``."""
    from types import SimpleNamespace
    w = PrefixAttentionWrapper(backend="cpu", packer="pat")
    w.use_cuda_graph = True
    w.static_limits = StaticLimits.make(max_batch, 4096)
    w._gpu_backend = SimpleNamespace(graph_fused=mode)
    return w


def test_graph_safe_tuning_of_a_fused_bucket():
    """What the wrapper gives its planner before the first graph-safe plan: a fused 16-request
    bucket at 64:8 gets the one-width table, (128, 64) and (32, 64) left out and rows capped at
    64, and its
    launch set's fused block fits two per SM; a larger bucket (not fused) and a 4-request
    bucket at 32:8 (one 16-row tile) get none of the fused rules; a refused first plan's
    settings are undone, but a value the user set since is kept."""
    from pat_core.static_plan import (FUSED_MIN_BLOCKS_PER_SM, FUSED_TILE_TABLE, ONE_N_TABLE,
                                      fused_block_per_sm)
    w = _graph_safe_wrapper(16)
    w._graph_safe_tuning(64, 8, 128, "float16", None)
    t = w.planner.tuning
    # the tiles whose block fits fewer than two per SM on the H100 (kernel_resources.json)
    assert t.kv_tile_table == FUSED_TILE_TABLE and t.exclude_tiles == ((128, 64), (32, 64))
    assert t.max_rows == 64 and w._static_max_rows(8) == 64
    tiles = reachable_tiles(w.planner.tile_selector(128, "float16"), max_rows=64)
    assert fused_block_per_sm(tiles, 128, "float16", "h100") >= FUSED_MIN_BLOCKS_PER_SM
    # again (a first plan refused and retried): the same settings, not stacked
    w._graph_safe_tuning(64, 8, 128, "float16", None)
    assert w.planner.tuning == t
    # the user changes the row cap between the two: theirs is kept
    w.planner.tuning = dataclasses.replace(w.planner.tuning, max_rows=32)
    w._graph_safe_tuning(64, 8, 128, "float16", None)
    assert w.planner.tuning.max_rows == 32 and w._static_max_rows(8) == 32
    # a forced tile: nothing fused, no exclusions or cap
    wt = _graph_safe_wrapper(16)
    wt._graph_safe_tuning(64, 8, 128, "float16", (64, 64))
    assert wt.planner.tuning.exclude_tiles is None and wt.planner.tuning.max_rows is None
    # larger buckets and unfused ones: the lean table, no row cap
    from pat_core.static_plan import LEAN_EXCLUDED_TILES, LEAN_TILE_TABLE
    big = _graph_safe_wrapper(64)
    big._graph_safe_tuning(32, 8, 128, "float16", None)
    assert big.planner.tuning.kv_tile_table == LEAN_TILE_TABLE
    assert big.planner.tuning.exclude_tiles == LEAN_EXCLUDED_TILES
    assert reachable_tiles(big.planner.tile_selector(128, "float16"), max_rows=256) == (
        (128, 64), (64, 64), (32, 64), (16, 64), (16, 32))
    off = _graph_safe_wrapper(16, "off")
    off._graph_safe_tuning(32, 8, 128, "float16", None)
    assert off.planner.tuning.kv_tile_table == LEAN_TILE_TABLE
    assert off.planner.tuning.max_rows is None
    # head_dim 256 keeps the GPU's tables
    d256 = _graph_safe_wrapper(64)
    d256._graph_safe_tuning(32, 8, 256, "float16", None)
    assert d256.planner.tuning.kv_tile_table is None
    assert d256.planner.tuning.exclude_tiles is None
    small = _graph_safe_wrapper(4)
    small._graph_safe_tuning(32, 8, 128, "float16", None)
    assert small.planner.tuning.kv_tile_table == ONE_N_TABLE
    assert small.planner.tuning.exclude_tiles is None
    # every graph-safe wrapper keeps the coarse parts its limits are sized for
    for x in (w, wt, big, off, small, d256):
        assert x.planner.tuning.merge_min_part == x.planner.tuning.min_part == 256


def test_graph_safe_plans_keep_the_coarse_parts():
    """A small step that merges: plain planning cuts it into 64-token parts, a graph-safe
    wrapper's tuning keeps 256 (its default limits hold that plan, not the finer one)."""
    from pat_core.static_plan import StaticLayout, graph_safe_tuning
    b = build_tree_batch("1,10_7018,28", page_size=16, seed=0)
    limits = StaticLimits.make(10, 10**7)
    p = Planner("pat", "h100")
    plain = p.plan(b.block_tables, b.seq_lens, 8, 1, 128, 16)
    auto = graph_safe_tuning(p.gpu, p.tuning, limits, 8, 128, "float16")
    assert auto["merge_min_part"] == 256
    p.tuning = dataclasses.replace(p.tuning, **auto)
    safe = p.plan(b.block_tables, b.seq_lens, 8, 1, 128, 16)
    assert plain.num_partial_rows > limits.max_partials >= safe.num_partial_rows
    StaticLayout(limits, [tuple(t) for t in safe.tile_configs.tolist()]).check(safe)
