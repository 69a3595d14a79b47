"""The one launch path (pat_core.launch) that the CUDA backend runs and the simulator lays out."""
import numpy as np

from pat_core import Planner, get_gpu
from pat_core.launch import (dependent_launch_ok, forward_launches, launch_grid,
                             merge_block_per_pair, merge_heads_per_warp, merge_needed)
from pat_core.static_plan import order_tiles
from pat_core.workloads import build_tree_batch
from sim.model import prepare
from sim.occupancy import plan_occupancy


def _plan(spec, packer="pat", heads=(32, 8), tuning=None):
    b = build_tree_batch(spec, page_size=16)
    return Planner(packer, "h100", tuning).plan(b.block_tables, b.seq_lens, heads[0], heads[1],
                                                128, 16)


def test_forward_launches_tallest_tile_first_each_ctas_in_plan_order():
    """One launch per tile with CTAs, in launch-set order (order_tiles: m, then n, descending),
    whatever the plan's group order; a launch's CTAs are the tile's, in plan order; every CTA
    in exactly one launch."""
    for spec, packer, heads in (("1,4,64_256,1024,64", "pat", (32, 8)),
                                ("1,2,8,128_512,128,256,32", "pat", (32, 32)),
                                ("1,2,8,128_512,128,256,32", "cascade", (32, 32)),
                                ("1,16_2048,128", "node", (32, 8))):
        plan = _plan(spec, packer, heads)
        fl = forward_launches(plan)
        tiles = [mn for _, mn, _ in fl]
        assert tiles == list(order_tiles(tiles)) and len(set(tiles)) == len(tiles)
        assert tiles == sorted(tiles, key=lambda t: (-t[0], -t[1]))
        seen = np.concatenate([ctas for _, _, ctas in fl])
        assert np.array_equal(np.sort(seen), np.arange(plan.num_ctas))
        for k, (m, n), ctas in fl:
            assert tuple(plan.tile_configs[k]) == (m, n)
            assert np.all(plan.cta_tile[ctas] == k) and np.all(np.diff(ctas) > 0)
    # a plan whose groups the planner ordered shortest tile first still launches tallest first
    plan = _plan("1,4,64_256,1024,64")
    assert len(forward_launches(plan)) >= 2
    assert forward_launches(plan)[0][1][0] == int(plan.tile_configs[:, 0].max())


def test_dependent_launch_from_sm_90():
    assert dependent_launch_ok("h100") and dependent_launch_ok("h200")
    assert not dependent_launch_ok("a100")


def test_grid_and_merge_rule():
    """A launch's grid: its resident blocks, capped at its items.  The merge runs where some
    request has several slots, or a block draws a second item (it resets the counters)."""
    assert launch_grid(10, 3, 132) == 10 and launch_grid(1000, 3, 132) == 396
    assert launch_grid(0, 3, 132) == 1 and launch_grid(5, 0, 2) == 2
    shared = _plan("1,16_2048,128")
    assert shared.num_slots > shared.batch_size
    assert merge_needed(shared, [1 << 20] * shared.tile_configs.shape[0], 132)
    small = _plan("16_100")                       # one slot each, 128 items
    assert small.num_slots == small.batch_size
    per_sm = [o.ctas_per_sm for o in plan_occupancy(small, get_gpu("h100"))]
    items = small.num_ctas * small.num_kv_heads
    assert items <= per_sm[0] * 132 and not merge_needed(small, per_sm, 132)
    assert merge_needed(small, [1], items // 2)          # too few resident blocks: draws


def test_merge_block_per_pair_only_for_few_pairs_with_many_slots():
    few_many = _plan("1,16_16384,16")          # 16 requests x 32 heads, 33 slots each
    assert few_many.num_slots / few_many.batch_size >= 4
    assert merge_block_per_pair(few_many, 132)
    assert not merge_block_per_pair(few_many, 16 * 32 // 8 - 1)   # too many pairs per SM
    one_slot = _plan("64_512")                  # no sharing: one slot per request
    assert not merge_block_per_pair(one_slot, 132)
    big = _plan("1,1024_1024,16")               # 32768 pairs: several warp waves
    assert merge_heads_per_warp(big, 132) == 4 and merge_heads_per_warp(few_many, 132) == 1


def test_simulator_lays_out_the_launch_path():
    """The simulator's launches are forward_launches' in order, each after the first gated on
    the one before it (sm_90), then the merge: no block of a launch starts before every block
    of the one before it has, blocks of a later launch may end first, and the merge follows
    them all."""
    from sim.constants import load_constants
    from sim.model import run_timeline
    plan = _plan("1,2,8,128_512,128,256,32", heads=(32, 32))
    wl = prepare(plan, "h100")
    fwd = [ln for ln in wl.launches if ln.kind == "forward"]
    want = forward_launches(plan)
    assert len(fwd) == len(want) >= 3
    assert [ln.config for ln in fwd] == [k for k, _, _ in want]
    assert [ln.name for ln in fwd] == [f"forward {m}x{n}" for _, (m, n), _ in want]
    for ln, (_, _, ctas) in zip(fwd, want):     # items in plan order, a CTA's heads adjacent
        assert np.array_equal(wl.blk_cta[ln.begin:ln.end], np.repeat(ctas, plan.num_kv_heads))
        assert np.array_equal(wl.blk_head[ln.begin:ln.end],
                              np.tile(np.arange(plan.num_kv_heads), ctas.shape[0]))
    assert fwd[0].gate == -1 and all(ln.gate == i for i, ln in enumerate(fwd[1:]))
    assert {ln.phase for ln in fwd} == {0}
    tl = run_timeline(wl, load_constants("h100"))
    first_end = None
    for a, b in zip(fwd, fwd[1:]):
        assert tl.block_start[b.begin:b.end].min() >= tl.block_start[a.begin:a.end].max()
        first_end = first_end or (tl.block_end[b.begin:b.end].min()
                                  < tl.block_end[a.begin:a.end].max())
    assert first_end, "no chained block ended before the launch before it"
    mrg = tl.blocks_of("merge")
    assert tl.block_start[mrg].min() >= tl.block_end[~mrg].max()


def test_simulator_merge_launch_only_where_the_backend_runs_it():
    """No merge launch where every request has one slot and no block draws a second item; a
    merge that only resets the counters (blocks moving nothing) where blocks draw; merge blocks
    only for the requests of several slots otherwise."""
    small = _plan("16_100")
    assert [ln.kind for ln in prepare(small, "h100").launches] == ["forward"]
    many = _plan("512_100")                          # one slot each, more items than blocks
    assert many.num_slots == many.batch_size
    wl = prepare(many, "h100")
    assert [ln.kind for ln in wl.launches] == ["forward", "merge"]
    mrg = wl.blk_launch == 1
    assert wl.blk_bytes[mrg].sum() == 0 and wl.blk_slots[mrg].sum() == 0
    shared = _plan("1,16_2048,128")
    wl = prepare(shared, "h100")
    mrg = wl.blk_launch == len(wl.launches) - 1
    multi = int(np.count_nonzero(np.diff(shared.req_slot_indptr) > 1))
    assert wl.launches[-1].kind == "merge"
    assert int(mrg.sum()) == -(-multi * shared.num_qo_heads // 4)
