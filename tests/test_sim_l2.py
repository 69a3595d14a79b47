"""L2 reuse model and timing modes of the simulator (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest

import sim
from pat_core.plan import DTYPE_BYTES
from sim.constants import load_constants
from sim.l2 import l2_split, l2_window
from sim.methods import load_batch, make_plan
from sim.model import bytes_by_level, predict, prepare


def _plan(spec, method="query", heads=(8, 1), page=16, d=128):
    return make_plan(load_batch(spec, page), method, heads[0], heads[1], d)


def _fwd(wl):
    return np.array([ln.kind == "forward" for ln in wl.launches])[wl.blk_launch]


@pytest.mark.parametrize("k", [2, 5, 16])
def test_shared_page_read_by_k_blocks_costs_hbm_once(k):
    """query packer: k requests read one 256-token root; it comes from HBM once, then L2."""
    plan = _plan(f"1,{k}_256,16")
    wl = prepare(plan)
    tok = 2 * 128 * DTYPE_BYTES["float16"]
    fwd = _fwd(wl)
    kv_l2 = wl.blk_l2[fwd].sum()
    assert kv_l2 == (k - 1) * 256 * tok
    hbm_kv = plan.stats()["kv_bytes"] - kv_l2
    assert hbm_kv == (256 + k * 16) * tok          # unique tokens, each read from HBM once


def test_every_kv_head_is_its_own_data():
    """Pages of different KV heads are different bytes: no hits between heads."""
    one = prepare(_plan("1,4_256,16", heads=(8, 1)))
    four = prepare(_plan("1,4_256,16", heads=(32, 4)))
    assert four.blk_l2[_fwd(four)].sum() == 4 * one.blk_l2[_fwd(one)].sum()


@pytest.mark.parametrize("heads", [(32, 8), (8, 1)])
def test_zero_window_makes_everything_hbm(heads):
    """With one KV head, resident blocks read one page back to back, no bytes entering L2 in
    between: a zero window must still make those HBM reads."""
    plan = _plan("1,8_512,64", "query", heads)
    wl = prepare(plan, l2_window_bytes=0)
    assert not wl.blk_l2.any()
    lv = bytes_by_level(wl)
    assert lv["l2"] == 0 and lv["hbm"] == plan.stats()["total_bytes"]


def test_hits_grow_with_the_window():
    plan = _plan("1,16_512,64", "query", (32, 8))
    wls = [prepare(plan, l2_window_bytes=w) for w in (0, 1, 2e5, 1e6, 1e9)]
    hits = [wl.blk_l2.sum() for wl in wls]
    assert all(a <= b for a, b in zip(hits, hits[1:])) and hits[0] == 0 and hits[-1] > 0
    # a 1-byte window: no KV page survives another block's traffic
    assert wls[1].blk_l2[_fwd(wls[1])].sum() == 0


@pytest.mark.parametrize("spec", ["1,4,16_128,256,1024", "3,12_100,37", "8_300", "1,1,4_16,40,9"])
@pytest.mark.parametrize("method", ["pat", "query", "node", "cascade", "pat-fixed"])
def test_bytes_conserved(spec, method):
    plan = _plan(spec, method, (32, 8))
    wl = prepare(plan)
    assert np.all(wl.blk_l2 >= 0) and np.all(wl.blk_l2 <= wl.blk_bytes)
    lv = bytes_by_level(wl)
    assert lv["hbm"] + lv["l2"] == lv["total"] == plan.stats()["total_bytes"]
    r = sim.simulate(plan)
    assert r.bytes["total"] == plan.stats()["total_bytes"] == sum(
        r.bytes_level[k] for k in ("hbm", "l2"))


def _split(plan, window, weight=None, capacity=1.0):
    """KV L2 bytes of ``plan``'s forward blocks in the model's dispatch order (head-minor)."""
    hk = plan.num_kv_heads
    cta = np.repeat(np.arange(plan.num_ctas), hk)
    head = np.tile(np.arange(hk), plan.num_ctas)
    w = None if weight is None else np.full(cta.shape[0], weight)
    return l2_split(plan, cta, head, np.zeros(cta.shape[0]), [], window, w, capacity)


def test_blocks_resident_together_share_a_prefix_longer_than_the_window():
    """8 requests x 8 KV heads read a 1024-token root (4 MB over all heads) with a 1 MB window.
    Replayed a block at a time, each request finds the root evicted by the other heads' reads;
    replayed as the GPU runs them (all 64 blocks resident, reading page by page side by side)
    the root comes from HBM once per head."""
    plan = _plan("1,8_1024,16", "query", (8, 8))
    tok = 2 * 128 * DTYPE_BYTES["float16"]
    kv = plan.stats()["kv_bytes"]
    unique = (1024 + 8 * 16) * tok * 8
    together = _split(plan, 2 ** 20, weight=0.25, capacity=132.0)
    assert kv - together.sum() == unique
    one_at_a_time = _split(plan, 2 ** 20)
    assert one_at_a_time.sum() == 0 and kv - one_at_a_time.sum() == kv
    # room for one request's 8 blocks at a time: still re-read from HBM by every request
    by_request = _split(plan, 2 ** 20, weight=1.0, capacity=8.0)
    assert by_request.sum() == 0
    # the same room with a window wider than the root: HBM once again
    assert kv - _split(plan, 8 * 2 ** 20, weight=1.0, capacity=8.0).sum() == unique


def test_l2_split_interleaving_is_order_independent_of_room_when_all_fit():
    """Any room that holds every block gives the same split (all blocks read side by side)."""
    plan = _plan("1,4,16_128,256,64", "query", (32, 8))
    a = _split(plan, 1e6, weight=0.5, capacity=1e4)
    b = _split(plan, 1e6, weight=0.01, capacity=1e4)
    assert np.array_equal(a, b) and a.sum() > 0


def test_l2_window_per_gpu():
    assert l2_window("h100") == 0.5 * 50 * 2 ** 20
    assert l2_window("h200") == 0.5 * 60 * 2 ** 20
    assert l2_window("a100") == 0.5 * 40 * 2 ** 20


def test_l2_split_rejects_bad_input():
    plan = _plan("1,4_64,16")
    with pytest.raises(ValueError, match="window"):
        l2_split(plan, [0], [0], [0.0], [], -1.0)
    with pytest.raises(ValueError, match="same length"):
        l2_split(plan, [0, 1], [0], [0.0], [], 1.0)
    with pytest.raises(ValueError, match="same length"):
        l2_split(plan, [0], [0], [0.0], [], 1.0, blk_weight=[1.0, 1.0])
    with pytest.raises(ValueError, match="capacity"):
        l2_split(plan, [0], [0], [0.0], [], 1.0, capacity=0.0)


def test_l2_hits_use_l2_bandwidth_not_dram():
    """A sharing batch under the query packer: with hits served at a high L2 bandwidth it is
    faster than with the L2 off; with a starved L2 it is slower than with plenty of it."""
    plan = _plan("1,64_2048,32", "query", (32, 8))
    c = load_constants("h100").with_values(hbm_bandwidth=1000.0, sm_bandwidth=200.0)
    on = prepare(plan)
    off = prepare(plan, l2_window_bytes=0)
    fast = predict(on, c.with_values(l2_bandwidth=50_000.0))
    slow = predict(on, c.with_values(l2_bandwidth=100.0))
    none = predict(off, c.with_values(l2_bandwidth=100.0))
    assert fast < 0.5 * predict(off, c)
    assert slow > 2 * fast
    # with no hits the L2 bandwidth does not matter
    assert none == pytest.approx(predict(off, c.with_values(l2_bandwidth=50_000.0)))


# ---------------------------------------------------------------------------- timing modes
def test_timing_modes_use_their_own_launch_constants():
    plan = _plan("1,4,16_128,256,1024", "pat", (32, 8))
    wl = prepare(plan)
    # fixed start latencies 0 here: tests/test_sim_start_latency.py covers them
    c = load_constants("h100").with_values(launch_ns=20_000.0, gap_ns=500.0,
                                           graph_launch_ns=1000.0, graph_gap_ns=2000.0,
                                           start_ns=0.0, graph_start_ns=0.0)
    eager, graph = predict(wl, c, "eager"), predict(wl, c, "graph")
    assert eager > graph
    # each mode reads only its own pair
    assert predict(wl, c.with_values(graph_launch_ns=7000.0), "eager") == eager
    assert predict(wl, c.with_values(launch_ns=90_000.0), "graph") == graph
    # equal launch constants: equal predictions
    same = c.with_values(graph_launch_ns=c.launch_ns, graph_gap_ns=c.gap_ns)
    assert predict(wl, same, "graph") == pytest.approx(predict(wl, same, "eager"))
    # the first forward launch reaches the GPU one launch interval in
    tl_e = sim.model.run_timeline(wl, c, "eager")
    assert tl_e.launches[0].issue_ns == 20_000.0 and np.nanmin(tl_e.block_start) >= 20_000.0


def test_simulate_timing_argument():
    plan = _plan("1,4_64,16", "pat", (8, 8))
    assert sim.simulate(plan).timing == "graph"
    r = sim.simulate(plan, timing="eager")
    assert r.timing == "eager" and r.summary_row()["timing"] == "eager"
    with pytest.raises(ValueError, match="timing"):
        sim.simulate(plan, timing="fast")


def test_compare_reports_hbm_l2_and_timing(capsys, tmp_path):
    import json

    from sim.cli import main
    spec = "1,4,16_128,256,1024"
    assert main(["compare", "--tree", spec, "--methods", "pat,query", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["timing"] == "graph"
    for row in res["rows"]:
        assert row["hbm_bytes"] + row["l2_bytes"] == row["total_bytes"]
        assert row["bytes_level"]["hbm"] == row["hbm_bytes"]
    q = next(r for r in res["rows"] if r["method"] == "query")
    assert q["l2_bytes"] > 0                   # the shared prefix re-read by every request
    c = load_constants("h100")
    assert main(["compare", "--tree", spec, "--methods", "pat", "--timing", "eager",
                 "--bytes-plot", str(tmp_path / "b.png")]) == 0
    text = capsys.readouterr().out
    assert f"host launch cost {c.launch_ns / 1e3:.1f} us per launch" in text
    assert "HBM MB" in text and "L2 MB" in text
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", "--tree", spec, "--methods", "pat"]) == 0
    assert "timing: graph" in capsys.readouterr().out


def test_a_block_streams_its_leading_hits_first_then_a_mix():
    """One block on one SM, 100 bytes of which 50 hit in L2; the SM pulls 10 bytes/ns, HBM
    serves 1 byte/ns.  Hits led (``blk_lead`` 50): 5 ns of hits at the SM's pull, then 50 HBM
    bytes at the HBM cap, 55 ns after its latency.  Nothing led: one mix, half from HBM, at the
    level where its HBM half meets the cap (2 bytes/ns): 50 ns.  Two led blocks on two SMs
    share the HBM cap in their second segment."""
    from sim.timeline import run_engine
    cap = np.array([1 << 20, 1 << 16, 2048, 32])
    need = np.array([[0, 32, 32, 1]])

    def run(n, l2, lead, latency=100.0):
        return run_engine(n, cap, need, np.zeros(n, np.int32), np.full(n, latency),
                          np.full(n, 100.0), np.zeros(n), np.array([0, n]), np.zeros(1),
                          np.zeros(1, np.int32), 1, 0.0, 10.0, 1.0, blk_l2=np.full(n, l2),
                          l2_bw=100.0, blk_lead=np.full(n, lead))
    _, _, start, end, _, _ = run(1, 50.0, 50.0)
    assert end[0] - start[0] == pytest.approx(100.0 + 5.0 + 50.0)
    _, _, start, end, _, _ = run(1, 50.0, 50.0, latency=0.0)   # streaming from dispatch on
    assert end[0] - start[0] == pytest.approx(5.0 + 50.0)
    _, _, start, end, _, _ = run(1, 50.0, 0.0)
    assert end[0] - start[0] == pytest.approx(100.0 + 50.0)
    # 20 bytes led (2 ns), then 80 bytes of which 50 from HBM: 50 HBM bytes at 1 byte/ns
    _, _, start, end, _, _ = run(1, 50.0, 20.0)
    assert end[0] - start[0] == pytest.approx(100.0 + 2.0 + 50.0)
    _, _, start, end, _, _ = run(2, 50.0, 50.0)
    assert end - start == pytest.approx([100.0 + 5.0 + 100.0] * 2)
    _, _, start, end, _, _ = run(1, 0.0, 0.0)                   # no hits: all at the HBM cap
    assert end[0] - start[0] == pytest.approx(100.0 + 100.0)
    _, _, start, end, _, _ = run(1, 100.0, 100.0)               # all hits: at the SM's pull
    assert end[0] - start[0] == pytest.approx(100.0 + 10.0)
    with pytest.raises(ValueError, match="blk_l2"):
        run(1, 150.0, 0.0)
    with pytest.raises(ValueError, match="blk_lead"):
        run(1, 50.0, 60.0)


def test_long_blocks_lead_with_their_hits_short_ones_mix():
    """The query packer on a shared 2048-token root: each block's hits beyond what its pipeline
    keeps in flight lead; a 128-token request (a 16 x 64 tile of two stages) reads everything
    in one mix."""
    long_ = prepare(_plan("1,8_2048,16", "query", (8, 1)))
    fwd = _fwd(long_)
    assert (long_.blk_lead[fwd] > 0).sum() >= 7
    assert np.all(long_.blk_lead <= long_.blk_l2)
    short = prepare(_plan("1,8_100,28", "query", (8, 1)))
    assert short.blk_l2[_fwd(short)].sum() > 0 and not short.blk_lead.any()


@pytest.mark.parametrize("spec,method", [("1,64_2048,32", "pat"),
                                         ("1,4,16_128,256,1024", "node")])
@pytest.mark.parametrize("window", [2e5, 2e6])
def test_merge_hits_fit_in_the_window(spec, method, window):
    """The merge reads as L2 hits only partials written within the last ``window`` bytes of
    insertions before the forward blocks ended, so at most ``window`` plus one block's partial
    bytes (long blocks dispatched first end last: the end is the latest block's, not the last
    dispatched one's)."""
    from sim.l2 import _partial_write_bytes
    plan = _plan(spec, method, (32, 8))
    wl = prepare(plan, l2_window_bytes=window)
    fwd = _fwd(wl)
    pw = _partial_write_bytes(plan, wl.blk_cta[fwd])
    assert 0 < wl.blk_l2[~fwd].sum() <= window + pw.max()
