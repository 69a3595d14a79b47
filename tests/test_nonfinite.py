"""Non-finite input propagates as in dense attention, on every packer (CPU backend).

A NaN in one query row, or a NaN / +inf in one key or value, must reach the output and LSE of
exactly the rows that read it, with the float64 reference's pattern of NaN and infinities;
every other row is bit-identical to the run on clean input.
"""
import numpy as np
import pytest

from pat_core import PACKERS, PrefixAttentionWrapper
from pat_core.merge import merge_partials, merge_state
from pat_core.reference import dense_attention
from pat_core.workloads import build_tree_batch, random_kv_cache

HQ, HK, D, PS = 8, 2, 32, 16
SPEC = "1,2,6_40,24,30"           # a shared root, two branches, six leaves


def _batch():
    b = build_tree_batch(SPEC, page_size=PS)
    k, v = random_kv_cache(b.num_pages, PS, HK, D, seed=1)
    q = np.random.default_rng(2).standard_normal((b.batch_size, HQ, D)).astype(np.float32)
    return b, q, k, v


def _token_page(b, r, t):
    """(page id, slot) of token ``t`` of request ``r``."""
    return int(b.block_tables[r, t // PS]), t % PS


def _poison(where, value, b, q, k, v):
    """Copies of q/k/v with one bad element; ``where``: "q", "k_shared", "k_leaf", "v_shared",
    "v_leaf" (shared: token 3, in every request's root page; leaf: request 4's last token)."""
    q, k, v = q.copy(), k.copy(), v.copy()
    if where == "q":
        q[3, 5, 7] = value
        return q, k, v
    r, t = (0, 3) if where.endswith("shared") else (4, int(b.seq_lens[4]) - 1)
    page, slot = _token_page(b, r, t)
    (k if where[0] == "k" else v)[page, slot, 1, 6] = value
    return q, k, v


def _reads(where, b):
    """bool ``[batch, HQ]``: the rows that read the element :func:`_poison` spoils."""
    reads = np.zeros((b.batch_size, HQ), bool)
    if where == "q":
        reads[3, 5] = True
        return reads
    r0, t0 = (0, 3) if where.endswith("shared") else (4, int(b.seq_lens[4]) - 1)
    page, slot = _token_page(b, r0, t0)
    g = HQ // HK
    for r in range(b.batch_size):
        n = -(-int(b.seq_lens[r]) // PS)
        cols = np.flatnonzero(b.block_tables[r, :n] == page)
        if any(c * PS + slot < b.seq_lens[r] for c in cols):
            reads[r, g:2 * g] = True             # the poisoned element sits in KV head 1
    return reads


def _same_pattern(x, ref):
    for f in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(f(x), f(ref)), f.__name__


CASES = [("q", np.nan), ("k_shared", np.nan), ("k_leaf", np.nan), ("k_leaf", np.inf),
         ("k_shared", np.inf), ("v_shared", np.nan), ("v_leaf", np.nan), ("v_leaf", np.inf)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("packer", PACKERS)
def test_nonfinite_propagates_like_dense(packer, dtype):
    b, q, k, v = _batch()
    npdt = np.dtype(dtype)
    w = PrefixAttentionWrapper("cpu", packer=packer)
    w.plan(b.block_tables, b.seq_lens, HQ, HK, D, PS, kv_data_type=dtype)
    clean, clean_lse = w.run(q.astype(npdt), (k.astype(npdt), v.astype(npdt)), return_lse=True)
    assert np.all(np.isfinite(clean)) and np.all(np.isfinite(clean_lse))
    for where, value in CASES:
        qb, kb, vb = (x.astype(npdt) for x in _poison(where, value, b, q, k, v))
        out, lse = w.run(qb, (kb, vb), return_lse=True)
        with np.errstate(invalid="ignore"):
            ref, ref_lse = dense_attention(qb.astype(np.float64), (kb.astype(np.float64),
                                           vb.astype(np.float64)), b.block_tables, b.seq_lens,
                                           PS, return_lse=True)
        bad = ~np.isfinite(ref)
        reads = _reads(where, b)
        assert bad.any() and not reads.all(), (where, value)
        assert not bad[~reads].any()
        _same_pattern(out, ref)
        _same_pattern(lse, ref_lse)
        # rows that never read the bad value are exactly the clean run's
        assert np.array_equal(out[~reads], clean[~reads]), (where, value)
        assert np.array_equal(lse[~reads], clean_lse[~reads]), (where, value)
        # finite entries of the rows that did read it still match the reference
        fin = np.isfinite(ref)
        tol = 1e-4 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(out[fin].astype(np.float64), ref[fin], rtol=tol, atol=tol)


def test_infinite_key_scoring_minus_inf_gets_zero_weight():
    """+inf key elements meet negative query elements: score -inf, the keys drop out (the
    reference's result), even when they fill a whole tile or CTA (the leaf's own CTA)."""
    b, q, k, v = _batch()
    q[:, :, 6] = -np.abs(q[:, :, 6])          # every score against a bad key is -inf
    kb = k.copy()
    for t in range(54, int(b.seq_lens[4])):   # all of request 4's own tokens (its leaf)
        page, slot = _token_page(b, 4, t)
        kb[page, slot, 1, 6] = np.inf
    for packer in PACKERS:
        w = PrefixAttentionWrapper("cpu", packer=packer)
        w.plan(b.block_tables, b.seq_lens, HQ, HK, D, PS, kv_data_type="float32",
               tile=(64, 16))
        out, lse = w.run(q, (kb, v), return_lse=True)
        ref, ref_lse = dense_attention(q, (kb, v), b.block_tables, b.seq_lens, PS,
                                       return_lse=True)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse)), packer
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_keeps_nan_apart_from_empty():
    o = np.ones((3, 1, 4), np.float32)
    lse = np.array([[np.nan], [-np.inf], [-np.inf]], np.float32)
    out, l = merge_partials(o, lse, np.array([0, 2, 3]))
    assert np.isnan(out[0]).all() and np.isnan(l[0, 0])       # NaN is not "no keys"
    assert np.all(out[1] == 0) and l[1, 0] == -np.inf           # a truly empty request
    o2, l2 = merge_state(np.full(4, np.nan), np.float64(1.0), np.zeros(4), -np.inf)
    assert np.isnan(o2).all() and l2 == 1.0
    o3, l3 = merge_state(np.ones(4), np.float64(np.nan), np.zeros(4), -np.inf)
    assert np.isnan(o3).all() and np.isnan(l3)
