"""head_dim 256: the kernel family's variants, the tiles the planner may pick, the CPU executor
against the float64 reference (sharing and split), and the simulator (CPU only; the kernels
themselves are checked in test_gpu_kernels.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core import cuda_compile as cc
from pat_core.gpus import get_gpu
from pat_core.reference import dense_attention, lowp_attention, relative_error
from pat_core.tiles import TileSelector, _arch_of, check_tile, feasible_tiles
from pat_core.tuning import Tuning
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import head_configs, prefix_batches

D = 256
FP16_UNIT = 2.0 ** -11   # one rounding of an fp16 output: the floor of any fp16 result's error
TILES_256 = sorted({(v.m, v.n) for v in cc.all_fwd_variants(head_dims=(D,))})


def test_variants_of_head_dim_256():
    """Every (m, n) whose ring fits the sm_90 shared memory (n <= 64: a K or V row is 512
    bytes), 16 rows per warp (32 would need 256 accumulator registers), no warpgroup layout,
    for both dtypes; merge kernels for both dtypes and every heads-per-warp count."""
    assert D in cc.HEAD_DIMS
    fwd = cc.all_fwd_variants(head_dims=(D,))
    assert TILES_256 == [(m, n) for m in cc.TILE_MS for n in (16, 32, 64)]
    assert {v.dtype for v in fwd} == set(cc.DTYPE_CTYPE)
    for v in fwd:
        assert v.rows_per_warp == 16 and not v.warpgroup, v.key
        assert v.key.startswith(f"pat_fwd_d{D}_") and v.name_expression.startswith(
            f"pat_fwd_kernel<{D}, ")
        assert v.smem_bytes <= cc.SMEM_LIMIT["sm_90"], v.key
        assert v.smem_bytes == v.m * D * 2 + v.stages * 2 * v.n * D * 2
        assert v.warps * 32 == v.threads and 1 <= v.warps <= 8
        assert v == cc.FwdVariant.make(v.m, v.n, D, v.dtype, arch="sm_80")  # one layout
        assert cc.fwd_variant_supported(v.m, v.n, D)
    for m in cc.TILE_MS:
        for n in (128, 256):   # one stage of K and V alone would not leave room for two
            assert not cc.fwd_variant_supported(m, n, D)
    # a layout the traits refuse never counts as feasible, whatever its shared memory
    assert not cc.fwd_variant_feasible(cc.FwdVariant(D, "float16", 64, 32, 4, 2, 32))
    assert not cc.fwd_variant_feasible(cc.FwdVariant(D, "float16", 64, 32, 4, 2, cc.WG_ROWS))
    merges = [v for v in cc.all_merge_variants() if v.head_dim == D]
    assert {(v.dtype, v.heads) for v in merges} == {(dt, nh) for dt in cc.DTYPE_CTYPE
                                                   for nh in cc.MERGE_HEADS}


@pytest.mark.parametrize("head_dim", cc.HEAD_DIMS)
@pytest.mark.parametrize("dtype", tuple(cc.DTYPE_CTYPE) + tuple(cc.KV_CTYPE))
@pytest.mark.parametrize("gpu", ("h100", "h200", "a100"))
def test_feasible_tiles_are_compiled_variants(head_dim, dtype, gpu):
    """The tile solver offers only tiles a kernel exists for, with that kernel's threads,
    stages and shared memory, whether the resources come from the nvcc report or (a head_dim
    the report does not list yet) from the estimate; for an fp8 cache, the fp8 variants."""
    g = get_gpu(gpu)
    arch = _arch_of(g)
    kv = dtype if dtype in cc.KV_CTYPE else None
    q = "float16" if kv else dtype          # an fp8 variant's layout does not depend on q
    compiled = {(v.m, v.n): v for v in cc.all_fwd_variants(head_dims=(head_dim,), dtypes=(q,),
                                                          kv_dtype=kv)
                if v == cc.FwdVariant.make(v.m, v.n, head_dim, q, arch=arch, kv_dtype=kv)}
    tiles = feasible_tiles(head_dim, dtype, g)
    assert tiles and set(tiles) <= set(compiled), set(tiles) - set(compiled)
    for m, n in tiles:
        v, res = compiled[(m, n)], check_tile(m, n, head_dim, dtype, g).resources
        assert (res.threads, res.stages) == (v.threads, v.stages), (m, n)
        assert v.smem_bytes <= res.smem <= g.smem_per_block, (m, n)
    sel = TileSelector(head_dim, dtype, g)
    for m in sel.m_values:
        for kv_len in (1, 100, 1000, 1 << 20):
            assert (int(m), sel.pick_n(int(m), kv_len)) in compiled


def test_feasible_tiles_at_256_on_hopper():
    """On sm_90 every head_dim-256 kernel fits (one to four blocks per SM); on the A100
    (163 KB per block) the three 64-token rings do not."""
    assert list(feasible_tiles(D, "float16", "h100")) == TILES_256
    assert list(feasible_tiles(D, "bfloat16", "h200")) == TILES_256
    # fp8: the 16-bit tiles (byte tiles would fit more; the bandwidth rule, at one byte per
    # element, leaves out 128 x 16)
    fp8 = set(feasible_tiles(D, "float8_e4m3fn", "h100"))
    assert {(16, 64), (128, 64)} <= fp8 <= set(TILES_256)
    a100 = feasible_tiles(D, "float16", "a100")
    assert set(a100) == {t for t in TILES_256 if t[1] <= 32}
    for m, n in TILES_256:
        assert 1 <= check_tile(m, n, D, "float16", "h100").ctas_per_sm <= 4
    with pytest.raises(ValueError, match="no kernel for"):
        PrefixAttentionWrapper("cpu").plan([[0, 1]], [20], 8, 2, D, 16, tile=(16, 128))


def _run_cpu(b, hq, hk, dtype, packer="pat", tile=None, tuning=None, seed=0):
    """Plan and run ``b`` at head_dim 256 on the CPU executor; returns (plan, out, lse, q, k, v)."""
    np_dt = np.float16 if dtype == "float16" else np.float32
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, D, np_dt, seed=seed, scale=2.0)
    q = np.random.default_rng(seed + 1).standard_normal((b.batch_size, hq, D)).astype(np_dt)
    w = PrefixAttentionWrapper("cpu", packer)
    if tuning is not None:
        w.planner.tuning = tuning
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, D, b.page_size, kv_data_type=dtype,
                  tile=tile)
    out, lse = w.run(q, (k, v), return_lse=True)
    return plan, out, lse, q, k, v


def _check_fp16(b, out, lse, q, k, v):
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   return_lse=True)
    plain = relative_error(lowp_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size),
                           ref)
    assert out.dtype == np.float16 and out.shape == ref.shape
    assert relative_error(out, ref) <= max(2 * plain, FP16_UNIT)
    assert np.abs(lse - ref_lse).max() <= 1e-3


def _tile_ns(plan) -> set:
    return {int(n) for _, n in plan.tile_configs[plan.cta_tile]}


@pytest.mark.parametrize("gpu", ("h100", "h200"))
def test_busy_steps_take_the_narrow_kv_tiles(gpu):
    """At head_dim 256 a step of at least busy_items_per_sm x SMs packs x KV heads plans with
    n <= 32 (GPUSpec.busy_kv_tile_tables); a smaller one, a tuning's own table, a forced tile
    and head_dim 128 keep the one table; a step growing across the line plans incrementally
    exactly as from scratch; the graph-safe launch set holds both tables' tiles."""
    from pat_core.static_plan import reachable_tiles
    g = get_gpu(gpu)
    line = int(np.ceil(g.busy_items_per_sm * g.num_sms))       # 792 on both
    big = build_tree_batch("128_2048", page_size=16, seed=0)   # 128 packs x 8 heads = 1024
    small = build_tree_batch("64_2048", page_size=16, seed=0)  # 512
    assert small.batch_size * 8 < line <= big.batch_size * 8
    p = Planner("pat", g)
    assert _tile_ns(p.plan(big.block_tables, big.seq_lens, 32, 8, D, 16)) == {32}
    assert _tile_ns(p.plan(small.block_tables, small.seq_lens, 32, 8, D, 16)) == {64}
    assert _tile_ns(p.plan(big.block_tables, big.seq_lens, 32, 8, 128, 16)) == {64}
    assert _tile_ns(p.plan(big.block_tables, big.seq_lens, 32, 16, D, 16)) == {32}
    assert _tile_ns(p.plan(big.block_tables, big.seq_lens, 32, 4, D, 16)) == {64}  # 512
    own = Planner("pat", g, Tuning(kv_tile_table=g.kv_tile_table))
    assert _tile_ns(own.plan(big.block_tables, big.seq_lens, 32, 8, D, 16)) == {64}
    assert _tile_ns(p.plan(big.block_tables, big.seq_lens, 32, 8, D, 16, tile=(16, 64))) \
        == {64}
    assert p.tile_selector(D, "float16", (16, 64)).busy is None
    assert Planner("pat", "a100").tile_selector(D).busy is None
    assert set(reachable_tiles(p.tile_selector(D).busy)) <= set(
        reachable_tiles(p.tile_selector(D)))
    # a GPU whose one table never gives n = 32: its busy table's tiles join the launch set
    import dataclasses
    odd = dataclasses.replace(g, kv_tile_table=((1 << 62, 64),),
                              busy_kv_tile_tables=((D, ((1 << 62, 32),)),))
    sel = Planner("pat", odd).tile_selector(D)
    assert {n for _, n in reachable_tiles(sel)} == {32, 64}
    assert {n for _, n in reachable_tiles(sel, kv_tile_table=odd.kv_tile_table)} == {64}
    for bad in (dict(busy_items_per_sm=float("nan")), dict(busy_items_per_sm=0),
                dict(busy_kv_tile_tables=((D, ((1 << 62, 8),)),)),
                dict(busy_kv_tile_tables=((D, ((96, 32), (16, 16))),)),
                dict(busy_kv_tile_tables=("x",))):
        with pytest.raises(ValueError, match="busy_"):
            dataclasses.replace(g, **bad)
    # 96 requests sharing nothing, then growing to 104 by new requests (the "rows" path)
    # and by a token each (the "lengths" path): the same plans as fresh ones
    rng = np.random.default_rng(0)
    lens = rng.integers(1500, 2000, 120)
    table = np.arange(120 * 128, dtype=np.int32).reshape(120, 128)
    inc, paths = Planner("pat", g), []
    for b in (96, 98, 100, 104, 104):
        lens[:b] += 1
        plan = inc.plan(table[:b], lens[:b], 32, 8, D, 16)
        fresh = Planner("pat", g).plan(table[:b], lens[:b], 32, 8, D, 16)
        paths.append(inc.last_path)
        assert _tile_ns(plan) == ({32} if b * 8 >= line else {64})
        for name in plan.ARRAY_FIELDS:
            assert np.array_equal(getattr(plan, name), getattr(fresh, name)), (b, name)
    assert paths == ["full", "rows", "rows", "rows", "lengths"], paths


@settings(max_examples=40, deadline=None)
@given(b=prefix_batches(max_requests=10, max_node_pages=2), heads=head_configs(),
       packer=st.sampled_from(PACKERS), seed=st.integers(0, 1000))
def test_cpu_executor_matches_dense_at_256(b, heads, packer, seed):
    """Random forests, every packer, fp16 at head_dim 256 on the tiles of the CUDA kernels:
    within twice a plain fp16 computation's error of the float64 reference."""
    hq, hk = heads
    plan, out, lse, q, k, v = _run_cpu(b, hq, hk, "float16", packer, seed=seed)
    plan.validate()
    assert {tuple(t) for t in plan.tile_configs.tolist()} <= set(TILES_256)
    _check_fp16(b, out, lse, q, k, v)


@settings(max_examples=25, deadline=None)
@given(b=prefix_batches(max_requests=8, max_node_pages=2), heads=head_configs(),
       seed=st.integers(0, 1000))
def test_cpu_executor_fp32_at_256(b, heads, seed):
    hq, hk = heads
    plan, out, lse, q, k, v = _run_cpu(b, hq, hk, "float32", seed=seed)
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   return_lse=True)
    assert relative_error(out, ref) <= 1e-5 and relative_error(lse, ref_lse) <= 1e-5


def split_tuning() -> Tuning:
    """A tuning whose long-KV split cuts a few-thousand-token shared root into 256-token parts
    (a fair share of one token slot per SM), so a test covers sharing and split together."""
    return Tuning(split_share=64.0, min_part=256, merge_min_part=256, narrow_share=0.0,
                  request_share=0.0)


@pytest.mark.parametrize("tile", TILES_256, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_tile_with_sharing_and_split(tile):
    """Each head_dim-256 tile forced on a shared 2100-token root cut into parts (several
    partials per request, merged) plus private leaves of ragged length, fp16."""
    m, n = tile
    reqs = max(1, m // 4)                      # GQA group 4: the root CTA holds ~m rows
    b = build_tree_batch(f"1,{reqs}_2100,{37 + m}", page_size=16, seed=m + n)
    plan, out, lse, q, k, v = _run_cpu(b, 8, 2, "float16", tile=tile, tuning=split_tuning(),
                                       seed=n)
    assert plan.tile_configs.tolist() == [[m, n]]
    shared = [c for c in range(plan.num_ctas)
              if plan.cta_req_indptr[c + 1] - plan.cta_req_indptr[c] > 1]
    assert len(shared) >= 2 or reqs == 1, "the shared root was not split"
    assert plan.num_slots > b.batch_size        # requests with several partials: a merge
    _check_fp16(b, out, lse, q, k, v)


def test_plan_prices_bytes_at_256():
    """Same batch, same plan shape: KV, Q, partial and output bytes all scale with head_dim."""
    b = build_tree_batch("1,4,16_128,256,1024", page_size=16)
    p128 = Planner("query", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    p256 = Planner("query", "h100").plan(b.block_tables, b.seq_lens, 32, 8, D, 16)
    s128, s256 = p128.stats(), p256.stats()
    assert s256["kv_bytes"] == 2 * s128["kv_bytes"] and s256["q_bytes"] == 2 * s128["q_bytes"]
    assert s256["out_bytes"] == 2 * s128["out_bytes"]


def test_simulator_at_256():
    """The simulator prices a head_dim-256 plan from the same variants (bytes as the plan
    states them, resident blocks from the kernels' resources) and the ``pat-fixed`` ablation
    takes the widest 64-row kernel there."""
    from sim import bytes_by_kind, plan_occupancy, simulate
    from sim.methods import fixed_tile, load_batch, make_plan
    batch = load_batch("1,4,16_128,256,1024", 16)
    for method in ("pat", "query", "pat-fixed"):
        plan = make_plan(batch, method, 32, 8, D)
        r = simulate(plan)
        assert r.latency_ns > 0 and r.bytes == bytes_by_kind(plan)
        assert r.bytes["total"] == plan.stats()["total_bytes"]
        for occ in plan_occupancy(plan, get_gpu("h100")):
            assert occ.ctas_per_sm == check_tile(occ.m, occ.n, D, "float16",
                                                 "h100").ctas_per_sm >= 1
    assert fixed_tile(D) == (64, 64) and fixed_tile(128) == (64, 128)
    assert make_plan(batch, "pat-fixed", 32, 8, D).tile_configs.tolist() == [[64, 64]]
    # twice the bytes of the same plan at head_dim 128: never faster
    t128 = simulate(make_plan(batch, "query", 32, 8, 128)).latency_ns
    t256 = simulate(make_plan(batch, "query", 32, 8, D)).latency_ns
    assert t256 > t128
