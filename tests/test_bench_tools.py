"""CPU checks of the benchmark harness's pure parts: cascade levels and the report."""
import json

import numpy as np
import pytest

from bench.compare import cascade_levels, headline, plot_all
from pat_core.workloads import DESIGN_WORKLOADS, build_tree_batch


@pytest.mark.parametrize("spec", DESIGN_WORKLOADS + ("1,3_20,9", "1,2,4_8,40,3"))
@pytest.mark.parametrize("ps", [16, 32])
def test_cascade_levels_cover_every_page_once(spec, ps):
    b = build_tree_batch(spec, ps)
    levels = cascade_levels(b)
    # a node shorter than a page owns no whole page: FlashInfer's levels can't express it
    short = min(int(x) for x in spec.split("_")[1].split(",")[:-1]) < ps if "," in \
        spec.split("_")[1] else False
    if levels is None:
        assert short, spec
        return
    B = b.batch_size
    seen = [[] for _ in range(B)]
    tokens = np.zeros(B, dtype=np.int64)
    for qo, kv, idx, last in levels:
        assert qo[0] == 0 and qo[-1] == B
        for j in range(len(qo) - 1):
            pages = idx[kv[j]:kv[j + 1]]
            assert 1 <= last[j] <= ps
            for r in range(qo[j], qo[j + 1]):
                seen[r].extend(pages.tolist())
                tokens[r] += (len(pages) - 1) * ps + last[j]
    for r in range(B):
        want = b.block_tables[r, : -(-int(b.seq_lens[r]) // ps)].tolist()
        assert seen[r] == want
    # tokens counted per level: every full page counts ps, the request's own last page its fill
    assert np.all(tokens >= b.seq_lens)


def test_report_renders(tmp_path):
    rows = []
    for wl in ("1,16_2048,128", "256_4096"):
        for m, lat in (("pat", 10.0), ("query", 30.0), ("fi-decode", 25.0),
                       ("fi-cascade", 20.0)):
            rows.append(dict(workload=wl, heads=[32, 8], page_size=16, method=m, batch=16,
                             floor_bytes=1e7, floor_us=8.0, latency_us=lat,
                             eff_bandwidth=1e7 / (lat * 1e-6), correct=True))
    rows.append(dict(workload="256_4096", heads=[32, 8], page_size=16, method="node",
                     batch=16, floor_us=8.0, correct=False, rel_err=1.0))
    result = dict(device="test device", copy_bandwidth=3e12, git_sha="0" * 40,
                  dtype="float16", head_dim=128, reps=20, versions={}, rows=rows)
    lines = plot_all(result, str(tmp_path))
    assert (tmp_path / "perf_32_8.png").stat().st_size > 1000
    assert (tmp_path / "bandwidth.png").exists()
    md = (tmp_path / "summary.md").read_text()
    assert "| 256_4096 | 32:8 | 8.0 |" in md and "*" in md
    h = headline(result)
    assert h["geomean_speedup_vs_best_fi"] == pytest.approx(2.0)
    assert h["min_nosharing_ratio_vs_fi_decode"] == pytest.approx(2.5)
    json.dumps(h)
    assert any("wrote" in x for x in lines)


def test_kernel_lab_layout_candidates_per_head_dim():
    """The 'layouts' case set at head_dim 256: 16-row warps only, no warpgroup layout, warps
    that tile the rows and whole 16-token slices (the traits' static rules), each feasible, and
    both ring depths of the tiles decode uses most; head_dim 128's set is the packaged one."""
    from bench.lab import kernel_lab as kl
    from pat_core import cuda_compile as cc
    assert kl._layout_candidates(128) == kl.CASE_SETS["layouts"]
    cands = kl._layout_candidates(256)
    assert cands
    for _, _, _, (m, n), (w, st, rw), _ in cands:
        assert rw == 16 and w % (m // rw) == 0
        wn = w // (m // rw)
        assert n % wn == 0 and (n // wn) % 16 == 0
        assert cc.fwd_variant_feasible(cc.FwdVariant(256, "float16", m, n, w, st, rw))
    got = {(tile, over) for _, _, _, tile, over, _ in cands}
    assert {((16, 32), (2, 3, 16)), ((16, 64), (4, 3, 16)), ((16, 64), (2, 2, 16))} <= got


def test_kernel_lab_tunings_apply_and_restore():
    """Every kernel_lab label builds a valid planner Tuning (its kernel layouts, forced n and
    cache layout left to run_case), and the restore puts the planner's tuning back; every case
    names a label of TUNINGS or forces a tile."""
    from bench.lab.kernel_lab import CASE_SETS, TUNINGS, apply_tuning

    from pat_core import Planner, Tuning
    planner = Planner("pat", "h100")
    before = planner.tuning
    for label, tun in TUNINGS.items():
        restore = apply_tuning(label, planner)
        assert isinstance(planner.tuning, Tuning)
        for key, val in tun.items():
            if key not in ("layouts", "n_by_m", "kv_layout"):
                assert getattr(planner.tuning, key) == val, (label, key)
        restore()
        assert planner.tuning is before
    with pytest.raises(KeyError):
        apply_tuning("finish-all", planner)
    for name, cases in CASE_SETS.items():
        for spec, heads, packer, tile, over, label in cases:
            assert label in TUNINGS or tile is not None, (name, label)


def test_request_rule_check_scores_the_rule_and_the_simulator(tmp_path):
    """bench/lab/request_rule_check.py pairs kernel_lab rows and scores the rule's choice."""
    from bench.lab import request_rule_check as rrc
    rows = []
    for heads, req_us, pat_us in (("32:8", 375.0, 384.0),      # per request faster: rule right
                                  ("64:8", 400.0, 380.0)):     # per request slower: rule wrong
        # the per-request row: "finish-0" in files from before the one launch path
        rows.append(dict(workload="1,32,256_64,64,1024", heads=heads, packer="query",
                         label="finish-0" if heads == "32:8" else "default", graph_us=req_us))
        rows.append(dict(workload="1,32,256_64,64,1024", heads=heads, packer="pat",
                         label="request-off", graph_us=pat_us))
    path = tmp_path / "kl.json"
    path.write_text(json.dumps({"rows": rows}))
    out = rrc.judge(rrc.kernel_lab_pairs(path))
    by = {r["pair"].split()[-1]: r for r in out}
    assert by["32:8"]["rule_takes"] and by["32:8"]["rule_right"]
    assert by["64:8"]["rule_takes"] and not by["64:8"]["rule_right"]
    assert all(r["sim_per_request_us"] > 0 and r["sim_pat_us"] > 0 for r in out)


def test_host_path_compare_and_cli(tmp_path, capsys):
    """bench/lab/host_path.py's side-by-side table reads two result files (the GPU part needs a
    device); without --out or --compare the command line refuses."""
    from bench.lab import host_path
    row = {"spec": "1,16_2048,128", "heads": "32:8", "host_us": 40.0, "host_out_us": 35.0,
           "backend_us": 30.0, "graph_us": 20.0, "eager_flush_us": 30.0, "loop_graph_us": 10.0,
           "loop_eager_us": 40.0, "layers_plan_us": 100.0, "layers_call_us": 4000.0}
    files = []
    for label, scale in (("a", 1.0), ("b", 0.5)):
        rec = {"label": label, "env": {"git_sha": label * 7, "device": "x"},
               "rows": [{k: (v * scale if k.endswith("_us") and k != "graph_us"
                             and k != "loop_graph_us" else v) for k, v in row.items()}]}
        files.append(tmp_path / f"{label}.json")
        files[-1].write_text(json.dumps(rec))
    text = host_path.compare(*map(str, files))
    line = [ln for ln in text.splitlines() if ln.startswith("1,16_2048,128")][0].split()
    # host A, host B, loop e/g A, loop e/g B, flush e/g A, flush e/g B, layer A, layer B
    assert line[2:] == ["40.0", "20.0", "4.00", "2.00", "1.50", "0.75", "4000.0", "2000.0"]
    with pytest.raises(SystemExit):
        host_path.main([])
    capsys.readouterr()


def test_flush_mode_reads_the_environment(monkeypatch):
    """The benchmarks' L2 flush: clean by default, dirty on request, anything else refused."""
    from bench.common import FLUSH_MODES, flush_mode
    monkeypatch.delenv("PAT_L2_FLUSH", raising=False)
    assert flush_mode() == "clean"
    monkeypatch.setenv("PAT_L2_FLUSH", "dirty")
    assert flush_mode() == "dirty"
    monkeypatch.setenv("PAT_L2_FLUSH", "warm")
    with pytest.raises(ValueError, match="PAT_L2_FLUSH"):
        flush_mode()
    assert set(FLUSH_MODES) == {"clean", "dirty"}


def test_stable_runs_times_again_until_the_runs_agree():
    """common.stable_runs keeps the first try whose runs spread at most max_spread, else the
    steadiest of its tries; common.spread is the simulator's run_spread."""
    from bench.common import spread, stable_runs
    from sim.calibration import UNSTEADY, run_spread
    steady = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8]
    noisy = [10.0, 20.0, 11.0, 30.0, 9.0, 25.0]
    worse = [10.0, 40.0, 5.0, 60.0, 9.0, 25.0]
    assert spread(steady) == run_spread(steady) < UNSTEADY < spread(noisy) < spread(worse)
    assert run_spread([1.0, 100.0, 1.0]) == 0.0                  # too few runs to judge
    seq = iter([noisy, steady, worse])
    assert stable_runs(lambda: next(seq), UNSTEADY, 3) == (steady, 2)
    seq = iter([worse, noisy, worse])
    assert stable_runs(lambda: next(seq), UNSTEADY, 3) == (noisy, 3)
    seq = iter([noisy])
    assert stable_runs(lambda: next(seq), UNSTEADY, 1) == (noisy, 1)
    with pytest.raises(ValueError, match="tries"):
        stable_runs(lambda: steady, UNSTEADY, 0)
    with pytest.raises(ValueError, match="max_spread"):
        stable_runs(lambda: steady, -0.1, 2)


def test_calibration_report_counts_unsteady_records(tmp_path):
    """A record whose runs disagree is scored as measured and counted in the report."""
    from sim.calibration import format_report, load_measurements, report
    from sim.constants import load_constants
    recs = [dict(workload="1,16_2048,128", method=m, num_qo_heads=32, num_kv_heads=8,
                 head_dim=128, page_size=16, measured_graph_us=us, runs_graph_us=runs)
            for m, us, runs in (("pat", 20.0, [20.0, 20.1, 19.9, 20.0]),
                                ("query", 30.0, [30.0, 60.0, 25.0, 45.0]))]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"gpu": "h100", "records": recs}))
    data = load_measurements([str(path)])
    assert [r["spread"] > 0.1 for r in data["records"]] == [False, True]
    rep = report(data, load_constants("h100"), fit_workloads=("1,16_2048,128",))
    assert rep["in_sample"]["graph"]["all"]["unsteady"] == 1
    assert "spread more than 10%" in format_report(rep)
    assert "in sample graph 1 of 2" in format_report(rep)


def test_block_timeline_cases_and_summary():
    """bench/lab/block_timeline.py's pure parts: a case names its spec, heads and method (a bad
    one is refused, naming it); the summary's spans, durations and peak concurrency."""
    from bench.lab.block_timeline import parse_case, summarize
    assert parse_case("1,4_16,16@32:8@query") == ("1,4_16,16", 32, 8, "query", 16)
    assert parse_case("1,4_16,16@32:8@pat@32", 16) == ("1,4_16,16", 32, 8, "pat", 32)
    for bad in ("1,4_16,16@32:8", "1,4_16,16@32-8@pat", "1,4_16,16@32:8@nope",
                "1,4_16,16@32:8@pat@0", "1,4_16,16@32:8@pat@x"):
        with pytest.raises(ValueError, match="case"):
            parse_case(bad)
    blocks = [{"kind": "forward", "start": 0, "end": 4000},
              {"kind": "forward", "start": 1000, "end": 3000},
              {"kind": "forward", "start": 3500, "end": 9000},
              {"kind": "merge", "start": 2000, "ready": 9500, "end": 11000}]
    s = summarize(blocks)
    assert s["forward_blocks"] == 3 and s["merge_blocks"] == 1
    assert s["forward_span_us"] == 9.0
    assert s["block_med_us"] == 4.0 and s["block_p90_us"] == 5.5
    assert s["peak_blocks"] == 2             # [0, 4000] overlaps both others, they do not
    assert s["merge_span_us"] == 1.5          # from the merge block's ready time
    assert s["step_span_us"] == 11.0


def test_plan_loop_smoke(tmp_path):
    """The serving-loop planning benchmark end to end on the CPU: incremental and fresh plans
    of every step equal (``--check``), the rows' timings and the machine's speed recorded."""
    from bench.plan_loop import main
    path = tmp_path / "loop.json"
    res = main(["--requests", "16", "--steps", "12", "--warmup", "2", "--prompt-len", "256",
                "--private", "8,64", "--check", "--tree", "1,4_64,32", "--tree-reps", "3",
                "--gap-ms", "1", "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert res["benchmark"] == "plan_loop" and res["git_sha"]
    (row,) = res["rows"]
    assert row["steps_differing_from_fresh"] == 0 and row["gap_ms"] == 1
    for part in ("incremental", "fresh"):
        s = row[part]
        assert 0 < s["median_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert res["tree"]["fresh"]["median_ms"] > 0
    speed = res["machine"]["speed"]
    assert set(speed) == {"python_loop_ms", "numpy_sort_ms", "numba_walk_ms"}
    assert all(v > 0 for v in speed.values())



def test_graph_safe_timeline_launch_rows():
    """bench/lab/graph_safe_timeline.py summarises each launch's clock records: the blocks
    below the launch's item count ran items, their SMs and the most on one SM; times in us
    from the first block; launches in start order; every merge block counts."""
    from bench.lab.graph_safe_timeline import launch_rows

    class Rec:                                   # a clock array's .get(): [2, cap, 6]
        def __init__(self, blocks):
            self.a = np.zeros((2, 8, 6), dtype=np.uint64)
            for b, (start, end, sm) in enumerate(blocks):
                self.a[0, b] = (start, start, end, 0, 0, sm)

        def get(self):
            return self.a

    arrays = {"pat_fwd_x": Rec([(3000, 9000, 5), (3100, 9500, 5), (3200, 4000, 7),
                                (3300, 3400, 8)]),
              "pat_fwd_idle": Rec([(1000, 1500, 1), (1100, 1600, 2)]),
              "pat_merge_y": Rec([(9000, 11000, 2)])}
    rows = launch_rows(arrays, {"pat_fwd_x": 3})
    assert [r["key"] for r in rows] == ["pat_fwd_idle", "pat_fwd_x", "pat_merge_y"]
    idle, fwd, merge = rows
    assert (idle["items"], idle["sms"], idle["max_per_sm"]) == (0, 0, 0)
    assert (fwd["blocks"], fwd["items"], fwd["sms"], fwd["max_per_sm"]) == (4, 3, 2, 2)
    assert fwd["start"] == 2.0 and fwd["end"] == 8.5
    assert fwd["item_us"] == 6.0                 # median of 6.0, 6.4 and 0.8 us
    assert (merge["items"], merge["sms"], merge["start"], merge["end"]) == (1, 1, 8.0, 10.0)
