"""Planner knobs (pat_core.Tuning): every setting plans a correct batch, the launch order does
what it says, and bad values get errors naming the knob."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import Planner, PrefixAttentionWrapper, Tuning
from pat_core.packers import PARTIAL_WEIGHT
from pat_core.workloads import build_tree_batch
from strategies import assert_run_matches_dense, head_configs, prefix_batches

SETTINGS = [
    Tuning(),
    Tuning(order="tile", partial_weight=1.0),
    Tuning(max_rows=32, split_share=4.0, min_part=16),
    Tuning(partial_weight=50.0, kv_tile_table=((32, 16), (1 << 62, 32))),
    Tuning(split_by="work", split_share=8.0, min_part=16),
    Tuning(split_share=2.0),
    Tuning(order="shared", narrow_share=0.0),
    Tuning(narrow_share=0.5),
    Tuning(request_share=0.0, order="tile"),
    Tuning(request_share=1.0),
]


@settings(max_examples=25, deadline=None)
@given(prefix_batches(), head_configs(), st.sampled_from(range(len(SETTINGS))))
def test_every_tuning_matches_dense(b, heads, which):
    hq, hk = heads
    d = 64
    w = PrefixAttentionWrapper(backend="cpu", packer="pat")
    w.planner.tuning = SETTINGS[which]
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size, kv_data_type="float32")
    plan.validate()
    for cnt in plan.coverage_counts():
        assert np.all(cnt == 1)
    assert_run_matches_dense(w, b, hq, hk, d)


def test_work_order_launches_longest_first():
    b = build_tree_batch("1,4,16,64_512,256,64,32", page_size=16)
    plan = Planner("pat", "h100", Tuning(order="work")).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16)
    m = plan.tile_configs[plan.cta_tile][:, 0].astype(np.int64)
    work = m * plan.cta_kv_len
    gmax = [int(work[plan.group_indptr[g]:plan.group_indptr[g + 1]].max())
            for g in range(plan.num_groups)]
    assert plan.num_groups >= 2 and gmax == sorted(gmax, reverse=True)
    for g in range(plan.num_groups):
        lens = plan.cta_kv_len[plan.group_indptr[g]:plan.group_indptr[g + 1]]
        assert np.all(np.diff(lens) <= 0)
    tile = Planner("pat", "h100", Tuning(order="tile")).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16)
    keys = [tuple(tile.tile_configs[t]) for t in tile.group_tile]
    assert keys == sorted(keys)


def test_shared_order_launches_many_request_ctas_first():
    b = build_tree_batch("1,32,256_64,64,1024", page_size=16)
    plan = Planner("pat", "h100", Tuning(order="shared", narrow_share=0.0,
                                         request_share=0.0)).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16)
    nreq = np.diff(plan.cta_req_indptr)
    gmax = [int(nreq[plan.group_indptr[g]:plan.group_indptr[g + 1]].max())
            for g in range(plan.num_groups)]
    assert plan.num_groups >= 2 and gmax == sorted(gmax, reverse=True) and gmax[0] > 1
    for g in range(plan.num_groups):
        lo, hi = plan.group_indptr[g], plan.group_indptr[g + 1]
        assert np.all(np.diff(nreq[lo:hi]) <= 0)
        # equal request counts: longest KV first
        same = np.diff(nreq[lo:hi]) == 0
        assert np.all(np.diff(plan.cta_kv_len[lo:hi])[same] <= 0)
    # the default order puts the 1024-token leaves (one request each) first on this batch
    work = Planner("pat", "h100", Tuning(narrow_share=0.0, request_share=0.0)).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert np.diff(work.cta_req_indptr)[0] == 1


def _kv_tokens(plan):
    return int(plan.cta_kv_len.astype(np.int64).sum())


def test_narrow_packing_where_sharing_saves_little():
    """Long private leaves under short shared levels: packed narrow, the step is one 16-row
    variant for < 2% more KV; a wide root over short leaves keeps its wide CTAs; a row cap the
    user sets and other packers are left alone."""
    b = build_tree_batch("1,32,256_64,64,1024", page_size=16)
    args = (b.block_tables, b.seq_lens, 32, 8, 128, 16)
    # (the per-request rule, which takes this batch first, off: it has its own tests)
    off = Planner("pat", "h100", Tuning(narrow_share=0.0, request_share=0.0)).plan(*args)
    on = Planner("pat", "h100", Tuning(request_share=0.0)).plan(*args)
    assert {int(m) for m, _ in off.tile_configs} == {16, 32}
    assert {int(m) for m, _ in on.tile_configs} == {16} and on.num_groups == 1
    assert _kv_tokens(off) < _kv_tokens(on) <= 1.02 * _kv_tokens(off)
    # 64:8: the narrow packing would re-read 4% more: kept wide
    wide = Planner("pat", "h100", Tuning(request_share=0.0)).plan(b.block_tables, b.seq_lens,
                                                                   64, 8, 128, 16)
    assert max(int(m) for m, _ in wide.tile_configs) == 64
    # a shared root that carries the step keeps its 64-row CTAs
    r = build_tree_batch("1,16_2048,128", page_size=16)
    root = Planner("pat", "h100").plan(r.block_tables, r.seq_lens, 32, 8, 128, 16)
    assert max(int(m) for m, _ in root.tile_configs) == 64
    # the user's cap and the node packer: no narrow packing
    capped = Planner("pat", "h100", Tuning(max_rows=32, request_share=0.0)).plan(*args)
    assert max(int(m) for m, _ in capped.tile_configs) == 32
    node = Planner("node", "h100").plan(*args)
    assert max(int(m) for m, _ in node.tile_configs) > 16


def test_partial_weight_changes_the_packing():
    b = build_tree_batch("1,2,6_64,8,28", page_size=4)
    plans = {w: Planner("pat", "h100", Tuning(partial_weight=w)).plan(
        b.block_tables, b.seq_lens, 8, 2, 64, 4, split=False) for w in (1.0, PARTIAL_WEIGHT)}
    assert plans[1.0].num_ctas == 7 and plans[PARTIAL_WEIGHT].num_ctas == 8


@pytest.mark.parametrize("kw, name", [
    (dict(max_rows=0), "max_rows"), (dict(split_share=0), "split_share"),
    (dict(partial_weight=float("nan")), "partial_weight"), (dict(min_part=0), "min_part"),
    (dict(order="fast"), "order"), (dict(narrow_share=-0.1), "narrow_share"),
    (dict(narrow_share=float("inf")), "narrow_share"), (dict(split_by="rows"), "split_by"),
    (dict(request_share=-0.5), "request_share"),
    (dict(request_share=float("nan")), "request_share"),
    (dict(kv_tile_table=((64, 32), (32, 16))), "kv_tile_table"),
])
def test_bad_tuning_is_named(kw, name):
    with pytest.raises(ValueError, match=name):
        Tuning(**kw)


def test_planner_rejects_non_tuning():
    with pytest.raises(TypeError, match="tuning"):
        Planner("pat", "h100", tuning={"order": "work"})


def test_split_by_work_cuts_slow_tiles_shorter(monkeypatch):
    """A 128-row CTA's tokens count 1.5x when the split shares out work.  The weight is set here
    (measured weights change with the kernels: since the warpgroup layout a 128-row tile is
    only ~12% slower per token than a 16-row one on the H100)."""
    from pat_core.tiles import TileSelector
    monkeypatch.setattr(TileSelector, "row_time_weight",
                        lambda self, rows: np.where(np.asarray(rows) > 64, 1.5, 1.0))
    b = build_tree_batch("1,64_4096,16", page_size=16)
    plans = {by: Planner("pat", "h100", Tuning(split_by=by, split_share=2.0)).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16) for by in ("tokens", "work")}
    big = {by: pl.cta_kv_len[pl.tile_configs[pl.cta_tile][:, 0] == 128]
           for by, pl in plans.items()}
    assert big["tokens"].size and big["work"].size
    assert big["work"].max() < big["tokens"].max()
    assert big["work"].sum() == big["tokens"].sum()        # the same tokens, cut finer


def test_auto_split_share():
    """Share 3 exactly when every pack the share-2 threshold cuts has at most 16 rows, one
    block per SM (share <= 1) when a cut pack has more; the planner's default (split_share
    None) follows it."""
    from pat_core.split import (DEFAULT_SPLIT_SHARE, SHORT_ROWS_SPLIT_SHARE, auto_split_share,
                                one_wave_share, split_threshold)
    lens = np.array([12000, 9000, 300, 200])
    assert split_threshold(lens, 8, 132, share=2.0) < 9000      # the two long packs are cut
    assert auto_split_share(lens, np.array([4, 4, 64, 64]), 8, 132) == SHORT_ROWS_SPLIT_SHARE
    # a cut pack of more than 16 rows: the largest share (1 at most, 3% steps) whose cut packs
    # make no more than 132 blocks of 8 KV heads
    many = auto_split_share(lens, np.array([4, 64, 4, 4]), 8, 132)
    assert auto_split_share(lens, np.array([17, 4, 4, 4]), 8, 132) == many
    assert auto_split_share(lens, np.array([16, 16, 4, 4]), 8, 132) == SHORT_ROWS_SPLIT_SHARE

    def cut_blocks(share):
        thr = split_threshold(lens, 8, 132, share=share)
        return sum(-(-int(n) // thr) for n in lens if n > thr) * 8
    assert many <= 1.0 and cut_blocks(many) <= 132 < cut_blocks(many / 0.97)
    assert one_wave_share(lens, 8, 132) == many
    short = np.array([200, 100])                  # nothing to cut: every pack under min_part
    assert auto_split_share(short, np.array([4, 4]), 8, 132) == DEFAULT_SPLIT_SHARE
    assert auto_split_share(np.array([], dtype=np.int64), np.array([]), 8, 132) == 2.0
    # 24 private 8192-token requests at 32:8: share 3 cuts each into 3 parts, share 2 into 2;
    # the automatic choice keeps share 3 (the pull-launch model sees no clear gain)
    b = build_tree_batch("24_8192", page_size=16)
    auto = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    p2 = Planner("pat", "h100", tuning=Tuning(split_share=2.0))
    p3 = Planner("pat", "h100", tuning=Tuning(split_share=3.0))
    two = p2.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    three = p3.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert auto.num_ctas == three.num_ctas > two.num_ctas
    # the 16k-token prefix shared by 16 requests at 32:8 (64 rows): one block per SM, 16 parts
    # of 1024 tokens where share 2 makes 32 of 512
    b = build_tree_batch("1,16_16384,16", page_size=16)
    auto = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    two = p2.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert int(auto.cta_kv_len.max()) == 2 * int(two.cta_kv_len.max()) == 1024


@pytest.mark.parametrize("spec,heads", [("1,16_16384,16", (32, 8)), ("1,32_16384,16", (64, 8)),
                                        ("1,4,64_256,1024,64", (32, 8))])
def test_many_row_splits_make_one_block_per_sm(spec, heads):
    """Where a cut CTA holds many query rows the default split makes at most one thread block
    per SM of the cut CTAs, where the plain share-1 rule overshoots (16k prefix: 17 parts, 136
    blocks on 132 SMs) and share 2 makes two per SM."""
    b = build_tree_batch(spec, page_size=16)
    args = (b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16)
    auto = Planner("pat", "h100").plan(*args)
    share2 = Planner("pat", "h100", Tuning(split_share=2.0)).plan(*args)
    whole = Planner("pat", "h100").plan(*args, split=False)
    rows = np.diff(auto.cta_req_indptr) * auto.group_size
    # in these batches every CTA of more than 16 rows is a part of a cut pack
    cut_blocks = int((rows > 16).sum()) * auto.num_kv_heads
    whole_rows = np.diff(whole.cta_req_indptr) * whole.group_size
    assert int((rows > 16).sum()) > int((whole_rows > 16).sum())      # something was cut
    assert cut_blocks <= 132
    assert auto.num_ctas < share2.num_ctas
    assert auto.stats()["partial_bytes"] < share2.stats()["partial_bytes"]
    if spec == "1,16_16384,16":
        plain = Planner("pat", "h100", Tuning(split_share=1.0)).plan(*args)
        over = np.diff(plain.cta_req_indptr) * plain.group_size
        assert int((over > 16).sum()) * plain.num_kv_heads > 132     # the overshoot avoided
        assert auto.num_ctas == 32 and set(auto.cta_kv_len.tolist()) == {16, 1024}
