"""Plan invariants and CPU-executor correctness on random prefix forests, for every packer."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core.forest import PrefixForest
from pat_core.inputs import BlockTable
from pat_core.tiles import TileSelector
from pat_core.reference import dense_attention, lowp_attention, relative_error
from pat_core.workloads import random_kv_cache
from strategies import head_configs, prefix_batches

FP16_UNIT = 2.0 ** -11   # one rounding of an fp16 output: the floor of any fp16 result's error


def plan_all(b, hq, hk, d, gpu="h100", kv="float32"):
    return {p: Planner(p, gpu).plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
                                    kv_data_type=kv) for p in PACKERS}


@given(prefix_batches(), head_configs(), st.sampled_from([64, 128]),
       st.sampled_from(["a100", "h100", "h200"]))
def test_coverage_slots_and_bytes(b, heads, d, gpu):
    hq, hk = heads
    plans = plan_all(b, hq, hk, d, gpu)
    bt = BlockTable.from_padded(b.block_tables, b.seq_lens, b.page_size)
    unique = PrefixForest(bt).unique_tokens()
    for packer, plan in plans.items():
        plan.validate()
        for r, cnt in enumerate(plan.coverage_counts()):
            assert cnt.shape[0] == b.seq_lens[r]
            assert np.all(cnt == 1), (packer, r)
        # every slot of a request written by exactly one CTA
        assert np.bincount(plan.cta_slot, minlength=plan.num_slots).max() == 1
        # pages a CTA lists are the request's own pages
        for c in range(plan.num_ctas):
            r = plan.cta_req[plan.cta_req_indptr[c]]
            first = plan.cta_kv_start[c] // b.page_size
            pages = plan.cta_pages[plan.cta_page_indptr[c]:plan.cta_page_indptr[c + 1]]
            assert np.array_equal(pages, bt.table[r, first:first + pages.shape[0]])
    q_kv = plans["query"].stats()["kv_tokens"]
    assert q_kv == int(b.seq_lens.sum())
    pat_kv = plans["pat"].stats()["kv_tokens"]
    assert unique <= pat_kv <= q_kv
    for p in ("node", "cascade", "compute"):
        assert unique <= plans[p].stats()["kv_tokens"] <= q_kv
    # node packing reads each node once per chunk of at most max_rows // group requests
    f = PrefixForest(bt)
    max_req = TileSelector(d, "float32", gpu).max_rows // (hq // hk)
    chunks = -(-f.node_size()[1:] // max_req)
    assert plans["node"].stats()["kv_tokens"] == int((f.node_len()[1:] * chunks).sum())


@given(prefix_batches(max_requests=10, max_node_pages=2), head_configs(),
       st.sampled_from(PACKERS), st.sampled_from(["NHD", "HND"]), st.data())
def test_cpu_executor_matches_dense_fp32(b, heads, packer, layout, data):
    hq, hk = heads
    d = 64
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, d, np.float32, layout,
                           seed=data.draw(st.integers(0, 1000)), scale=2.0)
    q = np.random.default_rng(1).standard_normal((b.batch_size, hq, d)).astype(np.float32)
    w = PrefixAttentionWrapper("cpu", packer, kv_layout=layout)
    w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size, kv_data_type="float32")
    out, lse = w.run(q, (k, v), return_lse=True)
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   kv_layout=layout, return_lse=True)
    assert out.dtype == np.float32 and out.shape == (b.batch_size, hq, d)
    assert np.isfinite(out).all()
    assert relative_error(out, ref) <= 1e-5
    assert relative_error(lse, ref_lse) <= 1e-5


@given(prefix_batches(max_requests=8, max_node_pages=2), head_configs(),
       st.sampled_from(PACKERS))
def test_cpu_executor_fp16_within_twice_plain_fp16(b, heads, packer):
    hq, hk = heads
    d = 64
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, d, np.float16, seed=3)
    q = np.random.default_rng(2).standard_normal((b.batch_size, hq, d)).astype(np.float16)
    w = PrefixAttentionWrapper("cpu", packer)
    w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size)
    out = w.run(q, (k, v))
    assert out.dtype == np.float16
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size)
    plain = relative_error(lowp_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size),
                           ref)
    assert relative_error(out, ref) <= max(2 * plain, FP16_UNIT)


@pytest.mark.parametrize("packer", PACKERS)
def test_sm_scale_is_applied(packer):
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,3_20,9", page_size=4)
    k, v = random_kv_cache(b.num_pages, 4, 2, 64)
    q = np.random.default_rng(0).standard_normal((3, 4, 64)).astype(np.float32)
    w = PrefixAttentionWrapper("cpu", packer)
    w.plan(b.block_tables, b.seq_lens, 4, 2, 64, 4, sm_scale=0.3, kv_data_type="float32")
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 4, sm_scale=0.3)
    assert relative_error(w.run(q, (k, v)), ref) <= 1e-5


@settings(max_examples=60, deadline=None)
@given(b=prefix_batches(), packer=st.sampled_from(["pat", "query", "node", "cascade"]),
       heads=st.sampled_from([(8, 2), (32, 8), (4, 4)]), multi=st.booleans(), data=st.data())
def test_one_call_plan_equals_the_step_by_step_plan(b, packer, heads, multi, data):
    """The default split rule's one compiled call (threshold, split, tiles, layout) makes the
    arrays of the steps it fuses: ``choose_split_threshold_fast``'s threshold, then
    ``_tail_layout_nb`` at it (at either shortest part :func:`assemble_plan` splits with)."""
    from pat_core.forest import PrefixForest
    from pat_core.inputs import as_block_table
    from pat_core.packers import pack
    from pat_core.planner import _ORDER_MODE, _assemble, _plan_of_arrays, _tail_layout_nb
    from pat_core.split import choose_split_threshold_fast
    from pat_core.tuning import Tuning
    from strategies import qo_indptrs
    hq, hk = heads
    group = hq // hk
    planner = Planner(packer)
    sel = planner.tile_selector(64, "float16")
    bt = as_block_table(b.block_tables, b.seq_lens, b.page_size)
    q_lens = None
    if multi:
        qo = data.draw(qo_indptrs(bt.seq_lens, max_len=max(1, sel.max_rows // group)))
        q_lens = np.diff(qo)
    packs = pack(PrefixForest(bt), packer, group, sel.max_rows, 64, 2, 2, q_lens=q_lens)
    kw = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=64, sm_scale=0.125, packer=packer,
              selector=sel, kv_dtype="float16")
    from pat_core.tuning import MERGE_MIN_PART
    tuning = Tuning(min_part=data.draw(st.sampled_from([Tuning().min_part, MERGE_MIN_PART])))
    got = _assemble(bt, packs, serial=False, split=True, tuning=tuning, **kw)
    thr, _ = choose_split_threshold_fast(packs.req_indptr, packs.kv_start, packs.kv_end, group,
                                         num_kv_heads=hk, head_dim=64, kv_bytes=2,
                                         gpu=sel.gpu, selector=sel, rows=packs.rows,
                                         min_part=tuning.min_part)
    m_values, bounds, fid, configs = sel.lookup()
    arrays = _tail_layout_nb(packs.req_indptr, packs.reqs, packs.kv_start, packs.kv_end,
                             packs.level, thr, packs.pack_rows(group), m_values, bounds, fid,
                             np.ascontiguousarray(configs[:, 0]),
                             3 if packer == "cascade" else _ORDER_MODE[Tuning().order], bt.table,
                             bt.page_size, bt.batch_size)
    want = _plan_of_arrays(bt, arrays, configs, num_qo_heads=hq, num_kv_heads=hk, head_dim=64,
                           sm_scale=0.125, packer=packer, gpu=sel.gpu, kv_dtype="float16",
                           serial=packer == "cascade")
    assert got.serial == want.serial
    for f in got.ARRAY_FIELDS:
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
