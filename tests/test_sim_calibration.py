"""Calibration fit and report on a synthetic measurements file made in the test (CPU only).

The "measurements" are the model's own predictions under known constants, times a little noise:
the fit must find constants that predict them again, and the report must say so.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim.calibration import (fit, load_measurements, nelder_mead, predict_all,
                             prepared_workloads, rankdata, report, spearman)
from sim.cli import main
from sim.constants import default_constants, load_constants

SPECS = ("1,8_512,64", "1,4,16_128,256,512", "32_300", "2,16_1024,32")
METHODS = ("pat", "query", "pat-serial")
HEADS = ((32, 8), (8, 8))


def _synthetic(tmp_path, noise=0.03, seed=0):
    true = default_constants("h100").with_values(sm_bandwidth=80.0, block_ns=2500.0,
                                                 launch_ns=2000.0, tile_ns=220.0)
    recs = [{"workload": w, "method": m, "num_qo_heads": hq, "num_kv_heads": hk,
             "head_dim": 128, "page_size": 16, "dtype": "float16", "measured_us": 1.0}
            for w in SPECS for m in METHODS for hq, hk in HEADS]
    data = {"device": "synthetic", "gpu": "h100", "records": recs}
    wls = prepared_workloads(data)
    rng = np.random.default_rng(seed)
    pred = predict_all(wls, true)
    for r, p in zip(recs, pred):
        r["measured_us"] = float(p * np.exp(rng.normal(0.0, noise)))
    path = tmp_path / "calibration_h100.json"
    path.write_text(json.dumps(data))
    return str(path), true, wls


def test_rank_statistics():
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=50), rng.normal(size=50)
    # Pearson on ranks, computed directly
    ra, rb = rankdata(a), rankdata(b)
    assert spearman(a, b) == pytest.approx(np.corrcoef(ra, rb)[0, 1])


def test_nelder_mead_finds_a_quadratic_minimum():
    x, fx, _ = nelder_mead(lambda v: float(((v - np.array([1.0, -2.0, 0.5])) ** 2).sum()),
                           np.zeros(3), step=0.5, max_evals=600, tol=1e-12)
    assert np.allclose(x, [1.0, -2.0, 0.5], atol=1e-3) and fx < 1e-6


def test_fit_recovers_synthetic_measurements(tmp_path):
    path, true, wls = _synthetic(tmp_path)
    data = load_measurements(path)
    before = report(data, default_constants("h100"), workloads=wls)
    consts, info = fit(data, "h100", max_evals=150, workloads=wls)
    after = info["report"]
    assert info["loss_after"] < info["loss_before"]
    assert after["median_abs_err"] < before["median_abs_err"]
    assert after["spearman"] >= 0.9 and after["median_abs_err"] <= 0.20
    assert after["spearman_ok"] and after["median_err_ok"]
    assert consts.source.startswith("fit to calibration_h100.json")


def test_fit_and_report_commands(tmp_path, capsys):
    path, _, _ = _synthetic(tmp_path)
    out = tmp_path / "h100.json"
    assert main(["fit", "--measurements", path, "--out", str(out), "--max-evals", "60"]) == 0
    saved = json.loads(out.read_text())
    assert saved["source"].startswith("fit to") and set(saved["constants"]) == set(
        default_constants("h100").as_dict())
    assert load_constants("h100", str(out)).source == saved["source"]
    capsys.readouterr()
    plot = tmp_path / "cal.png"
    assert main(["calibration-report", "--measurements", path, "--constants", str(out),
                 "--json", "--plot", str(plot)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n"] == len(SPECS) * len(METHODS) * len(HEADS)
    assert -1.0 <= rep["spearman"] <= 1.0 and rep["median_abs_err"] >= 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["calibration-report", "--measurements", path]) == 0
    text = capsys.readouterr().out
    assert "Spearman" in text and "median |predicted/measured - 1|" in text


def test_copy_bandwidth_fixes_hbm(tmp_path):
    path, _, wls = _synthetic(tmp_path)
    data = load_measurements(path)
    data["copy_bandwidth_gbps"] = 2500.0
    consts, info = fit(data, "h100", max_evals=20, workloads=wls)
    assert consts.hbm_bandwidth == 2500.0 and "hbm_bandwidth" not in info["fitted"]


def test_bad_measurements_are_rejected(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"records": [{"workload": "8_64", "method": "pat"}]}))
    with pytest.raises(ValueError, match="lacks"):
        load_measurements(str(p))
    assert main(["calibration-report", "--measurements", str(p)]) == 2
