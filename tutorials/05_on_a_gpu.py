# %% [markdown]
# # 5. On a GPU
#
# **What you will learn**
#
# * how to run pat's CUDA kernels through the same `PrefixAttentionWrapper` you used on the CPU,
#   check them against dense attention and time them properly (CUDA events, warm-up, median);
# * how to read the project's current set of measurements when you have no GPU: which device
#   produced it, how pat compares with FlashInfer's decode kernel and with other prefix-aware
#   kernels, and how far each step is from the time its bytes alone would take;
# * how the simulator's predictions (tutorial 4) line up with those measurements.
#
# The notebook looks for a GPU first. With one (and CuPy installed: `pip install -e ".[gpu]"`),
# it runs the kernels. With or without one, it then reads the measured set committed with the
# project (`bench/results/one_path_h100/`, next to a checkout). Without a GPU and without that
# set there is nothing to show, and the notebook stops with an error that says so.

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter

import pat_core
import sim
from pat_core.gpus import detect_gpu_name
from pat_core.workloads import build_tree_batch


def gpu_available() -> bool:
    """True when pat's CUDA backend can run here (CuPy imports and a device is visible)."""
    if os.environ.get("PAT_TUTORIAL_FORCE_CPU"):      # lets the test suite take the CPU path
        return False
    try:
        from pat_core import cuda_backend
    except Exception as e:                           # a build without the CUDA backend
        print(f"CUDA backend not importable: {e}")
        return False
    return bool(cuda_backend.is_available())


HAVE_GPU = gpu_available()
print("GPU available:", HAVE_GPU)

# %% [markdown]
# ## Running the kernels
#
# On a GPU the wrapper takes CuPy arrays (or torch CUDA tensors) and launches on the caller's
# current stream. Every plan takes the same path: one forward launch per tile shape the plan
# uses, tallest tile first, then the merge kernel for the requests that have several partial
# results (tutorial 3). On Hopper each forward launch is a programmatic dependent of the one
# before it, so its blocks start as SMs free up; on older GPUs the launches run one after
# another. The first `run` of each tile shape compiles its kernel (NVRTC, cached afterwards),
# so we warm up before timing.
#
# We time a decode step twice, as the median of 20 runs between CUDA events: called from
# Python (`run()`, *eager*), and replayed from a CUDA graph captured around one `run()`, the
# way a serving loop runs its decode step. Eager calls pay the host's cost of every launch and
# of the Python call itself, and on a step this short that cost can exceed the kernels' own
# time; the replay pays only the GPU's gaps between kernels. Next to each, the simulator's
# prediction in the same mode (`timing="eager"` or `"graph"`, tutorial 4). Its eager mode adds
# a fixed host cost per launch, while the Python side of a call depends on the host, so an
# eager measurement can sit well above its prediction; the graph replay is the number to
# compare with the simulator and with the committed measurements below.
#
# The batch is tutorial 4's running example: one 1,024-token prompt, four 256-token documents,
# 16 requests with 1,024 tokens each of their own; 32 query heads over 8 KV heads, head_dim 128,
# fp16. We run it with the query-centric packer and with pat.

# %%
SPEC, HQ, HK, D, PS = "1,4,16_1024,256,1024", 32, 8, 128, 16
ITERS = 20


def time_gpu(fn, stream, iters=ITERS, warmup=3):
    """Median microseconds of fn() between CUDA events on ``stream``."""
    import cupy as cp
    with stream:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


measured_here = {}
if HAVE_GPU:
    import cupy as cp

    dev_name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("device:", dev_name)
    batch = build_tree_batch(SPEC, page_size=PS)
    rng = np.random.default_rng(0)
    k_host = rng.standard_normal((batch.num_pages, PS, HK, D)).astype(np.float16)
    v_host = rng.standard_normal((batch.num_pages, PS, HK, D)).astype(np.float16)
    q_host = rng.standard_normal((batch.batch_size, HQ, D)).astype(np.float16)
    k, v, q = cp.asarray(k_host), cp.asarray(v_host), cp.asarray(q_host)
    out = cp.empty_like(q)
    ref = pat_core.dense_attention(q_host, (k_host, v_host), batch.block_tables, batch.seq_lens,
                                   PS)
    stream = cp.cuda.Stream(non_blocking=True)       # capture needs a stream of its own
    for packer in ("query", "pat"):
        w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer)
        with stream:
            plan = w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS)
            w.run(q, (k, v), out=out)                # warm-up: compiles, builds the launches
            stream.synchronize()
            err = np.linalg.norm(cp.asnumpy(out).astype(np.float64) - ref) / np.linalg.norm(ref)
            eager_us = time_gpu(lambda: w.run(q, (k, v), out=out), stream)
            stream.begin_capture()
            w.run(q, (k, v), out=out)
            graph = stream.end_capture()
            graph_us = time_gpu(lambda: graph.launch(stream), stream)
        measured_here[packer] = {
            "eager": (eager_us, sim.simulate(plan, timing="eager").latency_us),
            "graph": (graph_us, sim.simulate(plan, timing="graph").latency_us)}
        for mode, (meas, pred) in measured_here[packer].items():
            print(f"{packer:>6} {mode:>5}: {meas:7.1f} us measured, {pred:7.1f} us predicted")
        print(f"        relative error vs float64 {err:.1e}, {plan.num_ctas} CTAs, "
              f"tiles {plan.stats()['tiles']}")
        assert err < 1e-2, f"{packer}: the kernel's output is wrong (relative error {err:.1e})"

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{p}\n{m}" for p in measured_here for m in ("eager", "graph")]
    vals = [measured_here[p][m] for p in measured_here for m in ("eager", "graph")]
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [mv[0] for mv in vals], width=0.4, label="measured")
    ax.bar(x + 0.2, [mv[1] for mv in vals], width=0.4, label="sim prediction")
    ax.set_xticks(x, labels)
    ax.set_ylabel("latency (us)")
    ax.set_title(f"{SPEC} on {dev_name}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
else:
    print("No GPU here: skipped the live run (kernels, timings and their figure). "
          "The rest of the notebook reads committed measurements.")

# %% [markdown]
# These timings include no L2 flush, so they flatter the kernels: the H100's L2 cache holds a
# large part of this batch's KV cache (the cell below computes both sizes), and repeated runs
# find those pages still cached, where a real decode step reads them from HBM. The benchmark
# behind the committed numbers (`bench/compare.py`) flushes the L2 before every timed run by
# reading a buffer larger than the L2, and records that in its results (`l2_flush`).

# %%
b = build_tree_batch(SPEC, page_size=PS)
pages = len({int(p) for row in b.block_tables for p in row})
kv_mb = pages * PS * HK * D * 2 * 2 / 1e6           # K and V, fp16
l2_mb = pat_core.get_gpu("h100").l2_bytes / 1e6
print(f"{SPEC}: {pages} distinct pages, {kv_mb:.0f} MB of K and V; H100 L2: {l2_mb:.0f} MB")
assert l2_mb < kv_mb < 2 * l2_mb                      # "a large part" of it fits

# %% [markdown]
# ## The measured set
#
# The project keeps one current set of measurements per GPU, written by the benchmark scripts
# with the device name, the git commit and the library versions in every file. The cell below
# looks for it next to a checkout (or in the folder named by the environment variable
# `PAT_BENCH_RESULTS`) and keeps the `bench/compare.py` results: one row per (batch, method)
# with the median latency of a CUDA-graph replay and the batch's *floor*, the time its distinct
# bytes (KV read once, queries, outputs) take at the GPU's measured copy bandwidth.

# %%
CURRENT_SETS = ("one_path_h100", "one_path_h200")


def results_dirs():
    """The folders holding the current measured sets: ``PAT_BENCH_RESULTS`` if set, else the
    ``bench/results/`` of a checkout (the package's own, or above the working directory)."""
    env = os.environ.get("PAT_BENCH_RESULTS")
    if env:
        return [Path(env)]
    roots = [Path(pat_core.__file__).resolve().parent.parent, Path.cwd().parent, Path.cwd()]
    for root in roots:
        found = [root / "bench" / "results" / s for s in CURRENT_SETS]
        found = [f for f in found if f.is_dir()]
        if found:
            return found
    return []


def load_compare(folders):
    """Every ``bench/compare.py`` result (``"benchmark": "compare"``) in ``folders``."""
    out = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("benchmark") == "compare" and data.get("rows"):
                data["path"] = path
                out.append(data)
    return out


def committed(res):
    """Whether ``res`` is the committed H100 set, the one the text below describes."""
    return res["path"].parent.name == "one_path_h100" and res["path"].name == "baselines.json"


folders = results_dirs()
results = load_compare(folders)
if not results:
    where = ", ".join(str(f) for f in folders) or "no bench/results/ folder found"
    msg = (f"No measured set found ({where}). Run this notebook from the tutorials/ folder of "
           f"a checkout, or set PAT_BENCH_RESULTS to a folder holding a bench/compare.py result.")
    if not HAVE_GPU:
        raise FileNotFoundError(msg + " Without a GPU there is nothing else to show.")
    print("Skipped the rest of this notebook: " + msg)
for res in results:
    methods = sorted({r["method"] for r in res["rows"]})
    print(f"{res['path'].parent.name}/{res['path'].name}: measured on {res['device']} "
          f"(git {str(res.get('git_sha', 'unknown'))[:10]}, L2 flush "
          f"{res.get('l2_flush', 'not recorded')}), head_dim {res.get('head_dim')}, "
          f"{len(res['rows'])} rows, methods {methods}")

# %% [markdown]
# For every batch of a result: the speed-up of pat over each other method (left), and every
# method's latency over the batch's floor (right; 1 is the floor itself). The batches are tree
# specs (tutorial 1); `128_2048` shares nothing. The other methods are FlashInfer's decode
# kernel (`fi-decode`, one request at a time: the query-centric baseline), FlashInfer's cascade
# kernel (`fi-cascade`, level by level) and FastTree's kernel (`fasttree`). A missing bar is a
# batch that method skipped (FastTree runs single-root trees only) or got wrong (the file
# records `correct` for each row).

# %%
def table(res):
    """{(workload, method): row} of the rows with a latency, and the workloads in file order."""
    rows = {(r["workload"], r["method"]): r for r in res["rows"]
            if r.get("latency_us") is not None and r.get("correct", True)}
    return rows, list(dict.fromkeys(r["workload"] for r in res["rows"]))


def shares_prefix(spec):
    """Whether a tree spec has a level above its leaves (some tokens are shared)."""
    return "," in spec.split("_")[0]


def log_axis(ax, ticks):
    """A log-scale x axis labelled at ``ticks`` only."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])


def plot_result(res):
    rows, workloads = table(res)
    others = [m for m in dict.fromkeys(r["method"] for r in res["rows"]) if m != "pat"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.32 * len(workloads) + 1.8), sharey=True)
    y = np.arange(len(workloads))
    h = 0.8 / len(others)
    for i, m in enumerate(others):
        sp = [rows[(wl, m)]["latency_us"] / rows[(wl, "pat")]["latency_us"]
              if (wl, m) in rows and (wl, "pat") in rows else np.nan for wl in workloads]
        ax.barh(y + (i - (len(others) - 1) / 2) * h, sp, height=h, label=f"over {m}",
                color=f"C{i + 1}")
    ax.axvline(1.0, color="black", lw=0.8)
    log_axis(ax, [0.5, 1, 2, 4, 8, 16])
    ax.set_xlim(0.5, 16)                             # room for the legend on the right
    ax.set_xlabel("speed-up of pat (measured latency ratio)")
    ax.legend(fontsize=8, loc="upper right")
    h2 = 0.8 / (len(others) + 1)
    for i, m in enumerate(["pat"] + others):
        ratio = [rows[(wl, m)]["latency_us"] / rows[(wl, m)]["floor_us"]
                 if (wl, m) in rows else np.nan for wl in workloads]
        bx.barh(y + (i - len(others) / 2) * h2, ratio, height=h2, label=m, color=f"C{i}")
    bx.axvline(1.0, color="black", lw=0.8)
    log_axis(bx, [1, 2, 5, 10, 20, 50])
    bx.set_xlabel("latency / floor (distinct bytes at copy bandwidth)")
    bx.legend(fontsize=8, loc="upper right")
    ax.set_yticks(y, workloads, fontsize=8)
    ax.invert_yaxis()
    fig.suptitle(f"measured on {res['device']}, head_dim {res.get('head_dim')}, heads "
                 f"{':'.join(map(str, res['rows'][0]['heads']))} "
                 f"({res['path'].parent.name}/{res['path'].name})", fontsize=10)
    fig.tight_layout()
    plt.show()


for res in results:
    plot_result(res)

# %% [markdown]
# What the committed H100 set says (the cell below computes each statement from the file and
# checks it; on another set it only prints the numbers):
#
# * On every batch that shares a prefix pat is faster than FlashInfer decode, by up to 3.8x
#   (`1,64_4096,64`: a 4,096-token prompt shared by 64 requests, each with 64 tokens of its
#   own). The gain shrinks when a request's own tokens dwarf what it shares:
#   `1,32,256_64,64,1024` (128 shared tokens, 1,024 private ones per request) gains under 1%.
# * Where nothing is shared both kernels read the same bytes, and they land between 0.99x and
#   1.14x of each other.
# * On the large steps (a floor above 250 us) pat runs within 10% of the floor: there is
#   little left to gain. On small steps fixed costs dominate: `1_512` reads 0.7 us worth of
#   bytes and takes about 13 us (launch, pipeline fill, the latency of the first loads).

# %%
def statements(res):
    """The numbers behind the statements above, for one result."""
    rows, workloads = table(res)
    fi = {wl: rows[(wl, "fi-decode")]["latency_us"] / rows[(wl, "pat")]["latency_us"]
          for wl in workloads if (wl, "fi-decode") in rows and (wl, "pat") in rows}
    shared = {wl: s for wl, s in fi.items() if shares_prefix(wl)}
    alone = {wl: s for wl, s in fi.items() if not shares_prefix(wl)}
    over = {wl: rows[(wl, "pat")]["latency_us"] / rows[(wl, "pat")]["floor_us"]
            for wl in workloads if (wl, "pat") in rows}
    big = {wl: o for wl, o in over.items() if rows[(wl, "pat")]["floor_us"] > 250}
    best = max(shared, key=shared.get) if shared else None

    def span(d, fmt=".2f"):
        return f"{min(d.values()):{fmt}}x to {max(d.values()):{fmt}}x" if d else "none"

    print(f"sharing batches: pat over fi-decode {span(shared, '.3f')} (largest on {best})")
    print(f"no sharing: {span(alone)}")
    print(f"floor above 250 us: pat at {span(big)} of the floor on {sorted(big)}")
    for wl in ("1_512", "1,32,256_64,64,1024"):
        if (wl, "pat") in rows:
            r = rows[(wl, "pat")]
            print(f"{wl}: pat {r['latency_us']:.1f} us, floor {r['floor_us']:.2f} us, "
                  f"{fi.get(wl, float('nan')):.3f}x over fi-decode")
    return rows, shared, alone, big, best


for res in results:
    rows, shared, alone, big, best = statements(res)
    if not committed(res):
        print(f"({res['path'].name} is not the committed H100 set: statements not checked)")
        continue
    assert min(shared.values()) > 1 and best == "1,64_4096,64"
    assert round(shared[best], 1) == 3.8
    assert 1 < shared["1,32,256_64,64,1024"] < 1.01
    assert (round(min(alone.values()), 2), round(max(alone.values()), 2)) == (0.99, 1.14)
    assert len(big) >= 3 and max(big.values()) < 1.10
    r = rows[("1_512", "pat")]
    assert round(r["floor_us"], 1) == 0.7 and round(r["latency_us"]) == 13

# %% [markdown]
# ## Does the simulator agree?
#
# Tutorial 4's predictions are only useful if they rank plans the way the hardware does. For
# every batch of the set we plan pat's run of it for the same GPU model, head counts and page
# size, and ask `sim.simulate` for its prediction (graph mode, as the measurements were
# taken). Points on the diagonal are perfect predictions; for choosing between plans the order
# of the points matters most.

# %%
def sim_vs_measured(res):
    gpu = detect_gpu_name(res["device"])
    rows, workloads = table(res)
    pts = []
    for wl in workloads:
        r = rows.get((wl, "pat"))
        if r is None:
            continue
        hq, hk = r["heads"]
        b = build_tree_batch(wl, page_size=r["page_size"])
        plan = pat_core.Planner("pat", gpu).plan(b.block_tables, b.seq_lens, hq, hk,
                                                 int(res["head_dim"]), r["page_size"])
        s = sim.simulate(plan)
        pts.append((wl, r["latency_us"], s.latency_us, s.constants.source))
    return gpu, pts


for res in results:
    gpu, pts = sim_vs_measured(res)
    meas = np.array([p[1] for p in pts])
    pred = np.array([p[2] for p in pts])
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    ax.scatter(meas, pred, s=16, c=["C0" if shares_prefix(p[0]) else "C1" for p in pts])
    lo, hi = min(meas.min(), pred.min()) * 0.8, max(meas.max(), pred.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"pat measured on {res['device']} (us)")
    ax.set_ylabel("sim prediction (us)")
    ax.set_title("blue: batches that share a prefix; orange: no sharing", fontsize=9)
    fig.tight_layout()
    plt.show()
    ratio = pred / meas
    rank = np.corrcoef(np.argsort(np.argsort(meas)), np.argsort(np.argsort(pred)))[0, 1]
    print(f"sim constants: {pts[0][3]}")
    print(f"{res['device']}: prediction / measurement median {np.median(ratio):.2f} "
          f"(range {ratio.min():.2f}-{ratio.max():.2f}), rank correlation {rank:.2f} over "
          f"{len(pts)} batches")
    if committed(res):                                 # the statement below
        assert len(pts) >= 10 and 0.8 < ratio.min() and ratio.max() < 1.2 and rank > 0.95

# %% [markdown]
# On the committed H100 set every prediction lies within 20% of its measurement, and the
# predictions order the batches nearly as the GPU does (rank correlation above 0.95; the cell
# checks both). If the constants
# line above says "default estimate", the simulator has not been calibrated on that GPU yet:
# the absolute numbers can then be off by a constant factor while the ranking stays
# informative. `python -m sim fit --measurements <file>` fits the constants to a calibration
# run and `python -m sim calibration-report` says how far the predictions are from the
# measurements.
#
# **Where to go from here.** Run `python -m pat_core demo --backend cuda` on your GPU, try your
# own block tables through `PrefixAttentionWrapper(backend="cuda")`, and measure a set of your
# own with `bench/compare.py`; this notebook reads it when `PAT_BENCH_RESULTS` names its
# folder.
