"""Multi-token queries (``qo_indptr``): several query tokens per request, causal among
themselves, against the float64 reference; plan invariants; refusals."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core.executor import execute_partials, trace_cta
from pat_core.inputs import MAX_QO_LEN
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import random_kv_cache
from strategies import head_configs, prefix_batches, qo_indptrs


def _inputs(b, qo, hq, hk, d, seed=2):
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, d, seed=1)
    q = np.random.default_rng(seed).standard_normal((int(qo[-1]), hq, d)).astype(np.float32)
    return q, k, v


@given(prefix_batches(max_requests=10, max_node_pages=2), head_configs(),
       st.sampled_from(PACKERS), st.sampled_from(["NHD", "HND"]), st.data())
def test_multitoken_matches_dense_fp32(b, heads, packer, layout, data):
    """The CPU executor with mixed q_len 1..16 equals float64 dense attention (output and
    LSE) on random forests, for every packer, and the plan keeps its invariants."""
    hq, hk = heads
    d = 64
    qo = data.draw(qo_indptrs(b.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    q, k, v = _inputs(b, qo, hq, hk, d)
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    w = PrefixAttentionWrapper(backend="cpu", packer=packer, kv_layout=layout)
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size, kv_data_type="float32",
                  qo_indptr=qo)
    plan.validate()
    assert np.array_equal(plan.qo_indptr, qo)
    for r, cnt in enumerate(plan.coverage_counts()):
        assert np.all(cnt == 1), (packer, r)
    # rows: each CTA's requests' tokens x group, within its tile
    ql = np.diff(qo)
    want = [int(ql[plan.cta_req[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]].sum())
            * (hq // hk) for c in range(plan.num_ctas)]
    assert np.array_equal(plan.cta_rows(), want)
    # the tile of each CTA is chosen for its own rows (not the batch's largest q_len)
    sel = w.planner.tile_selector(d, "float32")
    assert np.array_equal(plan.cta_mn(), sel.select(plan.cta_rows(), plan.cta_kv_len))
    out, lse = w.run(q, (k, v), return_lse=True)
    assert out.shape == (qo[-1], hq, d) and lse.shape == (qo[-1], hq)
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   kv_layout=layout, return_lse=True, qo_indptr=qo)
    assert relative_error(out, ref) < 1e-5
    assert np.allclose(lse, ref_lse, rtol=0, atol=1e-4)


@given(prefix_batches(max_requests=8, max_node_pages=2), head_configs(), st.data())
def test_reference_causal_rule(b, heads, data):
    """``dense_attention`` with ``qo_indptr`` equals one-token attention of each query token
    over the prefix it may see (its own batch of requests cut to ``seq_len - n + 1 + j``)."""
    hq, hk = heads
    d = 64
    qo = data.draw(qo_indptrs(b.seq_lens))
    q, k, v = _inputs(b, qo, hq, hk, d)
    got, got_lse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                   return_lse=True, qo_indptr=qo)
    req = np.repeat(np.arange(b.batch_size), np.diff(qo))
    j = np.arange(qo[-1]) - qo[req]
    lens = b.seq_lens[req] - np.diff(qo)[req] + 1 + j
    ref, ref_lse = dense_attention(q, (k, v), b.block_tables[req], lens, b.page_size,
                                   return_lse=True)
    assert np.allclose(got, ref, rtol=0, atol=1e-12)
    assert np.allclose(got_lse, ref_lse, rtol=0, atol=1e-12)


@given(prefix_batches(max_requests=12), head_configs(), st.sampled_from(PACKERS), st.data())
def test_multitoken_stats_and_partials(b, heads, packer, data):
    """Byte accounting counts one query row per (slot, token), one partial row per (slot,
    token) of a merged request and one output row per token; every partial row is written."""
    hq, hk = heads
    d = 64
    qo = data.draw(qo_indptrs(b.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    plan = Planner(packer).plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
                                kv_data_type="float16", qo_indptr=qo)
    plan.validate()
    ql = np.diff(qo).astype(np.int64)
    ns = np.diff(plan.req_slot_indptr).astype(np.int64)
    st_ = plan.stats()
    assert st_["q_bytes"] == int((ql * ns).sum()) * hq * d * 2
    assert st_["out_bytes"] == int(qo[-1]) * hq * d * 2
    assert st_["partial_bytes"] == 2 * int((ql * ns)[ns > 1].sum()) * hq * (d + 1) * 4
    assert plan.num_partial_rows == int((ql * ns).sum())
    # the partial rows the CTAs write are each row exactly once
    rows = [plan.partial_row(s, t) for s in plan.cta_slot
            for t in range(int(ql[np.searchsorted(plan.req_slot_indptr, s, "right") - 1]))]
    assert np.array_equal(np.sort(np.array(rows, dtype=np.int64)),
                          np.arange(plan.num_partial_rows))
    # the token view: one pair per (CTA, query token), in the Plan's row order, its partial
    # rows a permutation, its limits the causal rule, and the mask flag only where needed
    tv = plan.token_view()
    assert np.array_equal(np.sort(tv.cta_slot), np.arange(plan.num_partial_rows))
    assert np.array_equal(tv.req_slot_indptr, plan.token_slot_indptr)
    for c in range(plan.num_ctas):
        reqs = plan.cta_req[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
        slots = plan.cta_slot[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
        pairs = slice(tv.cta_req_indptr[c], tv.cta_req_indptr[c + 1])
        toks = [int(qo[r]) + j for r in reqs for j in range(int(ql[r]))]
        assert tv.cta_req[pairs].tolist() == toks
        assert tv.cta_slot[pairs].tolist() == [int(plan.partial_row(s, j)) for s, r in
                                               zip(slots, reqs) for j in range(int(ql[r]))]
        s0, n = int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c])
        lim = [min(max(int(b.seq_lens[r]) - int(ql[r]) + 1 + j - s0, 0), n)
               for r in reqs for j in range(int(ql[r]))]
        assert tv.cta_kv_limit[pairs].tolist() == lim
        assert tv.cta_causal[c] == int(min(lim) < n)


@given(prefix_batches(max_requests=12), head_configs(), st.sampled_from(PACKERS))
def test_one_token_qo_indptr_is_todays_plan(b, heads, packer):
    """``qo_indptr = arange(batch + 1)`` gives the plan of ``qo_indptr=None``, array for array."""
    hq, hk = heads
    a = Planner(packer).plan(b.block_tables, b.seq_lens, hq, hk, 64, b.page_size)
    c = Planner(packer).plan(b.block_tables, b.seq_lens, hq, hk, 64, b.page_size,
                             qo_indptr=np.arange(b.batch_size + 1))
    for f in a.ARRAY_FIELDS:
        assert np.array_equal(getattr(a, f), getattr(c, f)), f
    assert not a.multi_token and not c.multi_token
    tv = c.token_view()           # one token each: the plan's own arrays, nothing masked
    assert tv.cta_req is c.cta_req and tv.cta_slot is c.cta_slot
    assert not tv.cta_causal.any()


def test_partials_of_masked_cta_are_empty():
    """A CTA reading only a request's newest positions holds the empty state ``(0, -inf)`` for
    the tokens that may not see any of them, and the merge treats it as the identity."""
    ps, n = 16, 4
    prefix = list(range(38))                       # 608 shared tokens
    table = np.array([prefix + [38], prefix + [39]], dtype=np.int32)
    seq = np.array([610, 613], dtype=np.int32)    # private leaves of 2 and 5 tokens
    qo = np.array([0, n, 2 * n], dtype=np.int32)
    hq, hk, d = 2, 1, 64
    # "node", no split: one CTA per tree node, so each leaf is a CTA of its own
    plan = Planner("node").plan(table, seq, hq, hk, d, ps, kv_data_type="float32",
                                qo_indptr=qo, split=False)
    assert plan.num_ctas == 3
    k, v = random_kv_cache(40, ps, hk, d, seed=1)
    q = np.random.default_rng(3).standard_normal((2 * n, hq, d)).astype(np.float32)
    o_p, lse_p = execute_partials(plan, q, k, v)
    empty = 0
    for c in range(plan.num_ctas):
        start = int(plan.cta_kv_start[c])
        for i in range(plan.cta_req_indptr[c], plan.cta_req_indptr[c + 1]):
            r, slot = int(plan.cta_req[i]), int(plan.cta_slot[i])
            for j in range(n):
                row = int(plan.partial_row(slot, j))
                if start >= int(seq[r]) - n + 1 + j:      # sees none of the CTA's positions
                    assert np.isneginf(lse_p[row]).all() and not o_p[row].any()
                    empty += 1
                else:
                    assert np.isfinite(lse_p[row]).all()
    assert empty == 2              # request 0's tokens 0 and 1 in its 2-token leaf
    # every CTA reads one of request 0's last 3 positions (607..609: the prefix's last token
    # too), so all mask; the same batch with one token each masks none
    assert plan.token_view().cta_causal.tolist() == [1, 1, 1]
    one = Planner("node").plan(table, seq, hq, hk, d, ps, split=False,
                               qo_indptr=np.arange(3))
    assert not one.token_view().cta_causal.any()
    ref = dense_attention(q, (k, v), table, seq, ps, qo_indptr=qo)
    w = PrefixAttentionWrapper(backend="cpu", packer="node")
    w.plan(table, seq, hq, hk, d, ps, kv_data_type="float32", qo_indptr=qo, split=False)
    assert relative_error(w.run(q, (k, v)), ref) < 1e-5


def test_single_page_last_token_masked_trace():
    """trace_cta masks the positions past each token's causal limit."""
    ps, L, n = 4, 10, 3
    table = np.arange(3, dtype=np.int32)[None, :]
    qo = np.array([0, n], dtype=np.int32)
    plan = Planner("pat").plan(table, [L], 2, 1, 64, ps, kv_data_type="float32", qo_indptr=qo)
    k, v = random_kv_cache(3, ps, 1, 64, seed=1)
    q = np.random.default_rng(3).standard_normal((n, 2, 64)).astype(np.float32)
    steps = trace_cta(plan, 0, q, k, v)
    s = np.concatenate([t["scores"] for t in steps], axis=1)     # [n * group, L]
    for j in range(n):
        lim = L - n + 1 + j
        assert np.isneginf(s[2 * j:2 * j + 2, lim:]).all()
        assert np.isfinite(s[2 * j:2 * j + 2, :lim]).all()
    ref = dense_attention(q, (k, v), table, [L], ps, qo_indptr=qo)
    assert np.allclose(steps[-1]["o"].reshape(n, 2, 64), ref, atol=1e-5)


def test_mixed_q_len_fp16_close_to_dense():
    """fp16 with multi-token queries stays as close to float64 as fp16 decode does."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,16_64,48,40", page_size=16)
    rng = np.random.default_rng(0)
    ql = rng.integers(1, 9, size=b.batch_size)
    qo = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
    k, v = random_kv_cache(b.num_pages, 16, 2, 64, seed=1, dtype=np.float16)
    q = rng.standard_normal((int(qo[-1]), 8, 64)).astype(np.float16)
    w = PrefixAttentionWrapper(backend="cpu")
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, kv_data_type="float16", qo_indptr=qo)
    out = w.run(q, (k, v))
    assert out.dtype == np.float16 and out.shape == (qo[-1], 8, 64)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16, qo_indptr=qo)
    assert relative_error(out, ref) < 2e-3


# ------------------------------------------------------------------ refusals
_T = np.arange(8, dtype=np.int32).reshape(2, 4)
_S = np.array([30, 3], dtype=np.int32)


@pytest.mark.parametrize("qo, exc, words", [
    ([0, 1], ValueError, "batch + 1"),                          # wrong length
    ([0, 1, 2, 3], ValueError, "batch + 1"),
    (np.array([0.0, 1.0, 2.0]), TypeError, "integer"),          # wrong dtype
    ([[0, 1, 2]], ValueError, "1-D"),
    ([1, 2, 3], ValueError, "start at 0"),
    ([0, 2, 1], ValueError, "1..16"),                            # decreasing
    ([0, 0, 2], ValueError, "0 query tokens"),                   # a request with no token
    ([0, 17, 18], ValueError, "limit is 16"),                    # more than 16 tokens
    ([0, 4, 8], ValueError, "seq_lens[1] = 3"),                 # more tokens than seq_len
])
def test_qo_indptr_refusals(qo, exc, words):
    w = PrefixAttentionWrapper(backend="cpu")
    with pytest.raises(exc, match="qo_indptr") as e:
        w.plan(_T, _S, 4, 2, 64, 16, qo_indptr=qo)
    assert words in str(e.value)
    with pytest.raises(RuntimeError, match="failed"):       # no stale plan left runnable
        w.stats()


def test_qo_indptr_rows_beyond_largest_tile_refused():
    w = PrefixAttentionWrapper(backend="cpu")
    with pytest.raises(ValueError, match="qo_indptr.*16 query tokens.*128 rows|qo_indptr"):
        w.plan(_T, _S, 16, 1, 64, 16, qo_indptr=[0, 16, 17])   # 16 tokens x 16 heads = 256


def test_q_rows_mismatch_refused():
    w = PrefixAttentionWrapper(backend="cpu")
    w.plan(_T, _S, 4, 2, 64, 16, kv_data_type="float32", qo_indptr=[0, 3, 5])
    k, v = random_kv_cache(8, 16, 2, 64)
    with pytest.raises(ValueError, match=r"q has shape \(2, 4, 64\).*\(5, 4, 64\).*qo_indptr"):
        w.run(np.zeros((2, 4, 64), np.float32), (k, v))
    with pytest.raises(ValueError, match="out has shape"):
        w.run(np.zeros((5, 4, 64), np.float32), (k, v), out=np.zeros((2, 4, 64), np.float32))
    out = np.zeros((5, 4, 64), np.float32)
    lse = np.zeros((5, 4), np.float32)
    w.run(np.ones((5, 4, 64), np.float32), (k, v), out=out, lse=lse)
    assert np.isfinite(lse).all() and out.any()


def test_reference_refuses_q_row_mismatch():
    k, v = random_kv_cache(8, 16, 2, 64)
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]=5"):
        dense_attention(np.zeros((2, 4, 64), np.float32), (k, v), _T, _S, 16,
                        qo_indptr=[0, 3, 5])


def test_multitoken_planner_takes_full_path():
    """With ``qo_indptr`` every step is planned from scratch, and matches a fresh plan."""
    p = Planner("pat")
    qo = np.array([0, 3, 5], dtype=np.int32)
    p.plan(_T, _S, 4, 2, 64, 16, qo_indptr=qo)
    assert p.last_path == "full"
    a = p.plan(_T, _S + 1, 4, 2, 64, 16, qo_indptr=qo)
    assert p.last_path == "full"
    b = Planner("pat").plan(_T, _S + 1, 4, 2, 64, 16, qo_indptr=qo)
    for f in a.ARRAY_FIELDS:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    c = p.plan(_T, _S + 1, 4, 2, 64, 16)          # back to one token: a plain plan
    assert not c.multi_token and c.num_qo_tokens == 2


# ------------------------------------------------------------------ simulator
@settings(max_examples=20, deadline=None)
@given(prefix_batches(max_requests=12), st.sampled_from([(8, 8), (32, 8), (4, 2), (8, 1)]),
       st.sampled_from(PACKERS), st.data())
def test_sim_bytes_scale_with_tokens(b, heads, packer, data):
    """The simulator's bytes by kind equal the plan's accounting for multi-token plans (Q,
    partial and output bytes per query token), and its timeline runs every block."""
    from sim import bytes_by_kind, simulate
    hq, hk = heads
    qo = data.draw(qo_indptrs(b.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    plan = Planner(packer).plan(b.block_tables, b.seq_lens, hq, hk, 128, b.page_size,
                                qo_indptr=qo)
    st_ = plan.stats()
    by = bytes_by_kind(plan)
    assert by["q"] == st_["q_bytes"] and by["out"] == st_["out_bytes"]
    assert by["partial_write"] + by["partial_read"] == st_["partial_bytes"]
    assert by["total"] == st_["total_bytes"]
    r = simulate(plan)
    assert r.bytes == by and r.latency_ns > 0


def test_sim_more_tokens_more_bytes_and_time():
    """Verifying 4 draft tokens moves the same KV as decode, 4x the Q and output bytes, and
    the simulator does not predict it faster."""
    from pat_core.workloads import build_tree_batch
    from sim import simulate
    b = build_tree_batch("1,8,64_2048,512,128", page_size=16)
    one = Planner("pat").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    qo = np.arange(b.batch_size + 1, dtype=np.int32) * 4
    four = Planner("pat").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, qo_indptr=qo)
    s1, s4 = one.stats(), four.stats()
    assert s4["out_bytes"] == 4 * s1["out_bytes"]
    assert s4["q_bytes"] == 4 * s4["num_slots"] * 32 * 128 * 2      # every slot: 4 tokens
    assert s1["q_bytes"] == s1["num_slots"] * 32 * 128 * 2
    assert simulate(four).latency_ns >= simulate(one).latency_ns * 0.99


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_value_past_a_tokens_limit_does_not_reach_it(bad):
    """A non-finite K / V entry at a request's newest position reaches only the token that may
    see it: the earlier tokens' outputs stay finite and equal the float64 reference."""
    ps, L, n = 16, 70, 3
    table = np.arange(-(-L // ps), dtype=np.int32)[None, :]
    qo = np.array([0, n], dtype=np.int32)
    k, v = random_kv_cache(table.shape[1], ps, 1, 64, seed=1)
    for cache in (k, v):
        cache[(L - 1) // ps, (L - 1) % ps] = bad          # position L - 1: the newest token
    q = np.random.default_rng(3).standard_normal((n, 2, 64)).astype(np.float32)
    w = PrefixAttentionWrapper(backend="cpu")
    w.plan(table, [L], 2, 1, 64, ps, kv_data_type="float32", qo_indptr=qo)
    out = w.run(q, (k, v))
    ref = dense_attention(q[:n - 1], (k, v), table, [L - 1], ps, qo_indptr=[0, n - 1])
    assert np.isfinite(out[:n - 1]).all()
    assert relative_error(out[:n - 1], ref) < 1e-5
    assert not np.isfinite(out[n - 1]).all()


def test_qo_indptr_with_batch_invariant_refused():
    w = PrefixAttentionWrapper(backend="cpu")
    with pytest.raises(ValueError, match="qo_indptr with batch_invariant"):
        w.plan(_T, _S, 4, 2, 64, 16, qo_indptr=[0, 3, 5], batch_invariant=True)


def test_plan_csr_takes_qo_indptr():
    """FlashInfer's CSR form with ``qo_indptr`` gives the padded form's plan and output."""
    from pat_core.inputs import BlockTable
    bt = BlockTable.from_padded(_T, _S, 16)
    indptr, indices, last = bt.to_csr()
    qo = [0, 3, 5]
    a = PrefixAttentionWrapper(backend="cpu")
    pa = a.plan(_T, _S, 4, 2, 64, 16, kv_data_type="float32", qo_indptr=qo)
    b = PrefixAttentionWrapper(backend="cpu")
    pb = b.plan_csr(indptr, indices, last, 4, 2, 64, 16, kv_data_type="float32", qo_indptr=qo)
    for f in pa.ARRAY_FIELDS:
        assert np.array_equal(getattr(pa, f), getattr(pb, f)), f
    k, v = random_kv_cache(8, 16, 2, 64)
    q = np.random.default_rng(0).standard_normal((5, 4, 64)).astype(np.float32)
    assert np.array_equal(a.run(q, (k, v)), b.run(q, (k, v)))


def test_multitoken_fp8_cache_with_scales():
    """Multi-token queries on an fp8 cache with scales: the float64 reference on the decoded
    values with the same scales and causal rule, to fp16 accuracy."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,3,4_40,33,20", page_size=16)
    rng = np.random.default_rng(5)
    ql = rng.integers(1, 6, size=b.batch_size)
    qo = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
    k, v = random_kv_cache(b.num_pages, 16, 2, 64, seed=3)
    k, v = k.astype(ml_dtypes.float8_e4m3fn), v.astype(ml_dtypes.float8_e4m3fn)
    q = (rng.standard_normal((int(qo[-1]), 8, 64)) / 16).astype(np.float16)
    w = PrefixAttentionWrapper(backend="cpu")
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, kv_data_type="float8_e4m3fn",
           q_data_type="float16", qo_indptr=qo)
    out = w.run(q, (k, v), k_scale=2.0, v_scale=0.5)
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16, k_scale=2.0, v_scale=0.5,
                          qo_indptr=qo)
    assert out.shape == (qo[-1], 8, 64)
    assert relative_error(out, ref) < 4e-3


@settings(max_examples=40, deadline=None)
@given(b=prefix_batches(), packer=st.sampled_from(["pat", "query", "cascade"]))
def test_one_token_plan_rows_are_the_general_rule(b, packer):
    """A plan without ``qo_indptr`` takes its token rows from its slots directly; they are
    what :func:`token_slot_indptr` gives for one token per request (int32, same values)."""
    from pat_core.plan import token_slot_indptr
    plan = Planner(packer).plan(b.block_tables, b.seq_lens, 8, 2, 64, b.page_size)
    want = token_slot_indptr(np.arange(plan.batch_size + 1), plan.req_slot_indptr)
    assert plan.token_slot_indptr.dtype == want.dtype == np.int32
    assert np.array_equal(plan.token_slot_indptr, want)
    assert np.array_equal(plan.qo_indptr, np.arange(plan.batch_size + 1))
