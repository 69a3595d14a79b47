"""Calibration: loading, the workload split, fit and report on synthetic measurements made in
the test (CPU only).

The "measurements" are the model's own predictions under known constants, times a little noise:
the fit must find constants that predict them again, and the report must say so.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sim.calibration import (Prepared, fit, fit_and_save, fit_workloads_of, load_measurements,
                             report, spearman, split_workloads)
from sim.cli import main
from sim.constants import default_constants, load_constants

SPECS = ("1,8_512,64", "1,4,16_128,256,512", "32_300", "2,16_1024,32")
METHODS = ("pat", "query", "cascade")
HEADS = ((32, 8), (8, 8))
TRUE = dict(sm_bandwidth=80.0, block_ns=2500.0, launch_ns=9000.0, tile_ns=220.0,
            graph_launch_ns=1200.0)


def _synthetic(tmp_path, noise=0.03, seed=0, split=None):
    true = default_constants("h100").with_values(**TRUE)
    recs = [{"workload": w, "method": m, "num_qo_heads": hq, "num_kv_heads": hk,
             "head_dim": 128, "page_size": 16, "dtype": "float16",
             "measured_eager_us": 1.0, "measured_graph_us": 1.0}
            for w in SPECS for m in METHODS for hq, hk in HEADS]
    data = {"device": "synthetic", "gpu": "h100", "git_sha": "abc", "records": recs}
    if split:
        data["split"] = split
    path = tmp_path / "calibration_h100.json"
    path.write_text(json.dumps(data))
    loaded = load_measurements(str(path))
    prep = Prepared(loaded["records"], "h100")
    pred = prep.predict(loaded["records"], true)
    rng = np.random.default_rng(seed)
    by_key = {(r["workload"], r["method"], r["num_qo_heads"], r["num_kv_heads"], r["timing"]): p
              for r, p in zip(loaded["records"], pred)}
    for r in recs:
        for t in ("eager", "graph"):
            p = by_key[(r["workload"], r["method"], r["num_qo_heads"], r["num_kv_heads"], t)]
            r[f"measured_{t}_us"] = float(p * np.exp(rng.normal(0.0, noise)))
    path.write_text(json.dumps(data))
    return str(path), true, prep


def test_spearman_is_scipys():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 5], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)
    assert np.isnan(spearman([1.0], [2.0]))


def test_loading_both_layouts(tmp_path):
    path, _, _ = _synthetic(tmp_path)
    d = load_measurements(path)
    assert len(d["records"]) == 2 * len(SPECS) * len(METHODS) * len(HEADS)
    assert {r["timing"] for r in d["records"]} == {"eager", "graph"}
    cmp_rows = [{"workload": "8_64", "heads": [8, 8], "page_size": 32, "method": m,
                 "latency_eager_us": 30.0, "latency_graph_us": 10.0, "correct": True}
                for m in ("pat", "query", "fi-decode")]
    cmp_rows.append({"workload": "8_64", "heads": [8, 8], "page_size": 16, "method": "pat",
                     "correct": False})
    sub = tmp_path / "compare"
    sub.mkdir()
    (sub / "results.json").write_text(json.dumps(
        {"benchmark": "compare", "device": "NVIDIA H100 (synthetic)", "head_dim": 64, "rows": cmp_rows,
         "copy_bandwidth": 2.5e12}))
    c = load_measurements(str(sub))
    assert len(c["records"]) == 4                      # FlashInfer and wrong rows skipped
    assert {(r["method"], r["timing"], r["measured_us"]) for r in c["records"]} == {
        ("pat", "eager", 30.0), ("pat", "graph", 10.0), ("query", "eager", 30.0),
        ("query", "graph", 10.0)}
    assert c["records"][0]["page_size"] == 32 and c["records"][0]["head_dim"] == 64
    assert c["copy_bandwidth_gbps"] == pytest.approx(2500.0)
    both = load_measurements([path, str(sub)])
    assert len(both["records"]) == len(d["records"]) + 4
    # a legacy file: one eager measured_us per record
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"records": [{"workload": "8_64", "method": "pat",
                                            "num_qo_heads": 8, "num_kv_heads": 8,
                                            "head_dim": 128, "measured_us": 5.0}],
                               "device": "NVIDIA H100 80GB HBM3"}))
    o = load_measurements(str(old))
    assert o["records"][0]["timing"] == "eager" and o["gpu"] == "h100"


def test_split_is_by_workload():
    recs = [{"workload": w, "page_size": ps, "timing": t}
            for w in ("a", "b", "c", "d", "e") for ps in (16, 32) for t in ("eager", "graph")]
    s = split_workloads(recs)
    assert s["fit"] == ["a", "c", "e"] and s["validation"] == ["b", "d"]
    assert not set(s["fit"]) & set(s["validation"])
    assert set(s["fit"]) | set(s["validation"]) == {"a", "b", "c", "d", "e"}
    s = split_workloads(recs, validation=["e"])
    assert s["validation"] == ["e"] and "e" not in s["fit"]
    s = split_workloads(recs, file_split={"fit": ["a"], "validation": ["a2", "c"]})
    assert s["validation"] == ["c"] and s["rule"].startswith("split recorded")
    with pytest.raises(ValueError, match="not in the measurements"):
        split_workloads(recs, validation=["zz"])
    with pytest.raises(ValueError, match="no workload to fit"):
        split_workloads(recs, validation=list("abcde"))


def test_fit_recovers_synthetic_measurements(tmp_path):
    path, true, prep = _synthetic(tmp_path)
    data = load_measurements(path)
    split = split_workloads(data["records"])
    start = default_constants("h100")
    before = report(data, start, split["fit"], prepared=prep)
    consts, info = fit(data, split, "h100", start=start, max_evals=800, prepared=prep)
    after = report(data, consts, split["fit"], prepared=prep)
    # the constants that generated the data, scored against the same noisy measurements: the
    # rank correlation a perfect fit can reach (3% noise scrambles close latencies)
    ideal = report(data, true, split["fit"], prepared=prep)
    assert info["loss_after"] < info["loss_before"]
    for side in ("in_sample", "out_of_sample"):
        for t in ("eager", "graph"):
            a = after[side][t]["all"]
            assert a["median_abs_err"] <= 0.06
        assert (after[side]["graph"]["all"]["spearman"]
                >= min(0.9, ideal[side]["graph"]["all"]["spearman"] - 0.05))
    worst = max(before[s][t]["all"]["median_abs_err"] for s in ("in_sample", "out_of_sample")
                for t in ("eager", "graph"))
    assert worst > 0.2                     # the start was far off
    assert after["in_sample"]["graph"]["all"]["n"] == len(METHODS) * len(HEADS) * 2
    assert set(after["fit_workloads"]) == set(split["fit"])
    assert not set(after["fit_workloads"]) & set(after["validation_workloads"])
    assert consts.source.startswith("fit to calibration_h100.json")
    assert {"launch_ns", "graph_launch_ns", "l2_bandwidth", "graph_start_ns"} <= set(info["fitted"])
    # the start latency, 0 in the starting constants, is searched from START_GUESS_NS (the search
    # runs over logarithms and could not leave 0)
    assert consts.graph_start_ns > 0.0


def test_fit_only_moves_launch_constants_of_measured_modes(tmp_path):
    path, _, prep = _synthetic(tmp_path)
    data = load_measurements(path)
    data["records"] = [r for r in data["records"] if r["timing"] == "graph"]
    start = default_constants("h100")
    consts, info = fit(data, split_workloads(data["records"]), "h100", start=start,
                       max_evals=20, prepared=prep)
    assert "launch_ns" not in info["fitted"] and consts.launch_ns == start.launch_ns


def test_device_measurements_fix_their_constants(tmp_path):
    """The copy bandwidth and the graph launch and join costs that bench/calibrate.py measures
    are taken as they are: loaded as medians over the files, left out of the fit.  The L2 read
    bandwidth it records is loaded too, but l2_bandwidth stays fitted."""
    path, _, prep = _synthetic(tmp_path)
    raw = json.loads(open(path).read())
    raw.update(copy_bandwidth_gbps=3000.0, l2_bandwidth_gbps=9000.0,
               graph_launch={"interval_ns": 700.0, "join_ns": 3000.0})
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(raw, l2_bandwidth_gbps=11000.0,
                                     graph_launch={"interval_ns": 900.0})))
    open(path, "w").write(json.dumps(raw))
    data = load_measurements([path, str(other)])
    assert data["l2_bandwidth_gbps"] == pytest.approx(10000.0)
    assert data["graph_launch_interval_ns"] == pytest.approx(800.0)
    assert data["copy_bandwidth_gbps"] == pytest.approx(3000.0)
    data["records"] = load_measurements(path)["records"]
    consts, info = fit(data, split_workloads(data["records"]), "h100",
                       start=default_constants("h100"), max_evals=30, prepared=prep)
    assert data["graph_join_ns"] == pytest.approx(3000.0)
    assert info["measured"] == {"hbm_bandwidth": 3000.0, "graph_launch_ns": 800.0,
                                "graph_join_ns": 3000.0}
    assert "l2_bandwidth" in info["fitted"]
    assert not set(info["measured"]) & set(info["fitted"])
    assert (consts.hbm_bandwidth, consts.graph_launch_ns, consts.graph_join_ns) == (
        3000.0, 800.0, 3000.0)
    assert "graph_start_ns" in info["fitted"] and "launch_ns" in info["fitted"]
    # a file without them: nothing fixed, everything fitted as before
    for k in ("copy_bandwidth_gbps", "l2_bandwidth_gbps", "graph_launch"):
        raw.pop(k)
    open(path, "w").write(json.dumps(raw))
    plain = load_measurements(path)
    assert plain["l2_bandwidth_gbps"] is None and plain["graph_launch_interval_ns"] is None
    assert plain["graph_join_ns"] is None
    _, info = fit(plain, split_workloads(plain["records"]), "h100",
                  start=default_constants("h100"), max_evals=5, prepared=prep)
    assert info["measured"] == {} and "graph_launch_ns" in info["fitted"]


def test_graph_start_file_fixes_the_start(tmp_path):
    """A bench/lab/graph_start.py file fixes graph_start_ns at the replay time outside the kernels
    minus the (measured) launch interval; it is read from a folder scan too; a file of another
    GPU is passed over in a folder and refused when named."""
    path, _, prep = _synthetic(tmp_path)
    raw = json.loads(open(path).read())
    raw["graph_launch"] = {"interval_ns": 900.0}
    open(path, "w").write(json.dumps(raw))
    gs = tmp_path / "graph_start_h100.json"
    gs.write_text(json.dumps({"benchmark": "graph_start", "device": "synthetic", "gpu": "h100",
                              "env": {"git_sha": "def"}, "median_outside_us": 2.5,
                              "rows": []}))
    data = load_measurements(str(tmp_path))       # both files, found by the folder scan
    assert data["graph_outside_ns"] == pytest.approx(2500.0)
    assert "def" in data["git_sha"] and len(data["records"]) == len(prep.records)
    consts, info = fit(data, split_workloads(data["records"]), "h100",
                       start=default_constants("h100"), max_evals=20, prepared=prep)
    assert info["measured"]["graph_start_ns"] == pytest.approx(1600.0)
    assert consts.graph_start_ns == pytest.approx(1600.0)
    assert "graph_start_ns" not in info["fitted"] and "start_ns" in info["fitted"]
    # shorter than the launch interval: a start of 0, never negative
    gs.write_text(json.dumps({"benchmark": "graph_start", "gpu": "h100",
                              "median_outside_us": 0.5}))
    _, info = fit(load_measurements(str(tmp_path)), split_workloads(data["records"]), "h100",
                  start=default_constants("h100"), max_evals=5, prepared=prep)
    assert info["measured"]["graph_start_ns"] == 0.0
    gs.write_text(json.dumps({"benchmark": "graph_start", "gpu": "h200",
                              "median_outside_us": 1.3}))
    passed = load_measurements(str(tmp_path))           # passed over, and not listed
    assert passed["graph_outside_ns"] is None and str(gs) not in passed["files"]
    with pytest.raises(ValueError, match="graph_start file of h200"):
        load_measurements([path, str(gs)])
    with pytest.raises(ValueError, match="graph_start file of h200"):
        load_measurements([Path(path), gs])                # pathlib paths name it too
    with pytest.raises(ValueError, match="no timed records"):
        load_measurements(str(gs))
    gs.write_text(json.dumps({"benchmark": "graph_start", "gpu": "h100"}))
    with pytest.raises(ValueError, match="median_outside_us"):
        load_measurements(str(tmp_path))
    # without a measured launch interval the start cannot be fixed from the file
    gs.write_text(json.dumps({"benchmark": "graph_start", "gpu": "h100",
                              "median_outside_us": 2.5}))
    raw.pop("graph_launch")
    open(path, "w").write(json.dumps(raw))
    with pytest.raises(ValueError, match="graph launch interval"):
        fit(load_measurements(str(tmp_path)), split_workloads(data["records"]), "h100",
            start=default_constants("h100"), max_evals=5, prepared=prep)


def test_fit_and_report_commands(tmp_path, capsys):
    path, _, _ = _synthetic(tmp_path)
    out = tmp_path / "h100.json"
    assert main(["fit", "--measurements", path, "--out", str(out), "--max-evals", "40",
                 "--validation", "32_300;2,16_1024,32"]) == 0
    text = capsys.readouterr().out
    assert "in sample" in text and "out of sample" in text
    saved = json.loads(out.read_text())
    assert saved["source"].startswith("fit to") and set(saved["constants"]) == set(
        default_constants("h100").as_dict())
    assert saved["fit"]["split"]["validation"] == ["32_300", "2,16_1024,32"]
    assert saved["fit"]["device"] == ["synthetic"] and saved["fit"]["git_sha"] == ["abc"]
    assert fit_workloads_of(str(out)) == ["1,8_512,64", "1,4,16_128,256,512"]
    assert load_constants("h100", str(out)).source == saved["source"]
    plot = tmp_path / "cal.png"
    assert main(["calibration-report", "--measurements", path, "--constants", str(out),
                 "--json", "--plot", str(plot)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["fit_workloads"] == ["1,8_512,64", "1,4,16_128,256,512"]
    assert rep["in_sample"]["graph"]["all"]["n"] == rep["out_of_sample"]["graph"]["all"]["n"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a folder works as well as a file
    assert main(["calibration-report", "--measurements", str(tmp_path), "--constants",
                 str(out)]) == 0
    assert "Spearman" in capsys.readouterr().out


def test_fit_replaces_a_device_measurement_on_request(tmp_path, capsys):
    """``sim fit --measured KEY=VALUE`` takes that device measurement instead of the files'
    (an outlier copy measurement, say), fixes its constant to it and records the replacement;
    unknown keys and malformed values are refused."""
    path, _, _ = _synthetic(tmp_path)
    raw = json.loads(open(path).read())
    raw.update(copy_bandwidth_gbps=2500.0)
    open(path, "w").write(json.dumps(raw))
    out = tmp_path / "h100.json"
    assert main(["fit", "--measurements", path, "--out", str(out), "--max-evals", "10",
                 "--measured", "copy_bandwidth_gbps=2950"]) == 0
    capsys.readouterr()
    saved = json.loads(out.read_text())
    assert saved["constants"]["hbm_bandwidth"] == pytest.approx(2950.0)
    assert saved["fit"]["measured"]["hbm_bandwidth"] == pytest.approx(2950.0)
    assert saved["fit"]["replaced_measurements"] == {"copy_bandwidth_gbps": 2950.0}
    with pytest.raises(ValueError, match="not a device measurement"):
        fit_and_save([path], str(out), measured={"l2_bandwidth_gbps": 9000.0}, max_evals=5)
    with pytest.raises(ValueError, match="must be positive"):
        fit_and_save([path], str(out), measured={"copy_bandwidth_gbps": 0.0}, max_evals=5)
    # one "error:" line and exit status 2, as every bad argument
    assert main(["fit", "--measurements", path, "--out", str(out), "--measured",
                 "copy=fast"]) == 2
    assert "KEY=NUMBER" in capsys.readouterr().err


def test_fit_needs_an_output_path(tmp_path, capsys):
    path, _, _ = _synthetic(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--measurements", path])
    assert "--out" in capsys.readouterr().err


def test_bad_measurements_are_rejected(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"records": [{"workload": "8_64", "method": "pat"}]}))
    with pytest.raises(ValueError, match="lacks"):
        load_measurements(str(p))
    assert main(["calibration-report", "--measurements", str(p)]) == 2
    assert main(["calibration-report", "--measurements", str(tmp_path / "none.json")]) == 2


def test_order_score_counts_measured_ties_as_right():
    """The pat/query order score: a wrong order counts against the model unless the two
    measurements are within ORDER_TIE of each other (no faster one to predict)."""
    from sim.calibration import ORDER_TIE, _summary

    class _Sharing:
        def sharing(self, r):
            return True

    def pair(wl, meas_pat, meas_q):
        base = {"workload": wl, "page_size": 16, "num_qo_heads": 32, "num_kv_heads": 8,
                "head_dim": 128, "dtype": "float16", "timing": "graph", "file": "f"}
        return [dict(base, method="pat", measured_us=meas_pat),
                dict(base, method="query", measured_us=meas_q)]

    # predicted: pat faster everywhere
    recs = (pair("right", 90.0, 100.0) + pair("wrong", 110.0, 100.0)
            + pair("tie", 100.0 * (1 + ORDER_TIE / 2), 100.0)
            + pair("just past a tie", 100.0 * (1 + 2 * ORDER_TIE), 100.0))
    pred = np.array([90.0, 100.0] * 4)
    s = _summary(recs, pred, _Sharing())
    assert s["order_n"] == 4 and s["order_ties"] == 1
    assert s["order_ok"] == pytest.approx(2 / 4)
