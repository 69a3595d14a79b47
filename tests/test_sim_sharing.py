"""How the simulator's timeline shares the GPU between thread blocks (CPU only): bandwidth in
proportion to each block's loads in flight, the two shared-memory classes of forward kernels
that never share an SM, and L2 hits that queue behind DRAM misses when DRAM is the bottleneck.
Each rule was measured block by block on the GPU (bench/lab/block_timeline.py, bench/NOTES.md
round 24)."""
from __future__ import annotations

import numpy as np
import pytest

from pat_core.workloads import build_tree_batch
from sim.methods import make_plan
from sim.model import WEIGHT_BYTES, prepare
from sim.occupancy import SMEM_OPT_IN_BYTES, smem_class
from sim.timeline import run_engine

CAP = np.array([1 << 20, 1 << 16, 2048, 8])
NEED = np.array([[0, 32, 32, 1], [0, 32, 32, 1]])


def _two_blocks(**kw):
    """Two blocks of 3000 bytes in one launch on two SMs, no latency or compute; DRAM 1 byte/ns
    for both together, an SM up to 100 bytes/ns."""
    return run_engine(2, CAP, NEED[:1], np.zeros(2, np.int32), np.zeros(2), np.full(2, 3000.0),
                      np.zeros(2), np.array([0, 2]), np.zeros(1), np.zeros(1, np.int32), 1, 0.0,
                      100.0, 1.0, **kw)


def test_bandwidth_follows_the_loads_in_flight():
    # equal weights: 0.5 byte/ns each, both end at 6000 ns
    _, _, _, end, _, _ = _two_blocks()
    assert list(end) == pytest.approx([6000.0, 6000.0])
    # weights 1 and 3: 0.25 and 0.75 byte/ns; the heavy block ends at 4000 ns having moved its
    # 3000 bytes, the light one has moved 1000 and moves the other 2000 alone at 1 byte/ns
    _, _, _, end, _, _ = _two_blocks(blk_weight=np.array([1.0, 3.0]))
    assert list(end) == pytest.approx([6000.0, 4000.0])
    # scaling every weight changes nothing
    _, _, _, end, _, _ = _two_blocks(blk_weight=np.array([2.0, 6.0]))
    assert list(end) == pytest.approx([6000.0, 4000.0])
    for bad in (np.array([1.0, 0.0]), np.array([1.0]), np.array([1.0, -2.0])):
        with pytest.raises(ValueError, match="blk_weight"):
            _two_blocks(blk_weight=bad)


def test_blocks_of_the_two_smem_classes_never_share_an_sm():
    # one SM with room for all; launch 0: a class-1 block of 1000 ns; launch 1: a class-0 block
    # of 10 ns, both issued at 0.  Without classes both start at once; with them the class-0
    # block waits for the SM to be free of class-1 blocks; a class -1 config (the merge)
    # joins either
    args = (1, CAP, NEED, np.array([0, 1], np.int32), np.array([1000.0, 10.0]), np.zeros(2),
            np.zeros(2), np.array([0, 1, 2]), np.zeros(2), np.zeros(2, np.int32), 1, 0.0, 10.0,
            10.0)
    start = run_engine(*args)[2]
    assert list(start) == pytest.approx([0.0, 0.0])
    start = run_engine(*args, cfg_class=np.array([1, 0]))[2]
    assert list(start) == pytest.approx([0.0, 1000.0])
    start = run_engine(*args, cfg_class=np.array([1, -1]))[2]
    assert list(start) == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="cfg_class"):
        run_engine(*args, cfg_class=np.array([1, 2]))


def test_l2_hits_queue_behind_dram_misses_when_dram_is_the_bottleneck():
    # two SMs; block 0 reads 3000 bytes from DRAM (1 byte/ns for the GPU), block 1 reads 3000
    # bytes of L2 hits (L2 unbounded, an SM up to 100 bytes/ns).  Hits apart: block 1 is done
    # at 30 ns.  Hits queued: while DRAM is saturated every block moves at DRAM's level, so
    # block 1 takes as long as block 0 would alone, 3000 ns.
    args = (2, CAP, NEED[:1], np.zeros(2, np.int32), np.zeros(2), np.full(2, 3000.0),
            np.zeros(2), np.array([0, 2]), np.zeros(1), np.zeros(1, np.int32), 1, 0.0, 100.0,
            1.0)
    kw = dict(blk_l2=np.array([0.0, 3000.0]), blk_lead=np.array([0.0, 3000.0]), l2_bw=1e9)
    end = run_engine(*args, **kw)[3]
    assert list(end) == pytest.approx([3000.0, 30.0])
    end = run_engine(*args, **kw, hits_queue=True)[3]
    assert list(end) == pytest.approx([3000.0, 3000.0])


def test_prepare_weights_blocks_by_their_pipeline_and_classes_configs_by_smem():
    # a deep tree of 32-token nodes at 16:8: one-warp one-stage 16x32 leaves of one tile (a
    # quarter of a 16x64 block's two stages of 64 tokens) beside 16x64 blocks of several tiles
    b = build_tree_batch("1,2,4,8,16,32,64,128_32,32,32,32,32,32,32,32", page_size=16, seed=0)
    plan = make_plan(b, "pat", 16, 8, 128, gpu="h100")
    wl = prepare(plan, "h100")
    nf = int((wl.blk_tiles > 0).sum())
    tiles = [tuple(t) for t in plan.tile_configs.tolist()]
    assert set(tiles) == {(16, 32), (16, 64)}
    for k, (m, n) in enumerate(tiles):
        sel = wl.blk_cfg[:nf] == k
        stages, t = wl.blk_stages[:nf][sel], wl.blk_tiles[:nf][sel]
        want = np.minimum(stages, t) * n * 2 * 128 * 2 / WEIGHT_BYTES
        assert np.allclose(wl.blk_weight[:nf][sel], want)
        assert wl.cfg_class[k] == smem_class(int(wl.need[k, 0]))
    assert np.all(wl.blk_weight[nf:] == 1.0)                  # the merge's blocks
    assert wl.cfg_class[tiles.index((16, 32))] == 0           # 20 KB: no opt-in
    assert wl.cfg_class[tiles.index((16, 64))] == 1           # 68 KB
    assert wl.cfg_class[len(tiles)] == -1                     # the merge joins either
    assert smem_class(SMEM_OPT_IN_BYTES) == 0 and smem_class(SMEM_OPT_IN_BYTES + 1) == 1
