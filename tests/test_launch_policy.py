"""The launch policy (pat_core.launch) that the CUDA backend and the simulator share."""
import numpy as np
import pytest

from pat_core import Planner
from pat_core.launch import use_fused_launch
from pat_core.workloads import build_tree_batch
from sim.model import prepare


def _plan(spec, packer="pat", heads=(32, 8)):
    b = build_tree_batch(spec, page_size=16)
    return Planner(packer, "h100").plan(b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16)


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
