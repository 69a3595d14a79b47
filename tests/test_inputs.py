"""Every bad input raises a clear error naming the argument; every input form agrees."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import BlockTable, PrefixAttentionWrapper
from pat_core.workloads import build_tree_batch, random_kv_cache


def test_three_forms_agree():
    b = build_tree_batch("1,4_40,23", page_size=16)
    bt = BlockTable.from_padded(b.block_tables, b.seq_lens, 16)
    lists = [list(row[row >= 0]) + [999] for row in b.block_tables]   # longer than needed
    bl = BlockTable.from_lists(lists, b.seq_lens, 16)
    bc = BlockTable.from_csr(*bt.to_csr(), 16)
    for other in (bl, bc):
        assert np.array_equal(other.table, bt.table)
        assert np.array_equal(other.seq_lens, bt.seq_lens)
    w = PrefixAttentionWrapper("cpu")
    p1 = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    p2 = PrefixAttentionWrapper("cpu").plan_csr(*bt.to_csr(), 8, 2, 64, 16)
    p3 = PrefixAttentionWrapper("cpu").plan(lists, b.seq_lens, 8, 2, 64, 16)
    for p in (p2, p3):
        assert p.stats() == p1.stats()
        assert np.array_equal(p.cta_pages, p1.cta_pages)


def test_padding_ignored_whatever_it_holds():
    t = np.array([[3, 4, -7, 10**6], [3, 5, 2**31 - 1, -1]], dtype=np.int64)
    bt = BlockTable.from_padded(t, [20, 17], 16)
    assert bt.table.tolist() == [[3, 4], [3, 5]]


@pytest.mark.parametrize("table,lens,match", [
    ([[0, -1]], [20], r"block_tables\[0, 1\] = -1 is a negative page id"),
    ([[0, 1]], [0], r"seq_lens\[0\] = 0"),
    ([[0, 1]], [-3], r"seq_lens\[0\] = -3"),
    ([[0, 1]], [40], r"seq_lens\[0\] = 40 needs 3 pages"),
    ([[0, 1], [2, 3]], [5], r"seq_lens has 1 entries but block_tables has 2 rows"),
])
def test_bad_block_tables(table, lens, match):
    with pytest.raises(ValueError, match=match):
        PrefixAttentionWrapper("cpu").plan(np.array(table), np.array(lens), 4, 4, 64, 16)


def test_bad_list_and_dtypes():
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(ValueError, match=r"block_tables\[1\] lists 1"):
        w.plan([[0, 1], [2]], [20, 20], 4, 4, 64, 16)
    with pytest.raises(TypeError, match="block_tables must hold integers"):
        w.plan(np.array([[0.0, 1.0]]), [20], 4, 4, 64, 16)
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        w.plan(np.array([0, 1]), [20], 4, 4, 64, 16)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        w.plan(np.array([[0]]), [1], 4, 4, 64, 0)
    with pytest.raises(ValueError, match="seq_lens is required"):
        w.plan(np.array([[0]]), None, 4, 4, 64, 16)


@pytest.mark.parametrize("hq,hk,d,match", [
    (6, 4, 64, "num_qo_heads = 6 is not a multiple of num_kv_heads = 4"),
    (0, 1, 64, "num_qo_heads must be >= 1"),
    (4, 0, 64, "num_kv_heads must be >= 1"),
    (4, 4, 0, "head_dim must be >= 1"),
    (512, 1, 64, "exceeds the largest tile"),
])
def test_bad_heads(hq, hk, d, match):
    with pytest.raises(ValueError, match=match):
        PrefixAttentionWrapper("cpu").plan(np.array([[0]]), [3], hq, hk, d, 16)


def test_csr_errors():
    with pytest.raises(ValueError, match="indptr must start with 0"):
        BlockTable.from_csr([1, 2], [0, 1], [3], 16)
    with pytest.raises(ValueError, match="last_page_len entries"):
        BlockTable.from_csr([0, 1], [0], [17], 16)
    with pytest.raises(ValueError, match="last_page_len has 2 entries"):
        BlockTable.from_csr([0, 1], [0], [3, 4], 16)
    with pytest.raises(ValueError, match=r"indptr\[-1\] = 3 exceeds len\(indices\) = 1"):
        BlockTable.from_csr([0, 3], [0], [3], 16)
    with pytest.raises(ValueError, match="strictly increasing"):
        BlockTable.from_csr([0, 0], [], [3], 16)


def test_run_input_mismatches():
    b = build_tree_batch("1,2_20,5", page_size=16)
    k, v = random_kv_cache(b.num_pages, 16, 2, 64)
    q = np.zeros((2, 4, 64), np.float32)
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(RuntimeError, match="call plan"):
        w.run(q, (k, v))
    w.plan(b.block_tables, b.seq_lens, 4, 2, 64, 16, kv_data_type="float32")
    with pytest.raises(ValueError, match=r"q has shape \(2, 4, 32\)"):
        w.run(np.zeros((2, 4, 32), np.float32), (k, v))
    with pytest.raises(ValueError, match="q must be"):
        w.run(np.zeros((2, 4), np.float32), (k, v))
    with pytest.raises(TypeError, match=r"q is float16 but plan\(\) fixed q_data_type"):
        w.run(q.astype(np.float16), (k, v))
    with pytest.raises(ValueError, match="paged_kv_cache has page_size 8"):
        w.run(q, (k[:, :8], v[:, :8]))
    with pytest.raises(ValueError, match="paged_kv_cache has 1 KV heads"):
        w.run(q, (k[:, :, :1], v[:, :, :1]))
    with pytest.raises(ValueError, match="equal shapes"):
        w.run(q, (k, v[:-1]))
    with pytest.raises(ValueError, match=r"uses page \d+ but paged_kv_cache holds only 1 pages"):
        w.run(q, (k[:1], v[:1]))
    with pytest.raises(TypeError, match="unsupported dtype"):
        w.run(q.astype(np.int32), (k.astype(np.int32), v.astype(np.int32)))


def test_five_d_cache_and_bad_constructor_args():
    b = build_tree_batch("1,2_20,5", page_size=16)
    k, v = random_kv_cache(b.num_pages, 16, 2, 64)
    q = np.random.default_rng(0).standard_normal((2, 4, 64)).astype(np.float32)
    w = PrefixAttentionWrapper("cpu")
    w.plan(b.block_tables, b.seq_lens, 4, 2, 64, 16, kv_data_type="float32")
    np.testing.assert_array_equal(w.run(q, np.stack([k, v], axis=1)), w.run(q, (k, v)))
    with pytest.raises(ValueError, match="backend must be one of"):
        PrefixAttentionWrapper("tpu")
    with pytest.raises(ValueError, match="packer must be one of"):
        PrefixAttentionWrapper("cpu", packer="greedy")
    with pytest.raises(ValueError, match="kv_layout must be"):
        PrefixAttentionWrapper("cpu", kv_layout="NDH")
    with pytest.raises(ValueError, match="tree spec"):
        build_tree_batch("1,2,3")


def test_plan_keyword_validation():
    w = PrefixAttentionWrapper("cpu")
    t = np.array([[0, 1]], dtype=np.int32)
    for bad in ("x", True):
        with pytest.raises(TypeError, match="sm_scale must be a number"):
            w.plan(t, [20], 4, 4, 64, 16, sm_scale=bad)
    with pytest.raises(ValueError, match="sm_scale must be a positive finite"):
        w.plan(t, [20], 4, 4, 64, 16, sm_scale=float("nan"))
    # the kernels take the scale as a float32: past its range it would be inf (NaN output)
    for big in (10**400, 1e39):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite"):
            w.plan(t, [20], 4, 4, 64, 16, sm_scale=big)
    with pytest.raises(ValueError, match=r"tile must be a pair of ints"):
        w.plan(t, [20], 4, 4, 64, 16, tile=(16,))
    # split and serial by value, not truthiness (an array's truth is ambiguous)
    for bad in (5, float("nan"), "median", np.array([1, 0])):
        with pytest.raises(ValueError, match="split must be True, False or one of"):
            w.plan(t, [20], 4, 4, 64, 16, split=bad)
    with pytest.raises(TypeError, match="serial must be a bool"):
        w.plan(t, [20], 4, 4, 64, 16, serial=1)
    for ok in (True, False, "sm", "mean", np.bool_(True)):
        w.plan(t, [20], 4, 4, 64, 16, split=ok)
    with pytest.raises(TypeError, match="kv_data_type: unsupported dtype"):
        w.plan(t, [20], 4, 4, 64, 16, kv_data_type="int8")
    p = w.plan(t, [20], 4, 4, 64, 16, kv_data_type=np.float16)   # NumPy scalar types work
    assert p.kv_dtype == "float16"
    # the cached path still validates seq_lens
    with pytest.raises(TypeError, match="seq_lens must hold integers"):
        w.plan(t, np.array([20.5]), 4, 4, 64, 16, kv_data_type=np.float16)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 0"):
        w.plan(t, [0], 4, 4, 64, 16, kv_data_type=np.float16)


def test_q_dtype_in_stats():
    from pat_core import Planner          # the wrapper refuses mixed dtypes; the planner prices them
    t = np.array([[0, 1]], dtype=np.int32)
    a = Planner("pat").plan(t, [20], 4, 4, 64, 16, kv_data_type="float16")
    b = Planner("pat").plan(t, [20], 4, 4, 64, 16, kv_data_type="float16",
                            q_data_type="float32")
    assert b.stats()["q_bytes"] == 2 * a.stats()["q_bytes"]
    assert b.stats()["kv_bytes"] == a.stats()["kv_bytes"]


def test_executor_and_reference_check_their_inputs():
    from pat_core.executor import execute
    from pat_core.reference import dense_attention
    b = build_tree_batch("1,2_20,5", page_size=16)
    k, v = random_kv_cache(b.num_pages, 16, 2, 64)
    q = np.zeros((2, 4, 64), np.float32)
    plan = PrefixAttentionWrapper("cpu").plan(b.block_tables, b.seq_lens, 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"uses page \d+ but paged_kv_cache holds only 1 pages"):
        execute(plan, q, k[:1], v[:1])
    with pytest.raises(ValueError, match="q has shape"):
        execute(plan, q[:1], k, v)
    with pytest.raises(ValueError, match="num_qo_heads = 3 is not a multiple"):
        dense_attention(np.zeros((2, 3, 64), np.float32), (k, v), b.block_tables, b.seq_lens, 16)


def test_demo_rejects_bad_heads(capsys):
    from pat_core.__main__ import main
    with pytest.raises(SystemExit):
        main(["demo", "--heads", "30:8"])
    assert "--heads 30:8" in capsys.readouterr().err


def test_demo_runs_and_checks_every_packer(capsys):
    from pat_core.__main__ import main
    assert main(["demo", "--tree", "1,3_40,21", "--heads", "8:2", "--head-dim", "64",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for packer in ("query", "pat", "node", "compute", "cascade"):
        assert f"\n{packer} " in out
    assert " NO " not in out


# ----------------------------------------------------------------------------- hand-made BlockTables
def _bt(table, lens, ps=16, num_pages=None):
    table = np.asarray(table)
    lens = np.asarray(lens)
    if num_pages is None:
        num_pages = (lens + ps - 1) // ps
    return BlockTable(table=table, seq_lens=lens, num_pages=np.asarray(num_pages),
                      page_size=ps)


@pytest.mark.parametrize("bt,match", [
    (_bt(np.array([[0, -3]], np.int32), [20]), r"block_tables\[0, 1\] = -3 is a negative"),
    (_bt(np.array([[0, 1], [2, 3]], np.int32), [20, 40]), r"seq_lens\[1\] = 40 needs 3 pages"),
    (_bt(np.array([[0, 1], [2, 3]], np.int32), [20, 20], num_pages=[2, 3]),
     "num_pages disagrees"),
    (_bt(np.array([[0, 2**40]], np.int64), [20]), r"block_tables\[0, 1\] = 1099511627776 does "
                                                  r"not fit in int32"),
    (_bt(np.array([[0, 1]], np.int64), [2**40]), r"seq_lens\[0\] = 1099511627776 exceeds"),
    (_bt(np.array([[0.0, 1.0]]), [20]), "must hold integers"),
])
def test_block_table_object_is_validated(bt, match):
    """A BlockTable built by hand goes through the same checks as the other input forms."""
    with pytest.raises((ValueError, TypeError), match=match):
        PrefixAttentionWrapper("cpu").plan(bt, None, 4, 4, 64, 16)


def test_block_table_object_still_works():
    b = build_tree_batch("1,4_40,23", page_size=16)
    bt = BlockTable.from_padded(b.block_tables, b.seq_lens, 16)
    p1 = PrefixAttentionWrapper("cpu").plan(bt, None, 8, 2, 64, 16)
    p2 = PrefixAttentionWrapper("cpu").plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    p1.validate()
    assert np.array_equal(p1.cta_pages, p2.cta_pages) and p1.stats() == p2.stats()


def test_validate_catches_pages_of_another_request():
    b = build_tree_batch("1,4_40,23", page_size=16)
    plan = PrefixAttentionWrapper("cpu", packer="query").plan(b.block_tables, b.seq_lens,
                                                              8, 2, 64, 16)
    plan.validate()
    # request 0's CTA reads request 1's last (own) page instead of its own
    c = int(np.flatnonzero(plan.cta_req[plan.cta_req_indptr[:-1]] == 0)[-1])
    last = plan.cta_page_indptr[c + 1] - 1
    other = int(b.block_tables[1, (int(b.seq_lens[1]) - 1) // 16])
    assert other != plan.cta_pages[last]
    plan.cta_pages[last] = other
    with pytest.raises(AssertionError, match="not its request's"):
        plan.validate()


def test_negative_page_in_plan_refused_at_run():
    b = build_tree_batch("1,4_40,23", page_size=16)
    w = PrefixAttentionWrapper("cpu")
    plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, kv_data_type="float32")
    k, v = random_kv_cache(b.num_pages, 16, 2, 64)
    q = np.zeros((b.batch_size, 8, 64), np.float32)
    plan.cta_pages[0] = -1
    with pytest.raises(ValueError, match="page ids must be >= 0"):
        w.run(q, (k, v))
    with pytest.raises(AssertionError, match="negative page id"):
        plan.validate()


def test_unsigned_page_ids_keep_their_value():
    t = np.array([[0, 2**64 - 1]], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 18446744073709551615"):
        PrefixAttentionWrapper("cpu").plan(t, [20], 4, 4, 64, 16)
    t = np.array([[0, 2**32]], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"= 4294967296 does not fit in int32 \(the limit"):
        PrefixAttentionWrapper("cpu").plan(t, [20], 4, 4, 64, 16)
    with pytest.raises(ValueError, match=r"indices\[1\] = 18446744073709551615"):
        PrefixAttentionWrapper("cpu").plan_csr([0, 2], np.array([0, 2**64 - 1], np.uint64),
                                               [4], 4, 4, 64, 16)


def test_huge_page_size():
    with pytest.raises(ValueError, match=r"page_size = 1099511627776 exceeds the limit"):
        PrefixAttentionWrapper("cpu").plan(np.array([[0]]), [5], 4, 4, 64, 2**40)


# ----------------------------------------------------------------------------- sizes and types
def test_narrow_numpy_ints_become_python_ints():
    b = build_tree_batch("1,4_40,23", page_size=16)
    args = (64, 8, 256, 16)
    p_int = PrefixAttentionWrapper("cpu").plan(b.block_tables, b.seq_lens, *args)
    p_np = PrefixAttentionWrapper("cpu").plan(b.block_tables, b.seq_lens,
                                              *(np.int16(x) for x in args))
    for f in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
        assert type(getattr(p_np, f)) is int, f
    assert p_np.stats() == p_int.stats()
    assert p_np.stats()["q_bytes"] == p_int.num_slots * 64 * 256 * 2    # no int16 wrap


def test_head_dim_without_a_tile_names_the_limit():
    with pytest.raises(ValueError, match=r"head_dim=1024: .* the limit there is head_dim "
                                         r"4\.\.807 .*backend='cpu'"):
        PrefixAttentionWrapper("cpu").plan(np.array([[0]]), [5], 4, 4, 1024, 16)


def test_nested_lists_refused_clearly():
    w = PrefixAttentionWrapper("cpu")
    w.plan(np.array([[0]]), [5], 4, 4, 64, 16, kv_data_type="float32")
    q = np.zeros((1, 4, 64), np.float32)
    k, v = random_kv_cache(1, 16, 4, 64)
    with pytest.raises(TypeError, match="q must be an array"):
        w.run(q.tolist(), (k, v))
    with pytest.raises(TypeError, match="paged_kv_cache must hold arrays"):
        w.run(q, (k.tolist(), v.tolist()))
    with pytest.raises(TypeError, match="paged_kv_cache must be a"):
        w.run(q, 3.0)


def test_numpy_bfloat16_refused_on_cpu():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = PrefixAttentionWrapper("cpu")
    w.plan(np.array([[0]]), [5], 4, 4, 64, 16, kv_data_type="bfloat16")
    q = np.zeros((1, 4, 64), ml_dtypes.bfloat16)
    k, v = (x.astype(ml_dtypes.bfloat16) for x in random_kv_cache(1, 16, 4, 64))
    with pytest.raises(TypeError, match=r"q is a NumPy bfloat16 .*only as CPU torch tensors"):
        w.run(q, (k, v))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_csr_fast_path_matches_the_checked_one(data):
    """The compiled CSR pass gives the checked NumPy path's table and lengths, and refuses
    exactly what it refuses (the checked path then names the argument): random CSR arrays,
    valid or broken in one place, int32 / int64 / uint32, in either byte order."""
    from pat_core.inputs import _csr_padded_nb, _csr_to_padded_checked, csr_to_padded
    ps = data.draw(st.integers(1, 32))
    B = data.draw(st.integers(1, 6))
    npages = data.draw(st.lists(st.integers(1, 5), min_size=B, max_size=B))
    ip = np.concatenate([[0], np.cumsum(npages)]).astype(np.int64)
    idx = np.array(data.draw(st.lists(st.integers(0, 50), min_size=int(ip[-1]),
                                      max_size=int(ip[-1]) + 3)), dtype=np.int64)
    lpl = np.array(data.draw(st.lists(st.integers(1, ps), min_size=B, max_size=B)),
                   dtype=np.int64)
    broken = data.draw(st.sampled_from(["none", "ip0", "ip_flat", "ip_long", "lpl_len",
                                        "lpl_zero", "lpl_big", "idx_neg", "idx_big", "seq_big",
                                        "empty"]))
    if broken == "ip0":
        ip = ip + 1
    elif broken == "ip_flat" and B > 1:
        ip[1] = ip[0]
    elif broken == "ip_long":
        ip[-1] = idx.shape[0] + 1
    elif broken == "lpl_len":
        lpl = np.append(lpl, 1)
    elif broken == "lpl_zero":
        lpl[-1] = 0
    elif broken == "lpl_big":
        lpl[0] = ps + 1
    elif broken == "idx_neg":
        idx[data.draw(st.integers(0, int(ip[-1]) - 1))] = -2
    elif broken == "idx_big":
        idx[data.draw(st.integers(0, int(ip[-1]) - 1))] = 2**31
    elif broken == "seq_big":
        ps = 2**30
        lpl[:] = 1
        ip = np.array([0, 4], dtype=np.int64)
        idx = np.arange(4, dtype=np.int64)
        lpl = np.array([1], dtype=np.int64)
    elif broken == "empty":
        ip = np.zeros(1, dtype=np.int64)
    dt = data.draw(st.sampled_from([np.int32, np.int64, np.uint32]))
    if dt != np.int64 and (ip.max(initial=0) > 2**31 - 1 or idx.max(initial=0) > 2**31 - 1
                           or min(ip.min(initial=0), idx.min(initial=0)) < 0):
        dt = np.int64                    # the values must survive the cast
    ip, idx, lpl = ip.astype(dt), idx.astype(dt), lpl.astype(dt)
    try:
        want = _csr_to_padded_checked(ip, idx, lpl, ps)
    except ValueError as e:
        want = e
    if ip.dtype.kind == "i":
        table, seq, ok = _csr_padded_nb(ip, idx, lpl, ps)
        assert ok == (not isinstance(want, Exception))
        if ok:
            assert table.dtype == seq.dtype == np.int32
            assert np.array_equal(table, want[0]) and np.array_equal(seq, want[1])
    swapped = [a.astype(a.dtype.newbyteorder()) for a in (ip, idx, lpl)]   # same values
    for args in ((ip, idx, lpl), swapped):
        if isinstance(want, Exception):
            with pytest.raises(ValueError, match=re.escape(str(want))):
                csr_to_padded(*args, ps)
        else:
            got = csr_to_padded(*args, ps)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
