"""Batch invariance (``plan(..., batch_invariant=True)``): one request's output and LSE are the
same bits whatever else is in its batch, and correct against the float64 reference.

:func:`strategies.invariant_batches` draws one target request and many batches around it: partners that
share a random part of its prefix (forked at a page boundary, inside a page with a copied
page after, or ending inside its page), identical copies, unrelated requests, at a random
position in the batch.  The KV pool (and so the target's pages and values) and the target's
query row are fixed per example; every batch is planned and run on the CPU executor and the
target's row compared bit for bit with the target run alone.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import Planner, PrefixAttentionWrapper
from pat_core.executor import execute
from pat_core.packers import chunk_packs
from pat_core.forest import PrefixForest
from pat_core.inputs import as_block_table
from pat_core.planner import Tuning
from pat_core.reference import dense_attention, relative_error
from pat_core.split import invariant_chunk
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import POOL, invariant_batches, invariant_table as _table

def _run(rows, q_target, pos, kv, ps, hq, hk, d, dtype, tuning, rng):
    """Plan ``rows`` batch-invariantly and run it; the target's ``(out, lse)`` rows.
    float16 / float32 through the CPU wrapper; bfloat16 (NumPy has none the wrapper takes)
    through the executor on float32 arrays of bfloat16 values, rounding P to bfloat16."""
    table, lens = _table(rows)
    q = _cast(rng.standard_normal((len(rows), hq, d)), dtype)   # the others' rows: random
    q[pos] = q_target
    if dtype == "bfloat16":
        pl = Planner()
        pl.tuning = tuning
        plan = pl.plan(table, lens, hq, hk, d, ps, kv_data_type="float32",
                       batch_invariant=True)
        last = pl.last_path
        out, lse = execute(plan, q, kv[0], kv[1], return_lse=True, input_dtype="bfloat16")
    else:
        w = PrefixAttentionWrapper(backend="cpu")
        w.planner.tuning = tuning
        plan = w.plan(table, lens, hq, hk, d, ps, kv_data_type=dtype, batch_invariant=True)
        last = w.planner.last_path
        out, lse = w.run(q, kv, return_lse=True)
    assert plan.batch_invariant and last == "invariant"
    return out[pos], lse[pos], plan, q, table, lens


def _cast(x, dtype):
    """``x`` in ``dtype``; bfloat16 as float32 arrays holding bfloat16 values."""
    if dtype == "bfloat16":
        import ml_dtypes
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.asarray(x).astype(dtype)


@settings(max_examples=40, deadline=None)
@given(invariant_batches(), st.sampled_from([(4, 1), (8, 2), (2, 2), (16, 2)]),
       st.sampled_from(["float16", "bfloat16", "float32"]), st.sampled_from([16, 32, 48]),
       st.integers(0, 2**31 - 1))
def test_request_bits_do_not_depend_on_batch(drawn, heads, dtype, chunk, seed):
    ps, target, L, batches = drawn
    hq, hk = heads
    d = 64
    k, v = random_kv_cache(POOL, ps, hk, d, seed=seed % 1000)
    kv = (_cast(k, dtype), _cast(v, dtype))
    rng = np.random.default_rng(seed)
    q_target = _cast(rng.standard_normal((hq, d)), dtype)
    tuning = Tuning(invariant_chunk=chunk)    # small chunks: several per request
    alone_out, alone_lse, alone_plan, *_ = _run([(target, L)], q_target, 0, kv, ps, hq, hk, d,
                                                dtype, tuning, rng)
    C = alone_plan.extra["chunk"]
    assert int(np.diff(alone_plan.req_slot_indptr)[0]) == -(-L // C)
    for rows, pos in batches:
        out, lse, plan, q, table, lens = _run(rows, q_target, pos, kv, ps, hq, hk, d, dtype,
                                              tuning, rng)
        assert plan.extra["chunk"] == C and plan.tile_configs.shape[0] == 1
        assert np.array_equal(out.view(np.uint8), alone_out.view(np.uint8))
        assert np.array_equal(lse.view(np.uint8), alone_lse.view(np.uint8))
        # and the whole batch is right: float64 dense attention
        ref = dense_attention(q.astype(np.float32), (kv[0].astype(np.float32),
                              kv[1].astype(np.float32)), table, lens, ps)
        tol = 1e-5 if dtype == "float32" else 2e-2
        full = execute(plan, q, kv[0], kv[1], input_dtype=dtype)
        assert relative_error(full, ref) < tol


def test_default_mode_is_not_invariant_here():
    """The test above has teeth: the default plan of the same target changes its bits
    between batches (its KV is split at batch-dependent node boundaries)."""
    ps, hq, hk, d = 16, 8, 2, 64
    rng = np.random.default_rng(0)
    k, v = random_kv_cache(64, ps, hk, d, seed=3)
    k, v = k.astype(np.float16), v.astype(np.float16)
    target = list(range(8))                                 # 128 tokens
    q_t = rng.standard_normal((hq, d)).astype(np.float16)
    outs = []
    for rows in ([(target, 128)], [(target, 128)] + [(target[:3] + [40 + i], 60) for i in
                                                     range(6)]):
        table, lens = _table(rows)
        q = rng.standard_normal((len(rows), hq, d)).astype(np.float16)
        q[0] = q_t
        for inv in (False, True):
            w = PrefixAttentionWrapper(backend="cpu")
            w.plan(table, lens, hq, hk, d, ps, kv_data_type="float16", batch_invariant=inv)
            outs.append((inv, w.run(q, (k, v))[0]))
    default = [o for inv, o in outs if not inv]
    inv = [o for i, o in outs if i]
    assert not np.array_equal(default[0], default[1])
    assert np.array_equal(inv[0], inv[1])


def test_chunk_packs_cut_forest_at_chunk_boundaries():
    b = build_tree_batch("1,4,16_100,40,300", page_size=4)
    bt = as_block_table(b.block_tables, b.seq_lens, 4)
    packs = chunk_packs(PrefixForest(bt), 64, 2, 16)
    lens = b.seq_lens
    # every pack starts at a chunk start and ends at the chunk end or a request's end
    assert np.all(packs.kv_start % 64 == 0)
    assert np.all((packs.kv_end - packs.kv_start <= 64))
    # each request: ceil(len / 64) packs covering [0, len) in chunk order
    for r in range(len(lens)):
        mine = [p for p in range(packs.num_packs)
                if r in packs.reqs[packs.req_indptr[p]:packs.req_indptr[p + 1]]]
        assert len(mine) == -(-int(lens[r]) // 64)
        assert [int(packs.kv_start[p]) for p in mine] == list(range(0, int(lens[r]), 64))
        assert int(packs.kv_end[mine[-1]]) == int(lens[r])
    # the root's first chunk (100 shared tokens cover [0, 64)) is one pack of 8 requests x 2
    first = [p for p in range(packs.num_packs) if packs.kv_start[p] == 0]
    assert sorted(int(np.diff(packs.req_indptr)[p]) for p in first) == [8, 8]
    # [64, 128) ends inside the second level (at 140 - 100 = 40 in): every 4 leaves share it?
    # no: the root ends at 100, mid-chunk, so each level-2 subtree reads it on its own
    second = [p for p in range(packs.num_packs) if packs.kv_start[p] == 64]
    assert len(second) == 4 and all(np.diff(packs.req_indptr)[p] == 4 for p in second)
    with pytest.raises(ValueError, match="chunk"):
        chunk_packs(PrefixForest(bt), 0, 2, 16)


def test_plan_fixed_tile_chunk_and_merge_layout():
    from pat_core.launch import merge_block_per_pair, merge_heads_per_warp
    b = build_tree_batch("1,16_16384,16", page_size=16)
    p = Planner().plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, batch_invariant=True)
    p.validate()
    assert p.tile_configs.shape[0] == 1 and p.batch_invariant
    C = p.extra["chunk"]
    assert C % 16 == 0 and C % int(p.tile_configs[0, 1]) == 0
    assert np.all(p.cta_kv_start % C == 0)
    assert np.all(np.diff(p.req_slot_indptr) == -(-b.seq_lens // C))
    assert not merge_block_per_pair(p, 132) and merge_heads_per_warp(p, 132) == 1
    d = Planner().plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert merge_block_per_pair(d, 132) and not d.batch_invariant
    # a forced tile is the fixed tile; the chunk is a multiple of its n
    p2 = Planner().plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, batch_invariant=True,
                        tile=(64, 32))
    assert p2.tile_configs.tolist() == [[64, 32]]


def test_invariant_chunk_rounds_up():
    assert invariant_chunk(16, 64, 2048) == 2048
    assert invariant_chunk(3, 64, 100) == 192
    assert invariant_chunk(5, 32, None) % 160 == 0
    with pytest.raises(ValueError, match="invariant_chunk"):
        invariant_chunk(16, 64, 0)
    with pytest.raises(ValueError, match="invariant_chunk"):
        Tuning(invariant_chunk=-1)


def test_refusals():
    b = build_tree_batch("1,4_64,32", page_size=16)
    with pytest.raises(TypeError, match="batch_invariant"):
        Planner().plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant"):
        Planner("query").plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, batch_invariant=True)
    with pytest.raises(ValueError, match="tile"):
        Planner().plan(b.block_tables, b.seq_lens, 64, 2, 64, 16, batch_invariant=True,
                       tile=(16, 64))


def test_always_planned_from_scratch():
    b = build_tree_batch("1,4_64,32", page_size=16)
    pl = Planner()
    a = pl.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, batch_invariant=True)
    c = pl.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16, batch_invariant=True)
    assert pl.last_path == "invariant"
    for f in a.ARRAY_FIELDS:
        assert np.array_equal(getattr(a, f), getattr(c, f))
    pl.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    assert pl.last_path == "full"


def test_simulator_prices_invariant_plans():
    from sim.model import simulate
    b = build_tree_batch("1,8,64_2048,512,128", page_size=16)
    p = Planner().plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, batch_invariant=True)
    r = simulate(p)
    assert r.latency_ns > 0 and r.bytes["kv"] == p.stats()["kv_bytes"]


@pytest.mark.parametrize("bad", [True, 0, 2**31, 2**70, np.uint64(2**63 + 5), 1.5])
def test_invariant_chunk_out_of_range_refused(bad):
    with pytest.raises(ValueError, match="invariant_chunk"):
        Tuning(invariant_chunk=bad)
