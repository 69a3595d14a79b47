"""The finisher phase (pat_core.fold): which CTA finishes each request, the plan's layout, and
the CPU executor's fold against the float64 dense reference."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import Planner, PrefixAttentionWrapper, Tuning
from pat_core.executor import execute, execute_partials
from pat_core.fold import (FINISH_FIRST_TOKENS, FINISH_MAX_ROWS, FINISH_PAIRS, finisher_ctas,
                           large_merge_finishers)
from pat_core.merge import merge_partials
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import assert_run_matches_dense, head_configs, prefix_batches

ALWAYS = Tuning(finish_share=1.0)


def _plan(spec, hq=32, hk=8, d=128, tuning=ALWAYS, packer="pat", **kw):
    b = build_tree_batch(spec, page_size=16, seed=3)
    plan = Planner(packer, "h100", tuning=tuning).plan(b.block_tables, b.seq_lens, hq, hk, d,
                                                       16, **kw)
    return b, plan


def test_finisher_ctas_picks_each_requests_longest_own_cta():
    #           CTA:   0  1  2  3  4  5
    first = np.array([0, 0, 1, 0, 1, 2])
    nreq = np.array([3, 1, 1, 1, 1, 1])
    kv = np.array([64, 100, 50, 100, 70, 10])
    m = np.array([16, 16, 16, 16, 16, 16])
    fin = finisher_ctas(first, nreq, kv, m, 3, share=1.0)
    # request 0: CTAs 1 and 3 tie on tokens, the later one; request 1: CTA 4 (70 > 50)
    assert fin.tolist() == [False, False, False, True, True, True]
    # the others read 64 + 100 + 50 = 214 of 394 tokens
    assert finisher_ctas(first, nreq, kv, m, 3, share=214 / 394 + 1e-9) is not None
    assert finisher_ctas(first, nreq, kv, m, 3, share=214 / 394 - 1e-9) is None
    # request 2 without a CTA of its own
    assert finisher_ctas(first, np.array([3, 1, 1, 1, 1, 2]), kv, m, 3, share=1.0) is None
    # a warpgroup-sized tile cannot finish
    m2 = m.copy()
    m2[5] = 2 * FINISH_MAX_ROWS
    assert finisher_ctas(first, nreq, kv, m2, 3, share=1.0) is None
    assert finisher_ctas(first[:0], nreq[:0], kv[:0], m[:0], 0, share=1.0) is None


def test_leaf_last_batch_gets_a_finisher_phase():
    b, plan = _plan("1,4,16_64,64,300")
    plan.validate()
    assert plan.finish_from >= 0
    f0 = plan.finish_cta
    # the finishers are the 16 leaves, after every shared CTA
    assert f0 == plan.num_ctas - 16
    assert np.all(np.diff(plan.cta_req_indptr[f0:]) == 1)
    assert sorted(plan.cta_req[plan.cta_req_indptr[f0]:].tolist()) == list(range(16))
    assert np.all(plan.cta_kv_start[f0:] == 128)
    fs = plan.finisher_slots()
    assert np.all(fs >= 0)
    assert np.array_equal(np.sort(plan.cta_slot[plan.cta_req_indptr[f0]:]), np.sort(fs))
    # no partial slot written or read for the finishers
    off = Planner("pat", "h100", tuning=Tuning(finish_share=None)).plan(
        b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert off.finish_from == -1 and off.num_slots == plan.num_slots
    saved = 2 * 16 * 32 * 129 * 4
    assert off.stats()["partial_bytes"] - plan.stats()["partial_bytes"] == saved


def test_share_rule_and_where_no_finisher_phase_is_possible():
    # the shared root is half the tokens: folded only when the share allows it
    assert _plan("1,16_2048,128", tuning=Tuning(finish_share=0.05))[1].finish_from == -1
    assert _plan("1,16_2048,128", tuning=Tuning(finish_share=0.6))[1].finish_from >= 0
    # no sharing and unsplit requests: the first phase is empty, folded even at share 0
    _, plan = _plan("200_100", tuning=Tuning(finish_share=0.0))
    assert plan.finish_from == 0 and plan.finish_cta == 0
    # off by the knob, for serial and cascade plans, and when a request has no CTA of its own
    assert _plan("200_100", tuning=Tuning(finish_share=None))[1].finish_from == -1
    assert _plan("200_100", serial=True)[1].finish_from == -1
    assert _plan("1,4,16_64,64,300", packer="cascade")[1].finish_from == -1
    b = build_tree_batch("1,4_64,300", page_size=16)
    bt = np.vstack([b.block_tables, b.block_tables[:1]])       # request 4 = request 0
    lens = np.concatenate([b.seq_lens, b.seq_lens[:1]])
    plan = Planner("pat", tuning=ALWAYS).plan(bt, lens, 32, 8, 128, 16)
    assert plan.finish_from == -1


def _fold_matches_dense_and_merge(b, plan, hq, hk, d):
    """Run ``plan`` (it folds) on the CPU: output and LSE equal float64 dense attention and the
    merge of the same CTAs' partials (the finisher's slot holding its own partial only).
    Returns the partials and the reference, ``(o_part, ref)``."""
    k, v = random_kv_cache(b.num_pages, 16, hk, d, seed=4, scale=2.0)
    q = np.random.default_rng(5).standard_normal((b.batch_size, hq, d)).astype(np.float32)
    out, lse = execute(plan, q, k, v, return_lse=True)
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16, return_lse=True)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(lse, ref_lse) < 1e-5
    o_part, l_part = execute_partials(plan, q, k, v)
    mo, ml = merge_partials(o_part, l_part, plan.req_slot_indptr)
    assert relative_error(mo, out) < 1e-5 and relative_error(ml, lse) < 1e-5
    return o_part, ref


@pytest.mark.parametrize("spec,heads", [("1,4,16_64,64,300", (32, 8)),
                                        ("1,3,9_50,70,400", (32, 32)),
                                        ("12_300", (16, 8)),
                                        ("1,6_64,500", (32, 1)),
                                        ("1,2,4,8_16,16,16,900", (64, 8))])
def test_cpu_fold_matches_dense_and_the_merge(spec, heads):
    hq, hk = heads
    d = 64
    b, plan = _plan(spec, hq, hk, d, kv_data_type="float32")
    assert plan.finish_from >= 0
    o_part, ref = _fold_matches_dense_and_merge(b, plan, hq, hk, d)
    if plan.num_slots > plan.batch_size:
        fs = plan.finisher_slots()
        assert relative_error(o_part[fs], ref) > 1e-3        # a leaf alone is not the answer


def test_cpu_fold_nonfinite_as_the_merge():
    """A NaN in a shared page reaches the finisher's rows, an empty state never makes one."""
    hq, hk, d = 8, 2, 64
    b, plan = _plan("1,2,6_40,24,30", hq, hk, d, kv_data_type="float32")
    assert plan.finish_from >= 0
    k, v = random_kv_cache(b.num_pages, 16, hk, d, seed=1)
    q = np.random.default_rng(2).standard_normal((b.batch_size, hq, d)).astype(np.float32)
    page = int(b.block_tables[0][0])
    k[page, 3, 1, 6] = np.nan                      # the root: every request, KV head 1
    out, lse = execute(plan, q, k, v, return_lse=True)
    with np.errstate(invalid="ignore"):
        ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16,
                                       return_lse=True)
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[:, 4:]).all() and not np.isnan(out[:, :4]).any()


@settings(max_examples=30, deadline=None)
@given(prefix_batches(max_requests=10, max_node_pages=2), head_configs(),
       st.sampled_from([0.0, 0.3, 1.0]))
def test_fold_plans_match_dense(b, heads, share):
    """Random prefix forests: every plan valid; where it folds, each request has exactly one
    finisher, after all of its other CTAs, and the result matches float64 dense attention."""
    hq, hk = heads
    d = 64
    w = PrefixAttentionWrapper("cpu", "pat")
    w.planner.tuning = Tuning(finish_share=share, finish_pairs=None)   # the share rule alone
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size, kv_data_type="float32")
    plan.validate()
    if plan.finish_from >= 0:
        f0 = plan.finish_cta
        cta_of = np.repeat(np.arange(plan.num_ctas), np.diff(plan.cta_req_indptr))
        fin_cta = np.full(plan.batch_size, -1)
        fin_cta[plan.cta_req[cta_of >= f0]] = cta_of[cta_of >= f0]
        assert np.all(fin_cta >= f0)
        assert np.all(cta_of[cta_of < f0] < f0)
        other = plan.cta_kv_len[:f0].astype(np.int64).sum()
        assert other <= share * plan.cta_kv_len.astype(np.int64).sum()
    assert_run_matches_dense(w, b, hq, hk, d)


def test_length_update_keeps_a_fold_plan_equal_to_a_fresh_one():
    b = build_tree_batch("1,4,16_64,64,100", page_size=16)
    p = Planner("pat", tuning=ALWAYS)
    p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    lens = b.seq_lens.copy()
    for _ in range(6):
        lens = lens + 1
        plan = p.plan(b.block_tables, lens, 32, 8, 128, 16)
        assert p.last_path == "lengths"
        fresh = Planner("pat", tuning=ALWAYS).plan(b.block_tables, lens, 32, 8, 128, 16)
        assert plan.finish_from == fresh.finish_from >= 0
        assert np.array_equal(plan.cta_kv_len, fresh.cta_kv_len)
        plan.validate()


def test_bad_finish_share_is_named():
    for bad in (-0.1, float("nan"), float("inf"), "all"):
        with pytest.raises(ValueError, match="finish_share"):
            Tuning(finish_share=bad)


# ----------------------------------------------------------------------------- large merges
def test_large_merge_finishers_rule():
    #           CTA:   0  1  2  3  4
    first = np.array([0, 0, 1, 2, 0])
    nreq = np.array([3, 1, 1, 1, 3])
    kv = np.array([512, 16, 20, 18, 512])
    m = np.array([64, 16, 16, 16, 64])
    tile = np.array([1, 0, 0, 0, 1])
    fin = large_merge_finishers(first, nreq, kv, m, tile, 3, 8, min_pairs=24)
    assert fin.tolist() == [False, True, True, True, False]
    assert large_merge_finishers(first, nreq, kv, m, tile, 3, 8, min_pairs=25) is None
    assert large_merge_finishers(first, nreq, kv, m, tile, 3, 8, min_pairs=None) is None
    # the first phase in two tile groups, or the finishers in two: no dependent launch
    assert large_merge_finishers(first, nreq, kv, m, np.array([1, 0, 0, 0, 2]), 3, 8, 24) is None
    assert large_merge_finishers(first, nreq, kv, m, np.array([1, 0, 3, 0, 1]), 3, 8, 24) is None
    # a first-phase CTA longer than the bound
    assert large_merge_finishers(first, nreq, kv, m, tile, 3, 8, 24, max_first_tokens=511) is None
    # no first phase: the share rule's case, not this one's
    assert large_merge_finishers(first[1:4], nreq[1:4], kv[1:4], m[1:4], tile[1:4], 3, 8,
                                 24) is None


@pytest.mark.parametrize("spec,heads,folds", [
    ("1,1024_1024,16", (32, 8), True),        # 32768 pairs, one 128x64 group + one 16x16 group
    ("1,1024_1024,16", (64, 8), True),
    ("1,1024_1024,16", (16, 8), False),       # 16384 pairs
    ("1,8,64,512_128,512,64,32", (32, 8), False),   # a first phase of two tile groups
    ("1,512_4096,64", (64, 8), False),        # first-phase CTAs of 4096 tokens
])
def test_large_merge_rule_in_the_planner(spec, heads, folds):
    b = build_tree_batch(spec, page_size=16, seed=3)
    args = (b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16)
    plan = Planner("pat", "h100", Tuning(finish_share=0.0)).plan(*args)
    plan.validate()
    assert (plan.finish_from >= 0) == folds
    if folds:
        f0 = plan.finish_cta
        assert plan.finish_from == 1 and plan.num_groups == 2
        assert b.batch_size * heads[0] >= FINISH_PAIRS
        assert int(plan.cta_kv_len[:f0].max()) <= FINISH_FIRST_TOKENS
        # the fold removes each request's leaf slot and the merge
        base = Planner("pat", "h100", Tuning(finish_share=0.0, finish_pairs=None)).plan(*args)
        assert base.finish_from < 0
        assert base.num_ctas == plan.num_ctas
        assert base.stats()["partial_bytes"] > plan.stats()["partial_bytes"]
    for off in (Tuning(finish_pairs=None), Tuning(finish_share=None)):
        assert Planner("pat", "h100", off).plan(*args).finish_from < 0


@st.composite
def _root_and_leaves(draw):
    """One shared root over 2-12 leaves (random lengths and page size): plans of one first-phase
    CTA group and one leaf group, which the pair rule folds when the threshold allows."""
    from pat_core.workloads import build_tree_batch
    n = draw(st.integers(2, 12))
    spec = f"1,{n}_{draw(st.integers(1, 300))},{draw(st.integers(1, 40))}"
    return build_tree_batch(spec, page_size=draw(st.sampled_from((1, 16, 32))),
                            seed=draw(st.integers(0, 99)))


@settings(max_examples=30, deadline=None)
@given(st.one_of(_root_and_leaves(), prefix_batches(max_requests=10, max_node_pages=2)),
       head_configs())
def test_large_merge_plans_match_dense(b, heads):
    """With the pair threshold at 1 (the share rule at 0), plans fold only under the pair rule's
    conditions, and every plan, folded or not, matches float64 dense attention."""
    hq, hk = heads
    d = 64
    w = PrefixAttentionWrapper("cpu", "pat")
    w.planner.tuning = Tuning(finish_share=0.0, finish_pairs=1)
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size, kv_data_type="float32")
    plan.validate()
    if plan.finish_from > 0:                 # folded by the pair rule (0: no first phase)
        f0 = plan.finish_cta
        assert plan.extra["fold_rule"] == "pairs"
        assert plan.finish_from == 1 and plan.num_groups == 2
        assert int(plan.cta_kv_len[:f0].max()) <= FINISH_FIRST_TOKENS
    assert_run_matches_dense(w, b, hq, hk, d)


def test_large_merge_rule_leaves_the_request_rule_and_older_gpus_alone():
    """A batch the per-request rule serves (long private leaves under short shared levels)
    keeps its one-CTA-per-request plan; on an A100 (no dependent launch) the rule is off."""
    b = build_tree_batch("1,32,1024_64,64,1024", page_size=16, seed=3)
    args = (b.block_tables, b.seq_lens, 32, 8, 128, 16)
    plan = Planner("pat", "h100", Tuning(finish_share=0.0)).plan(*args)
    assert plan.one_cta_per_request and plan.extra["fold_rule"] == "share"
    b = build_tree_batch("1,1024_1024,16", page_size=16, seed=3)
    args = (b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert Planner("pat", "h100", Tuning(finish_share=0.0)).plan(*args).extra["fold_rule"] == "pairs"
    a100 = Planner("pat", "a100", Tuning(finish_share=0.0)).plan(*args)
    assert a100.finish_from < 0 and a100.extra["fold_rule"] is None


@pytest.mark.parametrize("spec,heads", [("1,8_40,20", (8, 2)), ("1,16_100,9", (32, 8)),
                                        ("2,12_64,33", (16, 4)), ("1,4,16_48,32,17", (32, 8)),
                                        ("1,32_300,5", (8, 8)), ("1,6_1000,30", (12, 4))])
def test_cpu_large_merge_fold_matches_dense(spec, heads):
    """Plans the pair rule folds (threshold lowered to 1, share rule at 0, so only it can):
    the CPU executor's fold equals float64 dense attention and the merge of the same CTAs."""
    hq, hk = heads
    d = 64
    b, plan = _plan(spec, hq, hk, d, tuning=Tuning(finish_share=0.0, finish_pairs=1),
                    kv_data_type="float32")
    assert plan.finish_from == 1 and plan.num_groups == 2
    _fold_matches_dense_and_merge(b, plan, hq, hk, d)


def test_bad_finish_pairs_is_named():
    for bad in (0, -5, 1.5, "many", True):
        with pytest.raises(ValueError, match="finish_pairs"):
            Tuning(finish_pairs=bad)
