"""Calibration: fit the model constants on one set of workloads, judge them on another.

Measurement files
-----------------
Two layouts are read (a path may also be a folder: every ``*.json`` in it, and in its
sub-folders, that has one of these layouts):

* ``bench/calibrate.py``::

    {"device": "NVIDIA H100 80GB HBM3", "gpu": "h100", "git_sha": "...",
     "copy_bandwidth_gbps": 2970.0,
     "split": {"fit": [...], "validation": [...]},          # optional, see below
     "records": [{"workload": "1,16_2048,128", "method": "pat", "num_qo_heads": 32,
                  "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "dtype": "float16",
                  "measured_eager_us": 21.4, "measured_graph_us": 15.0}, ...]}

  (older files hold one ``measured_us`` per record, timed eagerly; records of a method
  :data:`sim.methods.METHODS` no longer has, ``pat-serial``, are skipped);
* ``bench/compare.py``'s ``results.json``: ``{"benchmark": "compare", "rows": [{"workload",
  "heads": [32, 8], "page_size", "method", "latency_eager_us", "latency_graph_us"}, ...]}``
  (FlashInfer rows and rows that failed their check are skipped);
* ``bench/lab/graph_start.py``'s ``graph_start_<gpu>.json``: ``{"benchmark": "graph_start",
  "median_outside_us": 2.0, ...}``, no records: how long a graph replay of a step takes
  beyond its kernels' span, measured on fit-set workloads.  It fixes ``graph_start_ns``.

Every measurement becomes one record per timing mode (``"eager"``: ``run()`` from Python;
``"graph"``: a CUDA-graph replay of it).  Every record is priced as the CUDA backend's one
launch path runs its plan (:mod:`sim.model`), whatever path the run that measured it took:
the files measured before it (all of ``bench/results/`` before commit
34cb8de) ran forked or longest-first chained forward launches of one block per item.

Split by workload
-----------------
The unit of the split is the *workload*, the tree spec: every record of a tree (all head
configurations, page sizes, methods, timing modes and repetitions) is either in the fit set or in
the validation set, never both.  :func:`split_workloads` decides, first rule that applies:

1. an explicit list of validation workloads (``sim fit --validation``);
2. the ``split`` the measurement files carry (``bench/calibrate.py`` marks the workloads it
   added to be unlike the fit set as ``validation``);
3. otherwise, workloads in the order they first appear in the files, every second one (the 2nd,
   4th, ...) held out for validation.

Fit and report
--------------
:func:`fit` re-plans every fit-set record on the CPU (same planner, same packers), then minimises
the mean soft-L1 loss of ``log(predicted / measured)`` (scale :data:`LOSS_SCALE`: squared error
for small misses, linear for outliers such as a host-side hiccup) with SciPy's Nelder-Mead over
the logarithms of the constants.  The kernel constants are shared by both timing modes; each mode
has its own launch constants (``start_ns``/``launch_ns``/``gap_ns`` eager, ``graph_start_ns``/
``graph_launch_ns``/``graph_gap_ns`` graph).  The forward blocks' latency chain (``tile_lat_ns``,
:mod:`sim.model`) is fitted only when asked (``sim fit --latency-chain``, :data:`CHAIN_FIT`;
from :data:`START_GUESS_NS`); otherwise it stays at its value in the starting constants (0 in
the packaged ones: off).  Three constants are measured directly on the device
by ``bench/calibrate.py`` and, when the files hold them, fixed instead of fitted
(:data:`MEASURED`): the copy bandwidth (``hbm_bandwidth``), and from replayed graphs of empty
kernels the cost of one more forked launch (``graph_launch_ns``) and of a join of concurrent
launches (``graph_join_ns``, which is never fitted: it is 0 unless measured).  With a
``bench/lab/graph_start.py`` file among the measurements the graph start latency is fixed too:
``graph_start_ns`` = the replay time outside the kernels minus ``graph_launch_ns`` (the model
issues a step's first launch at ``graph_start_ns + graph_launch_ns``).  Fitted, it took 6.8 µs
(H100) and 8.1 µs (H200) where replays spend 2.0 and 1.3 µs outside their kernels: the fit
moves the forward time the model misses on small one-wave steps into the start.  The packaged
constants still fit it: pinned at the measurement, the fit moved that time into the phase gap
instead and was worse out of sample on both GPUs (bench/NOTES.md).  A free fit put
~6 us into the launch interval, where graph replays start forked launches ~1 us apart, and the
workloads it had not seen paid for it.  The L2 read bandwidth ``bench/calibrate.py`` also
records (``l2_bandwidth_gbps``: distinct lines streamed from L2) stays out of :data:`MEASURED`:
blocks that read the same page at about the same time get more than that (fixed at it, the fit
set's loss was 1.2-1.5x higher and ``query``'s re-reads were over-predicted by 1.2-1.4x;
bench/NOTES.md), so ``l2_bandwidth`` is fitted.
:func:`report` prints in-sample (fit workloads) and out-of-sample (all other workloads) numbers
side by side, per timing mode and per method: the median of ``|predicted / measured - 1|``,
Spearman rank correlation, and on sharing workloads the rate at which the faster of ``pat`` and
``query`` is predicted correctly.  Two measurements within :data:`ORDER_TIE` of each other have
no faster one (pat and query often make the very same plan, and then differ by the run's noise
alone), so either prediction counts as right there; the report says how many such ties it saw.
"""
from __future__ import annotations

import datetime as _dt
import glob
import json
import math
import os

import numpy as np
from scipy import optimize, stats


from .constants import TIMINGS, SimConstants, load_constants, save_constants
from .methods import METHODS, load_batch, make_plan
from .model import predict, prepare

TARGET_SPEARMAN = 0.95
TARGET_MEDIAN_ERR = 0.15
TARGET_ORDER = 0.95
LOSS_SCALE = 0.2
KERNEL_FIT = ("sm_bandwidth", "block_ns", "tile_ns", "sm_flops", "merge_slot_ns",
              "l2_bandwidth")
# Fitted only on request (``sim fit --latency-chain``): the forward blocks' latency chain
# (sim.model).  Refit with it on calibration_h100_v9.json / calibration_h200_v5.json it took
# 1.2 us (H100) / 0.75 us (H200) per tile and met no missed out-of-sample target (bench/NOTES.md),
# so the packaged constants keep it at 0 (off).
CHAIN_FIT = ("tile_lat_ns",)
# Fitted only on request (``sim fit --wg-flops``): the warpgroup tiles' own tensor-core rate
# (sim.model); fitted in the packaged H200 constants, 0 (off) in the H100 ones (bench/NOTES.md).
WG_FIT = ("wg_flops",)
TIMING_FIT = {"eager": ("start_ns", "launch_ns", "gap_ns"),
              "graph": ("graph_start_ns", "graph_launch_ns", "graph_gap_ns")}
DEFAULT_FIT = KERNEL_FIT + TIMING_FIT["eager"] + TIMING_FIT["graph"]
# measurement-file key -> the constant it fixes (units: GB/s == bytes/ns, ns)
MEASURED = {"copy_bandwidth_gbps": "hbm_bandwidth", "graph_launch_interval_ns": "graph_launch_ns",
            "graph_join_ns": "graph_join_ns"}
# Where a fit starts a start latency that is 0 in its starting constants (the search runs over
# logarithms, so it cannot leave 0).
START_GUESS_NS = 1000.0
# constants a fit starts from START_GUESS_NS when they are 0 (off) in its starting constants
GUESSED = ("start_ns", "graph_start_ns", "tile_lat_ns")


# ---------------------------------------------------------------------------- statistics
def spearman(a, b) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``); ``nan`` below 2 points."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape[0] < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(stats.spearmanr(a, b).statistic)


# ---------------------------------------------------------------------------- measurements
def run_spread(runs) -> float:
    """Interquartile range of repeated timings ``runs`` over their median (0 for fewer than
    4).  ``bench/calibrate.py`` times a record again above 10%; :func:`report` counts such
    records, since a plan timed alongside something else on the device reads slow and
    scattered (bench/NOTES.md)."""
    x = np.asarray(runs, dtype=np.float64)
    if x.size < 4:
        return 0.0
    q25, q50, q75 = np.percentile(x, [25, 50, 75])
    return float((q75 - q25) / q50) if q50 > 0 else float("inf")


def _records_calibrate(data: dict, src: str) -> list:
    need = {"workload", "method", "num_qo_heads", "num_kv_heads", "head_dim"}
    file_timing = "graph" if "graph" in str(data.get("timing", "")).lower() else "eager"
    out = []
    for i, r in enumerate(data["records"]):
        missing = need - set(r)
        if missing:
            raise ValueError(f"{src}: record {i} lacks {sorted(missing)}")
        if r["method"] not in METHODS:
            continue        # a method no longer modelled (pat-serial of older files)
        times = {}
        if "measured_eager_us" in r or "measured_graph_us" in r:
            for t in TIMINGS:
                if r.get(f"measured_{t}_us") is not None:
                    times[t] = float(r[f"measured_{t}_us"])
        elif "measured_us" in r:
            times[r.get("timing", file_timing)] = float(r["measured_us"])
        else:
            raise ValueError(f"{src}: record {i} lacks measured_us (or measured_eager_us / "
                             f"measured_graph_us)")
        for t, us in times.items():
            out.append({"workload": str(r["workload"]), "method": r["method"],
                        "num_qo_heads": int(r["num_qo_heads"]),
                        "num_kv_heads": int(r["num_kv_heads"]), "head_dim": int(r["head_dim"]),
                        "page_size": int(r.get("page_size", 16)),
                        "dtype": r.get("dtype", "float16"), "timing": t, "measured_us": us,
                        "spread": run_spread(r.get(f"runs_{t}_us") or ()),
                        "file": os.path.basename(src)})
    return out


def _records_compare(data: dict, src: str) -> list:
    out = []
    for r in data["rows"]:
        if r.get("method") not in METHODS or r.get("correct") is False or "error" in r:
            continue
        hq, hk = (int(x) for x in r["heads"])
        for t in TIMINGS:
            us = r.get(f"latency_{t}_us")
            if us is None:
                continue
            out.append({"workload": str(r["workload"]), "method": r["method"],
                        "num_qo_heads": hq, "num_kv_heads": hk,
                        "head_dim": int(data.get("head_dim", 128)),
                        "page_size": int(r.get("page_size", 16)),
                        "dtype": data.get("dtype", "float16"), "timing": t,
                        "measured_us": float(us),
                        "file": os.path.basename(src)})
    return out


def _measurement_files(path: str) -> list:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True))
        keep = []
        for f in found:
            try:
                with open(f) as fh:
                    d = json.load(fh)
            except (OSError, ValueError):
                continue
            if isinstance(d, dict) and ("records" in d or d.get("benchmark") in
                                        ("compare", "graph_start")):
                keep.append(f)
        if not keep:
            raise ValueError(f"{path}: no measurement files in this folder")
        return keep
    if not os.path.exists(path):
        raise FileNotFoundError(f"measurements: no such file or folder: {path}")
    return [path]


def load_measurements(paths) -> dict:
    """Read measurement files (a path, a folder, or a list of them) into one set.

    Returns ``{"records": [...], "files": [...], "device", "gpu", "git_sha": [...],
    "copy_bandwidth_gbps", "l2_bandwidth_gbps", "graph_launch_interval_ns", "graph_join_ns",
    "graph_outside_ns", "split"}`` (each
    device measurement the median over the files that hold it, else ``None``); each record has
    ``workload, method, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, timing,
    measured_us, file``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    files = [f for p in paths for f in _measurement_files(p)]
    recs, devices, shas, split = [], [], [], {"fit": [], "validation": []}
    measured = {k: [] for k in (*MEASURED, "l2_bandwidth_gbps", "graph_outside_ns")}
    gpu, starts = None, []
    for f in files:
        with open(f) as fh:
            try:
                data = json.load(fh)
            except ValueError as exc:       # name the file: a folder may hold many
                raise ValueError(f"{f}: not readable JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{f}: expected a JSON object (bench/calibrate.py or "
                             f"bench/compare.py output), got {type(data).__name__}")
        if data.get("benchmark") == "graph_start":
            if data.get("median_outside_us") is None:
                raise ValueError(f"{f}: a graph_start file without median_outside_us")
            starts.append((f, data.get("gpu"), float(data["median_outside_us"]) * 1e3,
                           (data.get("env") or {}).get("git_sha", "unknown")))
            continue
        if data.get("benchmark") == "compare" and "rows" in data:
            got = _records_compare(data, f)
            if data.get("copy_bandwidth"):
                measured["copy_bandwidth_gbps"].append(float(data["copy_bandwidth"]) / 1e9)
        elif data.get("records"):
            got = _records_calibrate(data, f)
            for k in ("copy_bandwidth_gbps", "l2_bandwidth_gbps"):
                if data.get(k):
                    measured[k].append(float(data[k]))
            gl = data.get("graph_launch") or {}
            for src, k in (("interval_ns", "graph_launch_interval_ns"), ("join_ns", "graph_join_ns")):
                if gl.get(src) is not None:
                    measured[k].append(float(gl[src]))
            for k in ("fit", "validation"):
                split[k] += [w for w in data.get("split", {}).get(k, []) if w not in split[k]]
        else:
            raise ValueError(f"{f}: no records (expected bench/calibrate.py or "
                             f"bench/compare.py output)")
        if not got:
            raise ValueError(f"{f}: no usable measurements")
        recs += got
        devices.append(data.get("device", "unknown device"))
        shas.append(data.get("git_sha", "unknown"))
        if data.get("gpu"):
            gpu = gpu or data["gpu"]
    if not recs:
        raise ValueError("measurements: no timed records (a graph_start file only fixes a "
                         "constant; it needs bench/calibrate.py or bench/compare.py output)")
    if any(r["measured_us"] <= 0 for r in recs):
        raise ValueError("measured times must be positive")
    if gpu is None:
        from pat_core.gpus import detect_gpu_name
        gpu = detect_gpu_name(devices[0])
    # graph start files: those of this GPU count; one of another GPU named on its own is an
    # error, one found in a folder beside this GPU's measurements is passed over
    for f, g, ns, sha in starts:
        if g not in (None, gpu):
            if f in paths:
                raise ValueError(f"{f}: a graph_start file of {g} among measurements of {gpu}")
            files.remove(f)                   # not used: not listed as a source either
            continue
        measured["graph_outside_ns"].append(ns)
        shas.append(sha)
    return {"records": recs, "files": files, "device": sorted(set(devices)),
            "gpu": gpu, "git_sha": sorted(set(shas)),
            **{k: float(np.median(v)) if v else None for k, v in measured.items()},
            "split": split if (split["fit"] or split["validation"]) else None}


def workloads_in_order(records) -> list:
    """Distinct workloads in the order they first appear."""
    seen = {}
    for r in records:
        seen.setdefault(r["workload"], None)
    return list(seen)


def split_workloads(records, validation=None, file_split: dict | None = None) -> dict:
    """``{"fit": [...], "validation": [...], "rule": str}``: disjoint lists of workloads.

    See the module docstring for the rules.  ``validation``: explicit validation workloads.
    """
    names = workloads_in_order(records)
    if validation is not None:
        validation = list(validation)
        unknown = [w for w in validation if w not in names]
        if unknown:
            raise ValueError(f"validation: workloads {unknown} are not in the measurements")
        val, rule = validation, "explicit --validation list"
    elif file_split and file_split.get("validation"):
        val = [w for w in names if w in file_split["validation"]]
        rule = "split recorded in the measurement files"
    else:
        val = names[1::2]
        rule = "every second workload in order of first appearance held out"
    fit_set = [w for w in names if w not in val]
    if not fit_set:
        raise ValueError("the split leaves no workload to fit on")
    assert not set(fit_set) & set(val)
    return {"fit": fit_set, "validation": [w for w in names if w in val], "rule": rule}


# run_spread above which a record's runs disagree: bench/calibrate.py times it again, report
# counts it.  On one H100 calibration one plan (the compute and node packers make
# the same one for 2,8,64_256,512,64 at 64:8) read 27.8 us with steady runs and 51.6 us with
# runs from 43 to 109 us (bench/NOTES.md): the second was not the plan alone.
UNSTEADY = 0.10
ORDER_TIE = 0.005    # pat and query measured within 0.5%: a tie (below a run's spread)


def _plan_key(r) -> tuple:
    return (r["workload"], r["page_size"], r["method"], r["num_qo_heads"], r["num_kv_heads"],
            r["head_dim"], r["dtype"])


class Prepared:
    """Constant-free layouts of the records' plans, made once and priced many times."""

    def __init__(self, records, gpu):
        self.gpu = gpu
        self.records = list(records)
        self.wl = {}
        batches = {}
        for r in self.records:
            key = _plan_key(r)
            if key in self.wl:
                continue
            bkey = (r["workload"], r["page_size"])
            if bkey not in batches:
                batches[bkey] = load_batch(r["workload"], r["page_size"])
            plan = make_plan(batches[bkey], r["method"], r["num_qo_heads"], r["num_kv_heads"],
                             r["head_dim"], gpu=gpu, kv_data_type=r["dtype"])
            self.wl[key] = prepare(plan, gpu)
        self._sharing = {}
        for (wl, ps) in batches:
            b = batches[(wl, ps)]
            self._sharing[(wl, ps)] = _is_sharing(b)

    def predict(self, records, c: SimConstants) -> np.ndarray:
        """Predicted latency (us) of every record (its plan, its timing mode)."""
        cache = {}
        out = np.empty(len(records))
        for i, r in enumerate(records):
            k = (_plan_key(r), r["timing"])
            if k not in cache:
                cache[k] = predict(self.wl[_plan_key(r)], c, r["timing"]) / 1e3
            out[i] = cache[k]
        return out

    def sharing(self, r) -> bool:
        return self._sharing[(r["workload"], r["page_size"])]


def _is_sharing(batch) -> bool:
    from pat_core.forest import PrefixForest
    from pat_core.inputs import BlockTable
    bt = batch.block_tables
    if isinstance(bt, np.ndarray):
        table = BlockTable.from_padded(bt, batch.seq_lens, batch.page_size)
    else:
        table = BlockTable.from_lists(bt, batch.seq_lens, batch.page_size)
    return PrefixForest(table).unique_tokens() < int(np.sum(batch.seq_lens, dtype=np.int64))


# ---------------------------------------------------------------------------- fit
def fit(data: dict, split: dict, gpu: str | None = None, start: SimConstants | None = None,
        names=DEFAULT_FIT, max_evals: int = 600, prepared: Prepared | None = None):
    """Fit constants ``names`` on the records of ``split["fit"]`` workloads (module docstring).

    Returns ``(constants, info)``; ``info`` holds the loss before and after, evaluations and the
    names fitted.  Launch constants of a timing mode with no fit records are left as they are.
    """
    gpu = gpu or data.get("gpu", "h100")
    recs = [r for r in data["records"] if r["workload"] in set(split["fit"])]
    if not recs:
        raise ValueError("no records in the fit set")
    prep = prepared or Prepared(recs, gpu)
    c0 = start or load_constants(gpu)
    names = tuple(names)
    fixed = {}
    for key, const in MEASURED.items():
        if data.get(key) and data[key] > 0:      # a cost measured within noise of 0 stays fitted
            fixed[const] = float(data[key])
            c0 = c0.with_values(**{const: fixed[const]})
            names = tuple(n for n in names if n != const)
    outside = data.get("graph_outside_ns")
    if outside is not None and "graph_start_ns" in names:
        if "graph_launch_ns" not in fixed:
            raise ValueError("a graph_start file fixes graph_start_ns from the measured graph "
                             "launch interval, which these measurements lack (bench/calibrate.py "
                             "records it)")
        # measured time outside the kernels = start + the first launch's issue interval
        fixed["graph_start_ns"] = max(0.0, float(outside) - float(c0.graph_launch_ns))
        c0 = c0.with_values(graph_start_ns=fixed["graph_start_ns"])
        names = tuple(n for n in names if n != "graph_start_ns")
    present = {r["timing"] for r in recs}
    for t, tn in TIMING_FIT.items():
        if t not in present:
            names = tuple(n for n in names if n not in tn)
    base = c0.as_dict()
    logm = np.log([r["measured_us"] for r in recs])

    def consts(x):
        vals = dict(base)
        for n, v in zip(names, x):
            vals[n] = float(math.exp(v))
        return SimConstants(**vals, source=c0.source)

    def loss(x):
        p = prep.predict(recs, consts(x))
        z = (np.log(np.maximum(p, 1e-9)) - logm) / LOSS_SCALE
        return float(np.mean(2.0 * (np.sqrt(1.0 + z * z) - 1.0))) * LOSS_SCALE ** 2

    # wg_flops off (0) starts at the common rate, sm_flops
    x0 = np.log([max(base[n], START_GUESS_NS if n in GUESSED else
                     base["sm_flops"] if n == "wg_flops" else 1e-6)
                 for n in names])
    loss0 = loss(x0)
    # Two starts, the better fit-set loss kept: the given constants, and the same with each
    # mode's launch interval cut to a fifth and its start latency raised to the old interval.
    # From constants fitted before the start latency existed (interval ~7 us carrying the
    # whole fixed cost) one search can stall halfway (H100, round-8 measurements: 5.3 us,
    # loss 0.0127, against 0.0121 from the second start).
    x1 = x0.copy()
    for t, (sn, ln, _) in TIMING_FIT.items():
        if sn in names and ln in names:
            i, j = names.index(sn), names.index(ln)
            launch = math.exp(x0[j])
            x1[i] = math.log(max(math.exp(x0[i]), launch))
            x1[j] = math.log(launch / 5.0)
    runs = []
    for xs in (x0, x1) if not np.array_equal(x0, x1) else (x0,):
        simplex = np.vstack([xs] + [xs + 0.4 * np.eye(len(names))[i] for i in range(len(names))])
        runs.append(optimize.minimize(loss, xs, method="Nelder-Mead",
                                      options={"maxfev": max_evals, "initial_simplex": simplex,
                                               "xatol": 1e-3, "fatol": 1e-7}))
    res = min(runs, key=lambda r: r.fun)       # the first on a tie, as before
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    files = ", ".join(os.path.basename(f) for f in data.get("files", [])) or "measurements"
    fitted = consts(res.x).with_values(
        source=f"fit to {files} ({'; '.join(data.get('device', ['unknown device']))}, {stamp}); "
               f"fit workloads: {len(split['fit'])}, validation workloads: "
               f"{len(split['validation'])}")
    info = {"loss_before": loss0, "loss_after": float(res.fun),
            "evaluations": int(sum(r.nfev for r in runs)), "fitted": list(names),
            "measured": fixed}
    return fitted, info


# ---------------------------------------------------------------------------- report
def _summary(recs, pred, prep: Prepared) -> dict:
    meas = np.array([r["measured_us"] for r in recs])
    if not recs:
        return {"n": 0}
    ratio = pred / meas
    err = np.abs(ratio - 1.0)
    out = {"n": len(recs), "median_abs_err": float(np.median(err)),
           "spearman": spearman(pred, meas), "median_ratio": float(np.median(ratio)),
           "max_abs_err": float(err.max())}
    # faster of pat and query, on sharing workloads
    by_cfg = {}
    for r, p, m in zip(recs, pred, meas):
        if r["method"] in ("pat", "query") and prep.sharing(r):
            key = (r["workload"], r["page_size"], r["num_qo_heads"], r["num_kv_heads"],
                   r["head_dim"], r["dtype"], r["timing"], r["file"])
            by_cfg.setdefault(key, {})[r["method"]] = (p, m)
    pairs = [v for v in by_cfg.values() if len(v) == 2]
    ties = [abs(v["pat"][1] / v["query"][1] - 1.0) <= ORDER_TIE for v in pairs]
    ok = [t or (v["pat"][0] < v["query"][0]) == (v["pat"][1] < v["query"][1])
          for v, t in zip(pairs, ties)]
    out["order_n"] = len(ok)
    out["order_ok"] = float(np.mean(ok)) if ok else float("nan")
    out["order_ties"] = int(sum(ties))
    # records whose repeated runs disagree (run_spread above UNSTEADY): scored as measured,
    # but counted, since they may not be measurements of the plan alone
    out["unsteady"] = int(sum(1 for r in recs if r.get("spread", 0.0) > UNSTEADY))
    return out


def report(data: dict, constants: SimConstants, fit_workloads=(), gpu: str | None = None,
           prepared: Prepared | None = None) -> dict:
    """In-sample (``fit_workloads``) and out-of-sample (every other workload) agreement.

    Returns ``{"in_sample": S, "out_of_sample": S, ...}``; each ``S`` maps timing mode ->
    ``{"all": summary, "by_method": {method: summary}}``, a summary holding ``n``,
    ``median_abs_err``, ``spearman``, ``median_ratio``, ``max_abs_err``, ``order_n`` and
    ``order_ok`` (share of sharing configurations whose faster of pat and query is predicted;
    measured ties, within :data:`ORDER_TIE`, count as right) and ``order_ties``.
    """
    gpu = gpu or data.get("gpu", "h100")
    recs = data["records"]
    prep = prepared or Prepared(recs, gpu)
    pred = prep.predict(recs, constants)
    fitw = set(fit_workloads)
    out = {"constants_source": constants.source, "device": data.get("device"),
           "git_sha": data.get("git_sha"),
           "files": [os.path.basename(f) for f in data.get("files", [])],
           "fit_workloads": [w for w in workloads_in_order(recs) if w in fitw],
           "validation_workloads": [w for w in workloads_in_order(recs) if w not in fitw]}
    for side, keep in (("in_sample", True), ("out_of_sample", False)):
        sec = {}
        for t in TIMINGS:
            idx = [i for i, r in enumerate(recs) if (r["workload"] in fitw) == keep
                   and r["timing"] == t]
            if not idx:
                continue
            sub = [recs[i] for i in idx]
            sec[t] = {"all": _summary(sub, pred[idx], prep), "by_method": {}}
            for m in sorted({r["method"] for r in sub}):
                j = [i for i in idx if recs[i]["method"] == m]
                sec[t]["by_method"][m] = _summary([recs[i] for i in j], pred[j], prep)
        out[side] = sec
    out["predicted_us"] = pred.tolist()
    out["measured_us"] = [r["measured_us"] for r in recs]
    out["in_fit_set"] = [r["workload"] in fitw for r in recs]
    out["labels"] = [f"{r['method']} ({r['timing']})" for r in recs]
    return out


def _cell(s: dict | None) -> str:
    if not s or not s.get("n"):
        return f"{'-':>5} {'-':>7} {'-':>6} {'-':>9}"
    order = "-" if not s.get("order_n") else f"{100 * s['order_ok']:.0f}%/{s['order_n']}"
    rho = "nan" if s["spearman"] != s["spearman"] else f"{s['spearman']:.3f}"
    return f"{s['n']:>5} {100 * s['median_abs_err']:>6.1f}% {rho:>6} {order:>9}"


def format_report(rep: dict) -> str:
    """Side-by-side text of :func:`report`: in-sample, then out-of-sample columns."""
    lines = [f"constants: {rep['constants_source']}",
             f"device: {'; '.join(rep['device'] or [])}   git sha: "
             f"{', '.join(s[:10] for s in rep['git_sha'] or [])}   files: "
             f"{', '.join(rep['files'])}",
             f"fit workloads ({len(rep['fit_workloads'])}): {'  '.join(rep['fit_workloads'])}",
             f"validation workloads ({len(rep['validation_workloads'])}): "
             f"{'  '.join(rep['validation_workloads'])}",
             f"targets out of sample (graph): median |pred/meas - 1| <= "
             f"{100 * TARGET_MEDIAN_ERR:.0f}%, Spearman >= {TARGET_SPEARMAN}, faster of pat/query "
             f"right on >= {100 * TARGET_ORDER:.0f}% of sharing configs",
             "",
             f"{'':<8}{'':<12} {'in sample (fit workloads)':^31} | "
             f"{'out of sample (validation workloads)':^31}",
             f"{'timing':<8}{'method':<12} " + " | ".join(
                 [f"{'n':>5} {'med|err|':>7} {'rho':>6} {'pat<>q':>9}"] * 2)]
    for t in TIMINGS:
        ins = rep.get("in_sample", {}).get(t)
        outs = rep.get("out_of_sample", {}).get(t)
        if not ins and not outs:
            continue
        lines.append(f"{t:<8}{'ALL':<12} {_cell(ins and ins['all'])} | "
                     f"{_cell(outs and outs['all'])}")
        methods = sorted(set((ins or {}).get("by_method", {})) |
                         set((outs or {}).get("by_method", {})))
        for m in methods:
            lines.append(f"{'':<8}{m:<12} {_cell((ins or {}).get('by_method', {}).get(m))} | "
                         f"{_cell((outs or {}).get('by_method', {}).get(m))}")
    lines.append("(med|err|: median |predicted/measured - 1|; rho: Spearman; pat<>q: faster of "
                 "pat and query predicted right / sharing configs, measured ties within "
                 f"{100 * ORDER_TIE:.1f}% counting as right)")
    ties = [f"{side} {t} {s['all'].get('order_ties', 0)}"
            for side, key in (("in sample", "in_sample"), ("out of sample", "out_of_sample"))
            for t, s in rep.get(key, {}).items() if s and s["all"].get("order_ties")]
    if ties:
        lines.append("measured pat/query ties: " + ", ".join(ties))
    unsteady = [f"{side} {t} {s['all']['unsteady']} of {s['all']['n']}"
                for side, key in (("in sample", "in_sample"), ("out of sample", "out_of_sample"))
                for t, s in rep.get(key, {}).items() if s and s["all"].get("unsteady")]
    if unsteady:
        lines.append(f"records whose runs spread more than {100 * UNSTEADY:.0f}% (interquartile "
                     f"range over median; scored as measured): " + ", ".join(unsteady))
    return "\n".join(lines)


def fit_and_save(paths, out: str, gpu: str | None = None, validation=None,
                 max_evals: int = 600, names=DEFAULT_FIT, measured: dict | None = None):
    """Load ``paths``, split by workload, fit, and write the constants to ``out``.

    ``out`` is required: the packaged constants change only when it names them.  ``measured``
    replaces device measurements of the files (keys of :data:`MEASURED`, e.g.
    ``{"copy_bandwidth_gbps": 2955.0}`` where a file's own copy measurement is an outlier); the
    written file records the replacement.  The file records the measurement files, device, git
    shas, the split and the in-/out-of-sample report.  Returns ``(path, constants, info,
    report)``.
    """
    if not out:
        raise ValueError("out: a path for the fitted constants is required")
    data = load_measurements(paths)
    measured = dict(measured or {})
    for k, v in measured.items():
        if k not in MEASURED:
            raise ValueError(f"measured: {k!r} is not a device measurement "
                             f"(one of {sorted(MEASURED)})")
        if not (float(v) > 0):
            raise ValueError(f"measured: {k} must be positive, got {v!r}")
        data[k] = float(v)
    gpu = gpu or data["gpu"]
    split = split_workloads(data["records"], validation, data.get("split"))
    prep = Prepared(data["records"], gpu)
    consts, info = fit(data, split, gpu, names=names, max_evals=max_evals, prepared=prep)
    rep = report(data, consts, split["fit"], gpu, prepared=prep)
    slim = {k: rep[k] for k in ("in_sample", "out_of_sample")}
    extra = {"fit": {"measurements": [os.path.basename(f) for f in data["files"]],
                     "device": data["device"], "git_sha": data["git_sha"],
                     "split": split, "fitted": info["fitted"], "measured": info["measured"],
                     "loss_before": info["loss_before"], "loss_after": info["loss_after"],
                     "evaluations": info["evaluations"], "report": slim,
                     **({"replaced_measurements": measured} if measured else {})}}
    written = save_constants(consts, gpu, out, extra=extra)
    return written, consts, info, rep


def fit_workloads_of(constants_path: str | None) -> list:
    """The fit-set workloads a constants file records (``[]`` when it records none)."""
    if not constants_path or not os.path.exists(constants_path):
        return []
    with open(constants_path) as fh:
        d = json.load(fh)
    fit_info = d.get("fit", {})
    split = fit_info.get("split") if isinstance(fit_info, dict) else None
    return list(split.get("fit", [])) if isinstance(split, dict) else []
