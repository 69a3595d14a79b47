"""Calibration: fit the model constants to GPU measurements, and say how good the fit is.

``bench/calibrate.py`` (on a GPU) writes a measurements file::

    {"device": "NVIDIA H100 80GB HBM3", "gpu": "h100", "git_sha": "...", "versions": {...},
     "copy_bandwidth_gbps": 2950.0,            # optional: measured device-to-device copy
     "records": [{"workload": "1,16_2048,128", "method": "pat", "num_qo_heads": 32,
                  "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "dtype": "float16",
                  "measured_us": 21.4, "predicted_us": 17.1}, ...]}

:func:`fit` re-plans every record on the CPU (same planner, same packers), then searches the
constants that minimise the mean squared error of ``log(predicted / measured)`` with a
Nelder-Mead simplex over the logarithms of the constants (NumPy only; positivity comes free).
The measured copy bandwidth, when present, fixes ``hbm_bandwidth`` instead of fitting it.
:func:`report` gives the two numbers the simulator is judged by: Spearman rank correlation
between predicted and measured latency (target >= 0.9) and the median of
``|predicted / measured - 1|`` (target <= 20 %).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os

import numpy as np

from .constants import SimConstants, load_constants, save_constants
from .methods import load_batch, make_plan
from .model import predict, prepare

TARGET_SPEARMAN = 0.9
TARGET_MEDIAN_ERR = 0.20
DEFAULT_FIT = ("sm_bandwidth", "block_ns", "tile_ns", "sm_flops", "launch_ns", "gap_ns",
               "merge_slot_ns")


# ---------------------------------------------------------------------------- statistics
def rankdata(x) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (as ``scipy.stats.rankdata``)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.shape[0], dtype=np.float64)
    xs = x[order]
    i = 0
    n = x.shape[0]
    while i < n:
        j = i
        while j + 1 < n and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1.0
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    """Spearman rank correlation (Pearson correlation of the average ranks)."""
    ra, rb = rankdata(a), rankdata(b)
    if ra.shape[0] < 2:
        return float("nan")
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def nelder_mead(f, x0, step=0.3, max_evals: int = 400, tol: float = 1e-6):
    """Minimise ``f`` from ``x0`` with the Nelder-Mead simplex; returns ``(x, f(x), evals)``."""
    x0 = np.asarray(x0, dtype=np.float64)
    n = x0.shape[0]
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(vals)
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (abs(vals[0]) + tol):
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        evals += 1
        if fr < vals[0]:
            xe = centroid + 2.0 * (centroid - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:                                   # shrink towards the best point
                for i in range(1, n + 1):
                    pts[i] = pts[0] + 0.5 * (pts[i] - pts[0])
                    vals[i] = f(pts[i])
                    evals += 1
    best = int(np.argmin(vals))
    return pts[best], float(vals[best]), evals


# ---------------------------------------------------------------------------- measurements
def load_measurements(path: str) -> dict:
    with open(path) as fh:
        data = json.load(fh)
    recs = data.get("records")
    if not recs:
        raise ValueError(f"{path}: no records")
    need = {"workload", "method", "num_qo_heads", "num_kv_heads", "head_dim", "measured_us"}
    for i, r in enumerate(recs):
        missing = need - set(r)
        if missing:
            raise ValueError(f"{path}: record {i} lacks {sorted(missing)}")
    data["_path"] = path
    return data


def prepared_workloads(data: dict, gpu: str | None = None) -> list:
    """Plan every record on the CPU and lay it out for the timeline (constant-free)."""
    gpu = gpu or data.get("gpu", "h100")
    out = []
    batches = {}
    for r in data["records"]:
        key = (r["workload"], int(r.get("page_size", 16)))
        if key not in batches:
            batches[key] = load_batch(r["workload"], key[1])
        plan = make_plan(batches[key], r["method"], int(r["num_qo_heads"]),
                         int(r["num_kv_heads"]), int(r["head_dim"]), gpu=gpu,
                         kv_data_type=r.get("dtype", "float16"))
        out.append(prepare(plan, gpu))
    return out


def predict_all(workloads: list, c: SimConstants) -> np.ndarray:
    """Predicted latency (us) of every prepared workload."""
    return np.array([predict(w, c) / 1e3 for w in workloads])


def _records_measured(data: dict) -> np.ndarray:
    return np.array([float(r["measured_us"]) for r in data["records"]])


# ---------------------------------------------------------------------------- fit and report
def fit(data: dict, gpu: str | None = None, start: SimConstants | None = None,
        names=DEFAULT_FIT, max_evals: int = 400, workloads: list | None = None):
    """Fit constants ``names`` to ``data`` (see module docstring).

    Returns ``(constants, info)``; ``info`` holds the loss before and after, evaluations, and
    the report of the fitted constants.
    """
    gpu = gpu or data.get("gpu", "h100")
    wls = workloads if workloads is not None else prepared_workloads(data, gpu)
    meas = _records_measured(data)
    if np.any(meas <= 0):
        raise ValueError("measured_us must be positive")
    c0 = start or load_constants(gpu)
    bw = data.get("copy_bandwidth_gbps")
    if bw:
        c0 = c0.with_values(hbm_bandwidth=float(bw))
        names = tuple(n for n in names if n != "hbm_bandwidth")
    base = c0.as_dict()
    logm = np.log(meas)

    def consts(x):
        vals = dict(base)
        for n, v in zip(names, x):
            vals[n] = float(math.exp(v))
        return SimConstants(**vals, source=c0.source)

    def loss(x):
        p = predict_all(wls, consts(x))
        return float(np.mean((np.log(np.maximum(p, 1e-9)) - logm) ** 2))

    x0 = np.log([max(base[n], 1e-6) for n in names])
    loss0 = loss(x0)
    x, lbest, evals = nelder_mead(loss, x0, step=0.4, max_evals=max_evals)
    fitted = consts(x)
    src = data.get("_path", "measurements")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    fitted = fitted.with_values(source=f"fit to {os.path.basename(src)} "
                                       f"({data.get('device', 'unknown device')}, {stamp})")
    rep = report(data, fitted, workloads=wls)
    info = {"loss_before": loss0, "loss_after": lbest, "evaluations": evals,
            "fitted": list(names), "report": rep}
    return fitted, info


def report(data: dict, constants: SimConstants, gpu: str | None = None,
           workloads: list | None = None) -> dict:
    """Agreement between predictions under ``constants`` and the measurements."""
    gpu = gpu or data.get("gpu", "h100")
    wls = workloads if workloads is not None else prepared_workloads(data, gpu)
    meas = _records_measured(data)
    pred = predict_all(wls, constants)
    ratio = pred / meas
    err = np.abs(ratio - 1.0)
    rho = spearman(pred, meas)
    med = float(np.median(err))
    by_method = {}
    methods = [r["method"] for r in data["records"]]
    for m in sorted(set(methods)):
        sel = np.array([x == m for x in methods])
        by_method[m] = {"n": int(sel.sum()), "median_abs_err": float(np.median(err[sel])),
                        "median_ratio": float(np.median(ratio[sel]))}
    return {
        "n": int(meas.shape[0]), "spearman": rho, "median_abs_err": med,
        "median_ratio": float(np.median(ratio)), "max_abs_err": float(err.max()),
        "spearman_ok": bool(rho >= TARGET_SPEARMAN), "median_err_ok": bool(med <= TARGET_MEDIAN_ERR),
        "constants_source": constants.source, "by_method": by_method,
        "predicted_us": pred.tolist(), "measured_us": meas.tolist(),
    }


def format_report(rep: dict) -> str:
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    lines = [
        f"measurements: {rep['n']}   constants: {rep['constants_source']}",
        f"Spearman rank correlation (predicted vs measured): {rep['spearman']:.3f}  "
        f"(target >= {TARGET_SPEARMAN}: {ok(rep['spearman_ok'])})",
        f"median |predicted/measured - 1|: {100 * rep['median_abs_err']:.1f} %  "
        f"(target <= {100 * TARGET_MEDIAN_ERR:.0f} %: {ok(rep['median_err_ok'])})",
        f"median predicted/measured: {rep['median_ratio']:.3f}   worst |error|: "
        f"{100 * rep['max_abs_err']:.1f} %",
        "",
        f"{'method':<12} {'n':>4} {'median |err|':>13} {'median ratio':>13}",
    ]
    for m, v in rep["by_method"].items():
        lines.append(f"{m:<12} {v['n']:>4} {100 * v['median_abs_err']:>12.1f}% "
                     f"{v['median_ratio']:>13.3f}")
    return "\n".join(lines)


def fit_and_save(path: str, gpu: str | None = None, out: str | None = None,
                 max_evals: int = 400):
    """Fit to the measurements file ``path`` and write ``sim/data/<gpu>.json`` (or ``out``)."""
    data = load_measurements(path)
    gpu = gpu or data.get("gpu", "h100")
    consts, info = fit(data, gpu, max_evals=max_evals)
    rep = info["report"]
    extra = {"fit": {"measurements": os.path.basename(path),
                     "device": data.get("device"), "git_sha": data.get("git_sha"),
                     "n": rep["n"], "spearman": rep["spearman"],
                     "median_abs_err": rep["median_abs_err"], "fitted": info["fitted"],
                     "loss_before": info["loss_before"], "loss_after": info["loss_after"]}}
    written = save_constants(consts, gpu, out, extra=extra)
    return written, consts, info
