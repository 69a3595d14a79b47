"""A forward block's latency chain (``tile_lat_ns``): a block of ``w`` warps with ``t`` KV tiles
cannot end before ``block_ns + t * tile_lat_ns / w`` (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.constants import load_constants
from sim.methods import load_batch, make_plan
from sim.model import block_costs, predict, prepare, run_timeline

# 32-token nodes at heads 16:8: pat packs one wave of short CTAs into 16x32 blocks (two warps,
# two stages), query into four-warp 16x64 blocks of three tiles.
TINY = "1,2,4,8,16,32_32,32,32,32,32,32"


def _wl(method, spec=TINY, hq=16, hk=8):
    return prepare(make_plan(load_batch(spec, 16), method, hq, hk, 128, gpu="h100"), "h100")


def test_workload_knows_each_blocks_warps_and_stages():
    """Each forward block carries its own variant's warps and stages (the layout the CUDA
    backend compiles, pat_core.cuda_compile.FwdVariant.make); merge blocks carry none."""
    from pat_core.cuda_compile import FwdVariant
    pat, query = _wl("pat"), _wl("query")
    for wl, (m, n) in ((pat, (16, 32)), (query, (16, 64))):
        fwd = wl.blk_tiles > 0
        v = FwdVariant.make(m, n, 128, "float16", arch="sm_90")
        assert fwd.any() and {tuple(ln.name.split()[1].split("x")) for ln in wl.launches
                              if ln.kind == "forward"} == {(str(m), str(n))}
        assert np.all(wl.blk_warps[fwd] == v.warps) and np.all(wl.blk_stages[fwd] == v.stages)
        assert np.all(wl.blk_warps[~fwd] == 0)                # merge blocks: no chain
    assert pat.blk_warps[pat.blk_tiles > 0][0] < query.blk_warps[query.blk_tiles > 0][0]


def test_one_wave_of_one_warp_blocks_is_no_faster_than_its_chain():
    wl = _wl("pat")
    c = load_constants("h100").with_values(tile_lat_ns=4000.0)
    tl = run_timeline(wl, c)
    fwd = tl.blocks_of("forward")
    assert fwd.sum() <= wl.gpu.num_sms * 11                 # one wave: every block resident at once
    dur = (tl.block_end - tl.block_start)[fwd]
    chain = c.block_ns + wl.blk_tiles[fwd] * c.tile_lat_ns / wl.blk_warps[fwd]
    assert np.all(dur >= chain * (1 - 1e-9))
    # the longest chain sets the forward kernel's span, however little the blocks move
    span = float(np.nanmax(tl.block_end[fwd]) - np.nanmin(tl.block_start[fwd]))
    assert span >= float(chain.max()) * (1 - 1e-9)
    assert span > float(np.nanmax(run_timeline(wl, c.with_values(tile_lat_ns=0.0)).block_end[fwd]
                              - np.nanmin(tl.block_start[fwd])))


def test_chain_divides_by_warps():
    """The same tile latency costs a four-warp block a quarter of what it costs one warp."""
    c = load_constants("h100").with_values(tile_lat_ns=4000.0, tile_ns=0.0, sm_flops=1e12)
    for wl in (_wl("pat"), _wl("query")):
        lat, comp = block_costs(wl, c)
        fwd = wl.blk_tiles > 0
        assert np.allclose(comp[fwd], wl.blk_tiles[fwd] * 4000.0 / wl.blk_warps[fwd])
        assert np.all(lat == c.block_ns)
        assert np.all(comp[~fwd] == block_costs(wl, c.with_values(tile_lat_ns=0.0))[1][~fwd])


@pytest.mark.parametrize("method", ["pat", "query"])
def test_zero_tile_latency_predicts_as_before(method):
    wl = _wl(method)
    c = load_constants("h100").with_values(tile_lat_ns=0.0)
    lat, comp = block_costs(wl, c)
    assert np.all(lat == c.block_ns)
    assert np.allclose(comp, wl.blk_tiles * c.tile_ns + wl.blk_flops / c.sm_flops
                       + wl.blk_slots * c.merge_slot_ns)


def test_long_bandwidth_bound_blocks_do_not_feel_a_short_chain():
    """Blocks that stream longer than their chain keep their bandwidth time."""
    wl = _wl("query", "64_4096", 32, 8)
    c = load_constants("h100")
    base = predict(wl, c.with_values(tile_lat_ns=0.0))
    assert predict(wl, c.with_values(tile_lat_ns=100.0)) == pytest.approx(base, rel=1e-9)


def test_packaged_constants_keep_the_chain_off():
    """Round 14's refit with the chain met no missed target: it is fitted only on request."""
    from sim.calibration import CHAIN_FIT, DEFAULT_FIT
    for gpu in ("a100", "h100", "h200"):
        assert load_constants(gpu).tile_lat_ns == 0.0
    assert CHAIN_FIT == ("tile_lat_ns",) and "tile_lat_ns" not in DEFAULT_FIT


def test_fit_command_fits_the_chain_when_asked(tmp_path, capsys):
    import json

    from sim.cli import main
    from test_sim_calibration import _synthetic
    path, _, _ = _synthetic(tmp_path)
    for flag, fitted in (([], False), (["--latency-chain"], True)):
        out = tmp_path / f"c{len(flag)}.json"
        assert main(["fit", "--measurements", path, "--out", str(out), "--max-evals", "30",
                     "--validation", "32_300;2,16_1024,32", *flag]) == 0
        capsys.readouterr()
        saved = json.loads(out.read_text())
        assert ("tile_lat_ns" in saved["fit"]["fitted"]) == fitted
        assert (saved["constants"]["tile_lat_ns"] > 0) == fitted
