"""Lazy update: identical re-plans are reused, length-only decode steps keep the packing."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pat_core import PACKERS, Planner, PrefixAttentionWrapper
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import prefix_batches


def test_identical_replan_returns_same_plan():
    b = build_tree_batch("1,4,16_128,256,100", page_size=16)
    p = Planner("pat")
    a = p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert p.last_path == "full"
    c = p.plan(b.block_tables.copy(), b.seq_lens.copy(), 32, 8, 128, 16)
    assert c is a and p.last_path == "reuse"
    d = p.plan(b.block_tables, b.seq_lens, 32, 4, 128, 16)     # other heads: new plan
    assert d is not a and p.last_path == "full"


def test_decode_step_updates_lengths_only():
    b = build_tree_batch("1,4,16_128,256,100", page_size=16)   # 100 = 6 pages + 4 tokens
    p = Planner("pat")
    first = p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    lens = b.seq_lens.copy()
    for step in range(12):                                     # 484 tokens: 12 free slots in page 31
        lens = lens + 1
        plan = p.plan(b.block_tables, lens, 32, 8, 128, 16)
        assert p.last_path == "lengths", step
        fresh = Planner("pat").plan(b.block_tables, lens, 32, 8, 128, 16)
        assert plan.stats() == fresh.stats()
        assert plan.version == first.version + step + 1
        plan.validate()
        assert all(np.all(c == 1) for c in plan.coverage_counts())
    with pytest.raises(ValueError, match="needs 32 pages"):    # the next token needs a new page
        p.plan(b.block_tables, lens + 1, 32, 8, 128, 16)


@pytest.mark.parametrize("spec", ["1,8_64,385", "1,16_64,593"])
def test_length_update_rechecks_the_narrow_packing(spec):
    """The narrow-packing choice depends on the leaves' lengths (its 2% is a share of all KV
    read): a length update that flips it packs again, so every step equals a fresh plan."""
    b = build_tree_batch(spec, page_size=16)
    p = Planner("pat")
    p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    lens = b.seq_lens.copy()
    paths = []
    for _ in range(15):
        lens = lens + 1
        plan = p.plan(b.block_tables, lens, 32, 8, 128, 16)
        paths.append(p.last_path)
        fresh = Planner("pat").plan(b.block_tables, lens, 32, 8, 128, 16)
        assert plan.stats() == fresh.stats()
    # the choice flipped once (the kept forest is packed again: "rows"), then held
    assert "rows" in paths and "lengths" in paths and "full" not in paths


def test_growth_of_a_shared_last_token_replans():
    table = np.array([[0, 1], [0, 1], [0, 2]], dtype=np.int32)
    p = Planner("pat")
    p.plan(table, [20, 20, 20], 4, 4, 64, 16)
    p.plan(table, [21, 20, 20], 4, 4, 64, 16)     # request 0 leaves the identical pair
    assert p.last_path == "rows"                  # its row is placed again: the forest changes
    p.plan(table, [21, 20, 21], 4, 4, 64, 16)     # request 2 alone in its last page
    assert p.last_path == "lengths"


@given(prefix_batches(max_requests=8, max_node_pages=2), st.sampled_from(PACKERS), st.data())
def test_any_length_update_matches_fresh_plan(b, packer, data):
    """Whatever path plan() takes after lengths change, the result is correct."""
    p = Planner(packer)
    p.plan(b.block_tables, b.seq_lens, 4, 2, 64, b.page_size, kv_data_type="float32")
    room = (-(-b.seq_lens // b.page_size)) * b.page_size - b.seq_lens
    grow = np.array([data.draw(st.integers(0, int(x))) for x in room], dtype=np.int32)
    lens = b.seq_lens + grow
    plan = p.plan(b.block_tables, lens, 4, 2, 64, b.page_size, kv_data_type="float32")
    plan.validate()
    assert all(np.all(c == 1) for c in plan.coverage_counts())
    k, v = random_kv_cache(b.num_pages, b.page_size, 2, 64, np.float32, seed=1)
    q = np.random.default_rng(0).standard_normal((b.batch_size, 4, 64)).astype(np.float32)
    from pat_core.executor import execute
    ref = dense_attention(q, (k, v), b.block_tables, lens, b.page_size)
    assert relative_error(execute(plan, q, k, v), ref) <= 1e-5
