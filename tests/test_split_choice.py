"""The long-KV split's share choice (``pat_core.split``) against its obvious version.

The library runs the choice as one compiled call (``choose_split_share``,
``choose_split_threshold_fast``; ``auto_split_share`` and ``one_wave_share`` through the same
compiled rules).  The reference below is the NumPy version it was written from, step by step:
the candidate shares, their cuts (``_part_layout``), each cut's parts priced as one pull launch
(``pull_makespan_ns``) plus the merge.  The compiled choice must agree with it exactly.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import Planner
from pat_core.gpus import get_gpu
from pat_core.split import (CANDIDATE_SHARES, DEFAULT_SPLIT_SHARE, ITEM_NS, LOADED_LATENCY,
                            MANY_ROWS_SPLIT_SHARE, MERGE_NS, MODEL_MARGIN, SHORT_ROWS,
                            SHORT_ROWS_SPLIT_SHARE, _part_layout, auto_split_share,
                            choose_split_share, choose_split_threshold_fast, one_wave_share,
                            pull_makespan_ns, split_threshold)
from pat_core.tiles import TileSelector


def one_wave_share_reference(kv_len, num_kv_heads, num_sms, min_part=256,
                             share=MANY_ROWS_SPLIT_SHARE) -> float:
    """The largest ``share * 0.97**i`` whose cut packs make at most ``num_sms`` blocks."""
    kv_len = np.asarray(kv_len).astype(np.int64)
    s = float(share)
    for _ in range(200):
        thr = split_threshold(kv_len, num_kv_heads, num_sms, min_part=min_part, share=s)
        cut = kv_len > thr
        parts, _ = _part_layout(kv_len[cut], np.full(int(cut.sum()), thr, dtype=np.int64))
        if int(parts.sum()) * num_kv_heads <= num_sms:
            break
        s *= 0.97
    return s


def auto_split_share_reference(kv_len, rows, num_kv_heads, num_sms, min_part=256) -> float:
    """2 where nothing is cut; 3 where every cut pack has at most 16 rows; else one wave."""
    kv_len = np.asarray(kv_len)
    if kv_len.size == 0:
        return DEFAULT_SPLIT_SHARE
    thr = split_threshold(kv_len, num_kv_heads, num_sms, min_part=min_part,
                          share=DEFAULT_SPLIT_SHARE)
    cut = kv_len > thr
    if not cut.any():
        return DEFAULT_SPLIT_SHARE
    if bool((np.asarray(rows)[cut] <= SHORT_ROWS).all()):
        return SHORT_ROWS_SPLIT_SHARE
    return one_wave_share_reference(kv_len, num_kv_heads, num_sms, min_part=min_part)


def _price_thresholds_reference(length, rows, thresholds, *, num_kv_heads, head_dim, kv_bytes, gpu,
                      selector) -> list:
    """Predicted time (ns) of cutting the packs at each of ``thresholds``: the parts priced as
    one pull launch (a part's KV-head blocks one item, longest first), plus the merge."""
    from pat_core.cuda_compile import default_layout
    from pat_core.tiles import estimate_resources, kernel_resources
    length = np.asarray(length).astype(np.int64)
    rows = np.asarray(rows).astype(np.int64)
    K = length.shape[0]
    layouts, toks, prows = [], [], []
    for thr in thresholds:
        parts, plen = _part_layout(length, np.full(K, max(int(thr), 1), dtype=np.int64))
        tok = np.repeat(plen, parts)       # the parts split_long_kv makes, the last the rest
        tok[np.cumsum(parts) - 1] = length - (parts - 1) * plen
        layouts.append(parts)
        toks.append(tok)
        prows.append(np.repeat(rows, parts))
    all_tok = np.concatenate(toks)
    all_rows = np.concatenate(prows)
    mn = selector.select(all_rows, all_tok)
    key = mn[:, 0].astype(np.int64) * 65536 + mn[:, 1]
    ukey, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    slot = np.empty(ukey.shape[0])
    inflight = np.empty(ukey.shape[0])
    dtype = "float16" if kv_bytes == 2 else "float32"
    for u, k in enumerate(ukey.tolist()):
        m, n = k // 65536, k % 65536
        res = kernel_resources(m, n, head_dim, dtype, gpu) or estimate_resources(m, n, head_dim)
        slot[u] = num_kv_heads / max(res.ctas_per_sm(gpu), 1)
        stages = default_layout(m, n, head_dim)[1]
        inflight[u] = num_kv_heads * max(stages - 1, 1) * n * head_dim * 2 * kv_bytes
    bandwidth = gpu.hbm_bandwidth * gpu.achieved_bw_fraction
    latency = gpu.mem_latency_ns * LOADED_LATENCY
    out, lo = [], 0
    for parts, tok, prow in zip(layouts, toks, prows):
        hi = lo + tok.shape[0]
        cfg = inv[lo:hi]
        lo = hi
        cut = np.repeat(parts > 1, parts)
        nbytes = num_kv_heads * (tok * (head_dim * 2 * kv_bytes) +
                                 np.where(cut, prow * head_dim * 4, 0)).astype(np.float64)
        order = np.argsort(-nbytes, kind="stable")
        t = pull_makespan_ns(nbytes[order], inflight[cfg][order], slot[cfg][order],
                             float(gpu.num_sms), bandwidth, latency, ITEM_NS)
        if (parts > 1).any():
            merge_bytes = float((parts * (parts > 1) * rows).sum()) * num_kv_heads * head_dim * 4
            t += MERGE_NS + merge_bytes / bandwidth
        out.append(t)
    return out




def choose_split_share_reference(length, rows, *, num_kv_heads, head_dim, kv_bytes, gpu,
                                 selector, min_part=256):
    """``(share, predicted)``: the automatic share, unless another candidate is priced at
    least MODEL_MARGIN cheaper; ``predicted``: ``{share: ns}`` of the shares priced (shares
    that cut as an earlier one are left out; nothing is priced when every share cuts alike)."""
    length = np.asarray(length)
    rows = np.asarray(rows)
    auto = auto_split_share_reference(length, rows, num_kv_heads, gpu.num_sms, min_part=min_part)
    if length.size == 0:
        return auto, {}
    cands = [auto] + sorted({*CANDIDATE_SHARES, one_wave_share_reference(
        length, num_kv_heads, gpu.num_sms, min_part=min_part)} - {auto}, reverse=True)
    lengths = length.astype(np.int64)
    shares, thrs, seen = [], [], set()
    for s in cands:
        thr = split_threshold(length, num_kv_heads, gpu.num_sms, min_part=min_part, share=s)
        parts, _ = _part_layout(lengths, np.full(lengths.shape[0], thr, dtype=np.int64))
        key = parts.tobytes()
        if key in seen:            # the same cuts as a share already listed
            continue
        seen.add(key)
        shares.append(s)
        thrs.append(thr)
    if len(shares) == 1:
        return auto, {}
    times = _price_thresholds_reference(length, rows, thrs, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, kv_bytes=kv_bytes, gpu=gpu, selector=selector)
    predicted = dict(zip(shares, times))
    best = min(predicted, key=predicted.get)
    if predicted[best] < predicted[auto] * (1.0 - MODEL_MARGIN):
        return best, predicted
    return auto, predicted




GPUS = ("h100", "h200", "a100")


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(1, 40000), min_size=1, max_size=40),
       rows=st.lists(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), min_size=40, max_size=40),
       hk=st.sampled_from([1, 2, 8, 32]), d=st.sampled_from([64, 128]),
       gpu=st.sampled_from(GPUS))
def test_compiled_choice_equals_the_reference(lens, rows, hk, d, gpu):
    spec = get_gpu(gpu)
    sel = TileSelector(d, "float16", spec)
    length = np.array(lens, dtype=np.int64)
    r = np.array(rows[:len(lens)], dtype=np.int64)
    kw = dict(num_kv_heads=hk, head_dim=d, kv_bytes=2, gpu=spec, selector=sel)
    want, _ = choose_split_share_reference(length, r, **kw)
    assert choose_split_share(length, r, **kw) == want
    # the planner's per-step call: the threshold at that share, from packs as arrays
    ind = np.concatenate(([0], np.cumsum(np.maximum(r // 4, 1)))).astype(np.int32)
    start = np.zeros(length.shape[0], dtype=np.int32)
    thr, most = choose_split_threshold_fast(ind, start, length.astype(np.int32), 4, **kw)
    rows4 = np.diff(ind) * 4
    want4, _ = choose_split_share_reference(length, rows4, **kw)
    assert thr == split_threshold(length, hk, spec.num_sms, share=want4)
    assert most == int(rows4.max())
    assert auto_split_share(length, r, hk, spec.num_sms) == \
        auto_split_share_reference(length, r, hk, spec.num_sms)
    assert one_wave_share(length, hk, spec.num_sms) == \
        one_wave_share_reference(length, hk, spec.num_sms)


@pytest.mark.parametrize("spec", ["8_4096", "1,4,16_128,256,1024", "4_8192", "32_300",
                                  "1,3,48_1024,6144,4096", "1,16_16384,16", "24_8192"])
def test_choice_on_the_measured_batches(spec):
    """Batches whose share the development set measured: the reference and the compiled
    choice agree, and where the model overrides the automatic share it predicts at least
    MODEL_MARGIN less time."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(spec, page_size=16)
    planner = Planner("pat", "h100")
    plan = planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, split=False)
    length = plan.cta_kv_len.astype(np.int64)
    rows = np.diff(plan.cta_req_indptr).astype(np.int64) * 4
    gpu = get_gpu("h100")
    kw = dict(num_kv_heads=8, head_dim=128, kv_bytes=2, gpu=gpu,
              selector=planner.tile_selector(128))
    share, predicted = choose_split_share_reference(length, rows, **kw)
    assert choose_split_share(length, rows, **kw) == share
    auto = auto_split_share_reference(length, rows, 8, gpu.num_sms)
    if share != auto:
        assert predicted[share] < predicted[auto] * (1 - MODEL_MARGIN)


def _lookup_constants(sel, hk, d, spec):
    from pat_core.split import _price_constants
    m_values, bounds, fid, _ = sel.lookup()
    slot, inflight = _price_constants(sel, hk, d, 2, spec)
    bw = float(spec.hbm_bandwidth * spec.achieved_bw_fraction)
    lat = float(spec.mem_latency_ns * LOADED_LATENCY)
    return m_values, bounds, fid, slot, inflight, bw, lat


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(1, 40000), min_size=1, max_size=60),
       rows=st.lists(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), min_size=60, max_size=60),
       thr=st.integers(16, 20000), hk=st.sampled_from([1, 2, 8, 32]),
       d=st.sampled_from([64, 128]), gpu=st.sampled_from(GPUS))
def test_price_floor_never_exceeds_the_price(lens, rows, thr, hk, d, gpu):
    """The floor that lets the choice skip a candidate's pull launch is a lower bound of its
    price, for any cut (a floor above the price could skip the share the model would pick)."""
    from pat_core.split import _parts_of, _price_floor, _price_items, _price_nb
    spec = get_gpu(gpu)
    sel = TileSelector(d, "float16", spec)
    m_values, bounds, fid, slot, inflight, bw, lat = _lookup_constants(sel, hk, d, spec)
    length = np.array(lens, dtype=np.int64)
    r = np.array(rows[:len(lens)], dtype=np.int64)
    pl = [_parts_of(int(x), thr) for x in length]
    parts = np.array([p[0] for p in pl], dtype=np.int64)
    plen = np.array([p[1] for p in pl], dtype=np.int64)
    price = _price_nb(length, r, parts, plen, hk, d, 2, spec.num_sms, m_values, bounds, fid,
                      slot, inflight, bw, lat)
    nbytes, cfg, merge, cut = _price_items(length, r, parts, plen, hk, d, 2, m_values, bounds,
                                           fid)
    floor = _price_floor(nbytes, cfg, merge, cut, hk, d, inflight, bw, lat)
    assert 0 < floor <= price * (1 + 1e-12)


@pytest.mark.parametrize("requests", [64, 128, 256])
def test_choice_with_skipped_candidates_equals_the_reference(requests):
    """Serving-loop packs (bandwidth bound: the floor is within a few percent of the price,
    so the choice skips candidates) choose the share the reference prices in full; and on
    these steps the floor does skip some candidate (else this test would not test it)."""
    from pat_core.split import (FLOOR_SLACK, _parts_of, _price_floor, _price_items,
                                _threshold_nb)
    from pat_core.workloads import ServingLoop
    spec = get_gpu("h100")
    planner = Planner("pat", "h100")
    sel = planner.tile_selector(128)
    kw = dict(num_kv_heads=8, head_dim=128, kv_bytes=2, gpu=spec, selector=sel)
    m_values, bounds, fid, slot, inflight, bw, lat = _lookup_constants(sel, 8, 128, spec)
    loop = ServingLoop(requests, 4, 2048, (128, 3072), 16, seed=1)
    skipped = 0
    for step in range(40):
        table, lens = loop.step()
        if step % 8:
            continue
        plan = planner.plan(table, lens, 32, 8, 128, 16, split=False)
        length = plan.cta_kv_len.astype(np.int64)
        rows = np.diff(plan.cta_req_indptr).astype(np.int64) * 4
        share, predicted = choose_split_share_reference(length, rows, **kw)
        assert choose_split_share(length, rows, **kw) == share
        if len(predicted) < 2:
            continue
        auto = auto_split_share_reference(length, rows, 8, spec.num_sms)
        line = predicted[auto] * (1 - MODEL_MARGIN)
        for s in predicted:
            if s == auto:
                continue
            thr = _threshold_nb(float(length.sum()), 8, spec.num_sms, 256, s)
            pl = [_parts_of(int(x), thr) for x in length]
            parts = np.array([p[0] for p in pl], dtype=np.int64)
            plen = np.array([p[1] for p in pl], dtype=np.int64)
            items = _price_items(length, rows, parts, plen, 8, 128, 2, m_values, bounds, fid)
            floor = _price_floor(*items, 8, 128, inflight, bw, lat)
            assert floor <= predicted[s] * (1 + 1e-12)
            skipped += floor * (1 - FLOOR_SLACK) >= line
    assert skipped > 0


def test_a_plan_that_merges_anyway_is_cut_to_the_short_part():
    """A plan that merges at ``min_part`` is split again with parts down to ``merge_min_part``
    (``assemble_plan``); a plan without a merge (one CTA per request) keeps ``min_part``;
    ``merge_min_part >= min_part`` or ``split=False`` turns it off; a growing step planned
    incrementally equals its fresh plan."""
    from pat_core import Planner
    from pat_core.tuning import Tuning, merge_min_part
    from pat_core.workloads import build_tree_batch

    def plan(spec, tuning=None, **kw):
        b = build_tree_batch(spec, page_size=16, seed=0)
        return Planner("pat", "h100", tuning).plan(b.block_tables, b.seq_lens, 32, 8, 128, 16,
                                                   **kw)

    assert merge_min_part(Tuning()) == 64 < Tuning().min_part == 256
    off = Tuning(merge_min_part=256)
    # one request of 512 tokens: two parts of 256 merge anyway, so eight of 64
    assert plan("1_512", off).cta_kv_len.tolist() == [256, 256]
    assert plan("1_512").cta_kv_len.tolist() == [64] * 8
    assert plan("1_512", Tuning(merge_min_part=128)).cta_kv_len.tolist() == [128] * 4
    assert plan("1_512", split=False).cta_kv_len.tolist() == [512]
    # a shared prompt: the plan merges with or without the rule; 512 shared tokens cut finer
    shared, fine = plan("1,2_512,64", off), plan("1,2_512,64")
    assert shared.num_slots > shared.batch_size and fine.num_ctas > shared.num_ctas
    assert int(fine.cta_kv_len.max()) == 64
    # a share of the tuning's own, above the candidates': the fine bound still applies
    big = plan("1,4_40000,100", Tuning(split_share=64.0))
    assert big.num_slots > big.batch_size and int(big.cta_kv_len.max()) == 64
    # the "mean" rule reads no min_part: the same plan either way
    assert np.array_equal(plan("1_512", split="mean").cta_kv_len,
                          plan("1_512", off, split="mean").cta_kv_len)
    # eight requests of 256 tokens, one CTA each, no merge: not cut
    for spec in ("8_256", "1,2_48,144"):
        a, b = plan(spec), plan(spec, off)
        assert a.num_slots == a.batch_size and np.array_equal(a.cta_kv_len, b.cta_kv_len)
    # not into a second wave: at head_dim 256 the 2048-token prompt's 64-token parts would be
    # 34 CTAs of 16x32 blocks (two per SM): 272 items for 264 slots, so the coarse plan stays;
    # at head_dim 128 the same cut fits one wave and is kept
    from pat_core.gpus import get_gpu
    from pat_core.planner import second_wave

    def at(d, tuning=None):
        b = build_tree_batch("1,2_2048,64", page_size=16, seed=0)
        return Planner("pat", "h100", tuning).plan(b.block_tables, b.seq_lens, 32, 8, d, 16)

    h100 = get_gpu("h100")
    cut = at(256, Tuning(min_part=64))
    assert cut.num_ctas == 34 and second_wave(cut, h100, "float16")
    assert at(256).num_ctas == at(256, off).num_ctas == 10
    assert not second_wave(at(256), h100, "float16")
    assert at(128).num_ctas > at(128, off).num_ctas
    assert not second_wave(at(128), h100, "float16")
    # a step growing token by token: the "lengths" path gives the fresh plan
    b = build_tree_batch("1,2_512,64", page_size=16, seed=0)
    table = np.concatenate([b.block_tables, b.num_pages + np.arange(
        b.block_tables.shape[0] * 4).reshape(-1, 4)], axis=1).astype(np.int32)
    lens = b.seq_lens.copy()
    inc = Planner("pat", "h100")
    for step in range(6):
        got = inc.plan(table, lens, 32, 8, 128, 16)
        want = Planner("pat", "h100").plan(table, lens, 32, 8, 128, 16)
        assert step == 0 or inc.last_path == "lengths", inc.last_path
        for name in got.ARRAY_FIELDS:
            assert np.array_equal(getattr(got, name), getattr(want, name)), (step, name)
        lens = lens + 1
