"""The warpgroup tiles' own tensor-core rate (``wg_flops``): on Hopper the 64- and 128-row
tiles run on ``wgmma``, the others on ``mma.sync``; with ``wg_flops`` set the model prices the
first at that rate and the second at ``sm_flops`` (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest

from pat_core import cuda_compile as cc
from sim.constants import load_constants
from sim.methods import load_batch, make_plan
from sim.model import block_costs, predict, prepare

# 128 requests under one 1024-token root at 32:8: 512 rows per KV head, so the root's CTAs are
# 128-row warpgroup tiles; the leaves are 16-row mma.sync tiles
SPEC = "1,128_1024,32"


def _wl(gpu="h100", spec=SPEC, hq=32, hk=8):
    return prepare(make_plan(load_batch(spec, 16), "pat", hq, hk, 128, gpu=gpu), gpu)


def test_workload_marks_the_warpgroup_blocks():
    wl = _wl()
    tiles = {tuple(int(x) for x in ln.name.split()[1].split("x"))
             for ln in wl.launches if ln.kind == "forward" and ln.end > ln.begin}
    assert any(m >= 64 for m, _ in tiles) and any(m == 16 for m, _ in tiles), tiles
    fwd = wl.blk_tiles > 0
    assert wl.blk_wg[fwd].any() and not wl.blk_wg[fwd].all()
    assert not wl.blk_wg[~fwd].any()                       # merge blocks
    # the mark is the kernel's own layout choice on this GPU
    for ln in wl.launches:
        if ln.kind != "forward" or ln.end <= ln.begin:
            continue
        m, n = (int(x) for x in ln.name.split()[1].split("x"))
        want = cc.FwdVariant.make(m, n, 128, "float16", arch="sm_90").warpgroup
        assert np.all(wl.blk_wg[ln.begin:ln.end] == want)
    # no warpgroup tiles before Hopper
    a100 = _wl("a100")
    assert not a100.blk_wg.any()


def test_wg_flops_prices_only_the_warpgroup_blocks():
    wl = _wl()
    c = load_constants("h100").with_values(wg_flops=0.0)
    _, base = block_costs(wl, c)
    _, fast = block_costs(wl, c.with_values(wg_flops=4.0 * c.sm_flops))
    wg = wl.blk_wg
    assert np.allclose(fast[~wg], base[~wg])
    flop_time = wl.blk_flops[wg] / c.sm_flops
    assert np.allclose(base[wg] - fast[wg], flop_time * 0.75)
    assert predict(wl, c.with_values(wg_flops=4.0 * c.sm_flops)) < predict(wl, c)


def test_zero_wg_flops_predicts_as_sm_flops():
    wl = _wl()
    c = load_constants("h100")
    off = c.with_values(wg_flops=0.0)
    same = c.with_values(wg_flops=c.sm_flops)
    assert predict(wl, off) == pytest.approx(predict(wl, same), rel=1e-12)


def test_wg_flops_is_fitted_only_on_request():
    from sim.calibration import DEFAULT_FIT, WG_FIT
    assert WG_FIT == ("wg_flops",) and "wg_flops" not in DEFAULT_FIT
