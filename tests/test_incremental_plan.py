"""Incremental planning: a Planner reused over a serving loop makes the plan a fresh Planner
makes of the same step, array for array, whatever changed between steps (requests growing,
taking new pages, leaving, joining, rows moving, pages rewritten)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PACKERS, Planner
from pat_core.executor import execute
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import SERVING_ORDERS, ServingLoop, random_kv_cache
from strategies import head_configs, prefix_batches


def assert_same_plan(a, b):
    assert a.batch_size == b.batch_size and a.serial == b.serial
    for f in a.ARRAY_FIELDS:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def check_step(planner, table, lens, hq, hk, d, ps, packer, run=False):
    """Plan one step with the reused ``planner`` and a fresh one; same arrays; optionally run
    the CPU executor on it against float64 dense attention."""
    kw = dict(kv_data_type="float32")
    inc = planner.plan(table, lens, hq, hk, d, ps, **kw)
    fresh = Planner(packer).plan(table, lens, hq, hk, d, ps, **kw)
    inc.validate()
    assert_same_plan(inc, fresh)
    if run:
        npages = int(table.max()) + 1
        k, v = random_kv_cache(npages, ps, hk, d, np.float32, seed=1)
        q = np.random.default_rng(0).standard_normal((table.shape[0], hq, d)).astype(np.float32)
        ref = dense_attention(q, (k, v), table, lens, ps)
        out = execute(inc, q, k, v)
        assert relative_error(out, ref) <= 1e-5
        assert np.array_equal(out, execute(fresh, q, k, v))
    return inc


@settings(max_examples=60, deadline=None)
@given(requests=st.integers(1, 12), prompts=st.integers(1, 3), prompt_len=st.integers(0, 40),
       lo=st.integers(1, 12), extra=st.integers(0, 30),
       page_size=st.sampled_from((1, 2, 3, 4, 8, 16)), order=st.sampled_from(SERVING_ORDERS),
       seed=st.integers(0, 2**16), steps=st.integers(2, 30), packer=st.sampled_from(PACKERS),
       heads=head_configs())
def test_serving_loop_plans_equal_fresh_plans(requests, prompts, prompt_len, lo, extra,
                                              page_size, order, seed, steps, packer, heads):
    hq, hk = heads
    loop = ServingLoop(requests, prompts, prompt_len, (lo, lo + extra), page_size, seed=seed,
                       order=order)
    planner = Planner(packer)
    for step in range(steps):
        table, lens = loop.step()
        check_step(planner, table, lens, hq, hk, 64, page_size, packer,
                   run=step in (0, steps - 1))


@st.composite
def next_step(draw, b):
    """A random next step of drawn batch ``b``: rows dropped, duplicated or moved, lengths
    grown (into fresh pages), a page rewritten.  Returns ``(table, seq_lens)``."""
    ps = b.page_size
    table = b.block_tables.copy()
    lens = b.seq_lens.astype(np.int64).copy()
    B = table.shape[0]
    rows = list(range(B))
    if B > 1 and draw(st.booleans()):                    # some requests leave
        drop = draw(st.sets(st.integers(0, B - 1), max_size=B - 1))
        rows = [r for r in rows if r not in drop]
    if draw(st.booleans()):                              # some join: copies of others
        rows += draw(st.lists(st.integers(0, B - 1), max_size=3))
    if draw(st.booleans()):
        rows = draw(st.permutations(rows))
    table, lens = table[rows], lens[rows]
    next_page = b.num_pages + 10
    grow = np.array([draw(st.integers(0, 2 * ps)) if draw(st.booleans()) else 0
                     for _ in rows], dtype=np.int64)
    new_lens = lens + grow
    width = max(table.shape[1], int(-(-new_lens.max() // ps)))
    out = np.full((len(rows), width), -1, dtype=np.int32)
    out[:, :table.shape[1]] = table
    for i in range(len(rows)):
        old_np, new_np = -(-int(lens[i]) // ps), -(-int(new_lens[i]) // ps)
        for k in range(old_np, new_np):
            out[i, k] = next_page
            next_page += 1
    if draw(st.booleans()):                              # an engine rewrites one page
        i = draw(st.integers(0, len(rows) - 1))
        k = draw(st.integers(0, -(-int(new_lens[i]) // ps) - 1))
        out[i, k] = draw(st.sampled_from([next_page, int(out[0, 0])]))
    return out, new_lens.astype(np.int32)


@settings(max_examples=80, deadline=None)
@given(prefix_batches(max_requests=10, max_node_pages=2), st.sampled_from(PACKERS),
       st.data())
def test_any_change_between_steps_plans_equal_fresh(b, packer, data):
    planner = Planner(packer)
    check_step(planner, b.block_tables, b.seq_lens, 4, 2, 64, b.page_size, packer)
    table, lens = b.block_tables, b.seq_lens
    for _ in range(data.draw(st.integers(1, 3))):
        cur = type(b)(table, lens, int(max(b.num_pages, table.max() + 1)), b.page_size,
                      b.paths)
        table, lens = data.draw(next_step(cur))
        check_step(planner, table, lens, 4, 2, 64, b.page_size, packer, run=True)


def test_serving_loop_takes_the_incremental_path():
    """A loop of many steps: the reused planner plans most steps without sorting the batch
    again (``last_path``), and every plan equals the fresh one."""
    loop = ServingLoop(24, 2, 70, (5, 60), 4, seed=3)
    planner = Planner("pat")
    paths = []
    for _ in range(120):
        table, lens = loop.step()
        check_step(planner, table, lens, 32, 8, 128, 4, "pat")
        paths.append(planner.last_path)
    assert paths[0] == "full"
    assert paths.count("full") == 1, paths


@pytest.mark.parametrize("order", SERVING_ORDERS)
def test_serving_loop_orders(order):
    loop = ServingLoop(16, 3, 33, (2, 20), 8, seed=5, order=order)
    planner = Planner("pat")
    for step in range(60):
        table, lens = loop.step()
        check_step(planner, table, lens, 8, 2, 64, 8, "pat", run=step % 20 == 0)


def sort_by_byte_keys(bt):
    """The obvious sort (the planner's before the radix sort): each row one big-endian byte
    string of ``page + 1`` (padding 0) and the length, one stable argsort."""
    B, W = bt.table.shape
    keys = np.empty((B, W + 1), dtype=">u4")
    keys[:, :W] = bt.table.astype(np.int64) + 1
    keys[:, W] = bt.seq_lens
    raw = np.ascontiguousarray(keys).view(np.dtype((np.void, 4 * (W + 1)))).ravel()
    return np.argsort(raw, kind="stable").astype(np.int32)


@settings(max_examples=150, deadline=None)
@given(prefix_batches(max_requests=20))
def test_radix_sort_matches_byte_key_sort(b):
    from pat_core.forest import sort_requests
    from pat_core.inputs import as_block_table
    bt = as_block_table(b.block_tables, b.seq_lens, b.page_size)
    assert np.array_equal(sort_requests(bt), sort_by_byte_keys(bt))


def test_radix_sort_ties_and_prefixes():
    from pat_core.forest import sort_requests
    from pat_core.inputs import as_block_table
    table = np.array([[3, 4, 5], [3, 4, 5], [3, 4, -1], [3, 4, 5], [1, 2, 3], [3, 4, 6]],
                     dtype=np.int32)
    bt = as_block_table(table, [40, 33, 20, 40, 45, 48], 16)
    assert sort_requests(bt).tolist() == [4, 2, 1, 0, 3, 5] == sort_by_byte_keys(bt).tolist()


def test_plan_csr_serving_loop_takes_the_incremental_path():
    """An engine hands FlashInfer's CSR form each step (the transformers integration does):
    ``plan_csr`` plans like ``plan`` of the padded table, so a reused wrapper takes the
    incremental path too, and every plan equals a fresh planner's of the same step."""
    from pat_core import PrefixAttentionWrapper
    from pat_core.inputs import BlockTable
    loop = ServingLoop(24, 2, 70, (5, 60), 4, seed=7)
    w = PrefixAttentionWrapper("cpu")
    paths = []
    for _ in range(60):
        table, lens = loop.step()
        csr = BlockTable.from_padded(table, lens, 4).to_csr()
        inc = w.plan_csr(*csr, 32, 8, 128, 4, kv_data_type="float32")
        paths.append(w.planner.last_path)
        fresh = Planner("pat").plan(table, lens, 32, 8, 128, 4, kv_data_type="float32")
        assert_same_plan(inc, fresh)
    assert paths[0] == "full" and paths.count("full") == 1, paths
