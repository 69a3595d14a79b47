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
