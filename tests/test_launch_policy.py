"""The launch policy (pat_core.launch) that the CUDA backend and the simulator share."""
import numpy as np
import pytest

from pat_core import Planner, Tuning
from pat_core.launch import fused_ctas_per_sm, merge_block_per_pair, use_fused_launch
from pat_core.workloads import build_tree_batch
from sim.model import prepare


def _plan(spec, packer="pat", heads=(32, 8), tuning=None):
    b = build_tree_batch(spec, page_size=16)
    return Planner(packer, "h100", tuning).plan(b.block_tables, b.seq_lens, heads[0], heads[1],
                                                128, 16)


def test_auto_fuses_small_short_multi_variant_plans_only():
    small = _plan("1,16_2048,128")                 # 2 variants, 192 blocks, CTAs <= 256 tokens
    assert len(set(small.group_tile.tolist())) >= 2
    assert use_fused_launch(small, 132)
    assert not use_fused_launch(small, 132, "streams") and use_fused_launch(small, 132, "fused")
    assert not use_fused_launch(small, 132, max_kv_len=int(small.cta_kv_len.max()) - 1)
    assert not use_fused_launch(small, 132, max_blocks_per_sm=1)     # 192 blocks > 132
    assert not use_fused_launch(_plan("1,16_2048,128", "cascade"), 132)   # serial: in order
    assert not use_fused_launch(_plan("16_512"), 132)                 # one variant
    with pytest.raises(ValueError, match="launch_mode"):
        use_fused_launch(small, 132, "fast")


def test_auto_never_fuses_past_one_resident_wave():
    """1,16_16384,16 at 32:8 split at share 2 (the default before round 17's one-wave share
    for many-row packs): 384 blocks (256 of 64x64, 128 of 16x16) fit 4 per SM, but the fused
    block is the 64x64 block, two resident per SM: fusing would run two waves."""
    plan = _plan("1,16_16384,16", tuning=Tuning(split_share=2.0))
    blocks = plan.num_ctas * plan.num_kv_heads
    assert blocks <= 4 * 132 and int(plan.cta_kv_len.max()) <= 2048
    per_sm = fused_ctas_per_sm(plan)
    assert 1 <= per_sm < 4 and blocks > per_sm * 132
    assert not use_fused_launch(plan, 132)
    assert use_fused_launch(plan, 132, max_blocks_per_sm=4) is False
    assert use_fused_launch(plan, -(-blocks // per_sm))      # enough SMs for one wave: fused
    assert fused_ctas_per_sm(_plan("1,16_2048,128")) >= 1


def test_merge_block_per_pair_only_for_few_pairs_with_many_slots():
    few_many = _plan("1,16_16384,16")          # 16 requests x 32 heads, 33 slots each
    assert few_many.num_slots / few_many.batch_size >= 4
    assert merge_block_per_pair(few_many, 132)
    assert not merge_block_per_pair(few_many, 16 * 32 // 8 - 1)   # too many pairs per SM
    one_slot = _plan("64_512")                  # no sharing: one slot per request
    assert not merge_block_per_pair(one_slot, 132)


def test_simulator_models_the_fused_launch():
    plan = _plan("1,16_2048,128")
    fused, streams = prepare(plan), prepare(plan, launch_mode="streams")
    assert [ln.kind for ln in fused.launches] == ["forward", "merge"]
    assert len(streams.launches) == plan.num_groups + 1
    T = plan.tile_configs.shape[0]
    fwd = fused.blk_cfg[fused.blk_launch == 0]
    assert np.all(fwd == T + 1)                     # every forward block: the fused config
    # the fused block takes the largest variant's shared memory (and threads, registers)
    assert fused.need[T + 1, 0] == max(streams.need[k, 0] for k in set(plan.group_tile.tolist()))
    assert np.array_equal(np.sort(fused.blk_bytes), np.sort(streams.blk_bytes))


def test_one_tile_split_takes_the_one_tile_tail_of_16_row_groups():
    """one_tile_split: "off" never splits; "split" and "piped" split off exactly the CTAs after
    a 16-row group's last CTA longer than n (a group is ordered longest first), only for the
    n with a one-tile or piped layout; "piped-all" takes whole eligible groups; the piped grid
    never exceeds the items or the resident blocks; an unknown mode names the setting."""
    from pat_core import cuda_compile as cc
    from pat_core.launch import one_tile_split, piped_blocks_per_sm
    plan = _plan("1,8,64,512_128,512,64,32", heads=(32, 32))
    hk = plan.num_kv_heads
    checked = 0
    for _, (m, n), b, e in plan.groups():
        assert one_tile_split(plan, b, e, 132, "off") == (e, None, 0)
        lens = plan.cta_kv_len[b:e]
        assert (np.diff(lens) <= 0).all(), "a launch group is ordered longest first"
        s, kind, grid = one_tile_split(plan, b, e, 132, "split")
        if m == 16 and (m, n) in cc.ONE_TILE_LAYOUTS and (lens <= n).any():
            assert kind == "one-tile" and (lens[s - b:] <= n).all() and (lens[:s - b] > n).all()
            assert grid == (e - s) * hk
            checked += 1
        else:
            assert (s, kind) == (e, None)
        s, kind, grid = one_tile_split(plan, b, e, 132, "piped")
        if m == 16 and n in cc.PIPED_LAYOUTS and (lens <= n).any():
            assert kind == "piped" and (lens[s - b:] <= n).all() and (lens[:s - b] > n).all()
            assert grid == min((e - s) * hk, piped_blocks_per_sm(plan, n) * 132)
            s_all, _, _ = one_tile_split(plan, b, e, 132, "piped-all")
            assert s_all == b
        else:
            assert (s, kind) == (e, None)
    assert checked == 1     # the 16x32 group: 512 leaves of 32 tokens after 64 nodes of 64
    with pytest.raises(ValueError, match="one_tile"):
        one_tile_split(plan, 0, plan.num_ctas, 132, "sometimes")


def test_forward_chain_rule_and_order():
    """Chained forward launches (pat_core.launch.forward_chained): two or more live groups, not
    serial, not fused, no finisher phase, sm_90+; longest CTA first, then more rows."""
    from pat_core.launch import chain_order, forward_chained, group_spans
    plan = _plan("1,4,64_256,1024,64")              # 64x64 shared levels, 16x32 leaves
    assert sum(1 for _, _, b, e in plan.groups() if e > b) >= 2 and plan.finish_from < 0
    assert forward_chained(plan, "h100") and forward_chained(plan, "h100", "pdl-plan")
    assert not forward_chained(plan, "h100", "fork")
    assert not forward_chained(plan, "h100", fused=True)
    assert not forward_chained(plan, "h100", serial=True)
    assert not forward_chained(plan, "a100")         # no programmatic dependent launch
    assert not forward_chained(_plan("16_512"), "h100")   # one group
    with pytest.raises(ValueError, match="fwd_chain"):
        forward_chained(plan, "h100", "streams")
    spans = group_spans(plan)
    order = chain_order(spans)
    assert sorted(order) == list(range(len(spans)))
    got = [spans[i] for i in order]
    assert got == sorted(spans, key=lambda s: (-s[0], -s[1]))
    assert chain_order([(64, 16), (1024, 64), (1024, 128), (64, 16)]) == [2, 1, 0, 3]


def test_simulator_models_the_chain():
    """The simulator lays chained launches out in the backend's order, each gated on the one
    before it without holding: no block of a launch starts before every block of the one
    before it has, blocks of a later launch may end first, and the merge follows them all."""
    from pat_core.launch import chain_order, group_spans
    from sim.constants import load_constants
    from sim.model import run_timeline
    plan = _plan("1,2,8,128_512,128,256,32", heads=(32, 32))
    wl = prepare(plan, "h100")
    fwd = [ln for ln in wl.launches if ln.kind == "forward"]
    live = [g for g in plan.groups() if g[3] > g[2]]
    assert len(fwd) == len(list(plan.groups())) and len(live) >= 3
    groups = list(plan.groups())
    want = [groups[i][1] for i in chain_order(group_spans(plan))]
    assert [tuple(int(x) for x in ln.name.split()[1].split("x")) for ln in fwd] == want
    assert fwd[0].gate == -1 and all(ln.gate == i and not ln.hold
                                     for i, ln in enumerate(fwd[1:]))
    tl = run_timeline(wl, load_constants("h100"))
    first_end = None
    for i in range(1, len(fwd)):
        a, b = fwd[i - 1], fwd[i]
        if a.end > a.begin and b.end > b.begin:
            assert tl.block_start[b.begin:b.end].min() >= tl.block_start[a.begin:a.end].max()
            first_end = first_end or (tl.block_end[b.begin:b.end].min()
                                      < tl.block_end[a.begin:a.end].max())
    assert first_end, "no chained block ended before the launch before it (held?)"
    mrg = tl.blocks_of("merge")
    assert tl.block_start[mrg].min() >= tl.block_end[~mrg].max()
    forked = prepare(plan, "h100", fwd_chain="fork")
    assert all(ln.gate == -1 for ln in forked.launches)
