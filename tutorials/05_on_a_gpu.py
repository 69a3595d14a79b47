# %% [markdown]
# # 5. On a GPU
#
# **What you will learn**
#
# * how to run pat's CUDA kernels through the same `PrefixAttentionWrapper` you used on the CPU,
#   check them against dense attention and time them properly (CUDA events, warm-up, median);
# * how to read the project's committed benchmark results when you have no GPU, and which device
#   produced them;
# * how the simulator's predictions (tutorial 4) line up with measurements.
#
# The notebook looks for a GPU first. With one (and CuPy installed: `pip install -e ".[gpu]"`),
# it runs the kernels; without one, it plots the measurements stored in `bench/results/`. Either
# way every cell runs.

# %%
import glob
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import ScalarFormatter

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
# current stream: one forward kernel per tile shape, tallest first (on Hopper chained on that
# stream, each a programmatic dependent of the one before; on older GPUs one after another), then
# the merge kernel for the requests of several partials (none when every request has one CTA
# and no block drew a second work item). The first `run` of each tile shape compiles it (NVRTC, cached afterwards), so we warm
# up before timing. Each timing is the median of 20 runs between CUDA events.
#
# The batch is the README's: one 128-token prompt, four 256-token documents, 16 requests with
# 1,024 tokens each; 32 query heads over 8 KV heads, head_dim 128, fp16.

# %%
def time_gpu(fn, iters=20, warmup=3):
    """Median milliseconds of fn() between CUDA events on the current stream."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


measured_here = {}
if HAVE_GPU:
    import cupy as cp

    dev_name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("device:", dev_name)
    spec, HQ, HK, D, PS = "1,4,16_128,256,1024", 32, 8, 128, 16
    batch = build_tree_batch(spec, page_size=PS)
    rng = np.random.default_rng(0)
    k_host = rng.standard_normal((batch.num_pages, PS, HK, D)).astype(np.float16)
    v_host = rng.standard_normal((batch.num_pages, PS, HK, D)).astype(np.float16)
    q_host = rng.standard_normal((batch.batch_size, HQ, D)).astype(np.float16)
    k, v, q = cp.asarray(k_host), cp.asarray(v_host), cp.asarray(q_host)
    ref = pat_core.dense_attention(q_host, (k_host, v_host), batch.block_tables, batch.seq_lens,
                                   PS)
    for packer in ("query", "node", "pat"):
        w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer)
        plan = w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS)
        out = cp.asnumpy(w.run(q, (k, v))).astype(np.float64)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        ms = time_gpu(lambda: w.run(q, (k, v)))
        pred = sim.simulate(plan).latency_us
        measured_here[packer] = (ms * 1e3, pred)
        print(f"{packer:>6}: {ms * 1e3:8.1f} us measured, {pred:8.1f} us predicted by sim, "
              f"relative error vs float64 {err:.1e}, {plan.num_ctas} CTAs, "
              f"tiles {plan.stats()['tiles']}")
else:
    print("No GPU here: skipping the live run. The next cells plot committed measurements.")

# %%
if measured_here:
    names = list(measured_here)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [measured_here[n][0] for n in names], width=0.4, label="measured")
    ax.bar(x + 0.2, [measured_here[n][1] for n in names], width=0.4, label="sim prediction")
    ax.set_xticks(x, names)
    ax.set_ylabel("latency (us)")
    ax.set_title(f"{spec} on {dev_name}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Note that the timings above include no L2 flush: the KV cache of this batch fits in an H100's
# 50 MB L2, so repeated runs partly read from cache and look faster than a cold decode step. The
# benchmark scripts in `bench/` flush the L2 between runs; trust those numbers over these.
# How they flush matters too: overwriting a buffer larger than L2 leaves it full of modified
# lines whose write-back the next run pays (up to ~10 us on a step that reads 67 MB), so since
# round 20 they read the buffer instead (`PAT_L2_FLUSH=clean`; `dirty` for the old way), and
# every results file records which (`l2_flush`; files without the field used `dirty`).
#
# ## Committed measurements
#
# The benchmarks write JSON files to `bench/results/`, with the device name, the git commit and
# the library versions in every file. The cell below finds them (next to a checkout; set
# `PAT_BENCH_RESULTS` to point elsewhere) and keeps the ones that hold per-method latencies.

# %%
def results_dir():
    env = os.environ.get("PAT_BENCH_RESULTS")
    if env:
        return Path(env)
    for cand in (Path.cwd().parent / "bench" / "results", Path.cwd() / "bench" / "results"):
        if cand.is_dir():
            return cand
    return None


def load_results(folder):
    """Benchmark files with a device and rows of (workload, heads, method, latency)."""
    found = []
    if folder is None:
        return found
    for path in sorted(glob.glob(str(folder / "**" / "*.json"), recursive=True)):
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        device = data.get("device") or (data.get("env") or {}).get("device")
        rows = []
        for r in data.get("rows", []):
            if not isinstance(r, dict):
                continue
            lat = r.get("latency_us", r.get("time_us"))
            method = r.get("method", r.get("packer"))
            if lat is None or method is None or "workload" not in r:
                continue
            heads = r.get("heads", "")
            heads = ":".join(map(str, heads)) if isinstance(heads, (list, tuple)) else str(heads)
            rows.append(dict(workload=r["workload"], heads=heads, method=method,
                             latency_us=float(lat), page_size=r.get("page_size")))
        if device and rows:
            sha = data.get("git_sha") or (data.get("env") or {}).get("git_sha") or "unknown"
            found.append(dict(path=path, device=device, git_sha=str(sha), rows=rows,
                              head_dim=(data.get("method") or {}).get("head_dim",
                                                                      data.get("head_dim", 128))))
    return found


folder = results_dir()
results = load_results(folder)
if not results:
    print(f"No GPU benchmark results found (looked in {folder}). Run bench/gpu_kernels.py or "
          "bench/compare.py on a GPU to produce some; the plots below are skipped.")
for res in results:
    methods = sorted({r["method"] for r in res["rows"]})
    print(f"{os.path.basename(res['path'])}: measured on {res['device']} "
          f"(git {res['git_sha'][:10]}), {len(res['rows'])} rows, methods {methods}")

# %% [markdown]
# For each results file: the measured speed-up of every method over the query-centric plan, per
# workload and head configuration (the workloads are the tree specs of tutorial 1). On the
# no-sharing batches `128_2048` and `256_4096` pat and query make the same plan, so pat sits
# within 7% of 1; a batch whose requests each hold far more tokens of their own than they share,
# such as `1,32,256_64,64,1024`, gains little (at most 1.3x). The cell after the plots checks
# both statements on every committed `bench/compare.py` result (`results.json` in a `compare*`
# folder; the other files mix forced-tile sweeps into their rows).

# %%
def plot_speedups(res):
    rows = res["rows"]
    keys = sorted({(r["workload"], r["heads"]) for r in rows})
    by = {(r["workload"], r["heads"], r["method"]): r["latency_us"] for r in rows}
    methods = [m for m in sorted({r["method"] for r in rows}) if m != "query"]
    if not any((wl, h, "query") in by for wl, h in keys):
        print(f"{os.path.basename(res['path'])}: no query baseline, nothing to compare")
        return
    workloads = sorted({wl for wl, _ in keys})
    heads = sorted({h for _, h in keys})
    fig, axes = plt.subplots(1, len(methods), figsize=(max(8, 0.9 * len(workloads) + 3) *
                                                         len(methods), 4.2), squeeze=False)
    for ax, m in zip(axes[0], methods):
        w = 0.8 / len(heads)
        for i, h in enumerate(heads):
            ys = [by[(wl, h, "query")] / by[(wl, h, m)]
                  if (wl, h, m) in by and (wl, h, "query") in by else np.nan for wl in workloads]
            ax.bar(np.arange(len(workloads)) + (i - (len(heads) - 1) / 2) * w, ys, width=w,
                   label=f"heads {h}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(workloads)), workloads, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(f"speed-up of {m} over query")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"measured on {res['device']} (git {res['git_sha'][:10]}, "
                 f"{os.path.basename(res['path'])})", fontsize=10)
    fig.tight_layout()
    plt.show()


for res in results:
    plot_speedups(res)

# the statements above, on every committed bench/compare.py result
checked = 0
for res in results:
    if not (os.path.basename(res["path"]) == "results.json"
            and os.path.basename(os.path.dirname(res["path"])).startswith("compare")):
        continue
    by = {(r["workload"], r["heads"], r["page_size"], r["method"]): r["latency_us"]
          for r in res["rows"]}
    for (wl, h, ps, m), t in by.items():
        q = by.get((wl, h, ps, "query"))
        if m != "pat" or q is None or wl not in ("128_2048", "256_4096", "1,32,256_64,64,1024"):
            continue
        lo, hi = (0.93, 1.07) if "," not in wl else (0.9, 1.3)
        assert lo <= q / t <= hi, (res["path"], wl, h, ps, q / t)
        checked += 1
print(f"checked {checked} (workload, heads, page size) pairs")

# %% [markdown]
# ## Does the simulator agree?
#
# Tutorial 4's predictions are only useful if they rank plans the way the hardware does. For
# every measured (workload, heads, packer) we plan the same batch for the same GPU model and ask
# `sim.simulate` for its prediction. Points on the diagonal are perfect predictions; what matters
# most for choosing plans is that the order of the points is right.

# %%
def sim_vs_measured(res, max_rows=80):
    gpu = detect_gpu_name(res["device"])
    pts = []
    for r in res["rows"][:max_rows]:
        if r["method"] not in pat_core.PACKERS or ":" not in r["heads"]:
            continue
        hq, hk = (int(x) for x in r["heads"].split(":"))
        ps = int(r.get("page_size") or 16)
        b = build_tree_batch(r["workload"], page_size=ps)
        plan = pat_core.Planner(r["method"], gpu).plan(b.block_tables, b.seq_lens, hq, hk,
                                                       int(res["head_dim"]), ps)
        s = sim.simulate(plan)
        pts.append((r["latency_us"], s.latency_us, r["method"], s.constants.source))
    return gpu, pts


for res in results:
    gpu, pts = sim_vs_measured(res)
    if not pts:
        continue
    meas, pred = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    for m in sorted({p[2] for p in pts}):
        sel = np.array([p[2] == m for p in pts])
        ax.scatter(meas[sel], pred[sel], s=14, label=m)
    lo, hi = min(meas.min(), pred.min()) * 0.8, max(meas.max(), pred.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"measured on {res['device']} (us)")
    ax.set_ylabel("sim prediction (us)")
    ax.set_title(f"sim constants: {pts[0][3]}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    ratio = pred / meas
    rank = np.corrcoef(np.argsort(np.argsort(meas)), np.argsort(np.argsort(pred)))[0, 1]
    print(f"{res['device']}: prediction / measurement median {np.median(ratio):.2f} "
          f"(range {ratio.min():.2f}-{ratio.max():.2f}), rank correlation {rank:.2f} "
          f"over {len(pts)} points")

# %% [markdown]
# If the constants say "default estimate", the simulator has not been calibrated on that GPU
# yet: the absolute numbers can be off by a constant factor while the ranking is still
# informative. `python -m sim fit --measurements <file>` fits the constants to a calibration run
# and `python -m sim calibration-report` says how far the predictions are from the measurements.
#
# **Where to go from here.** Run `python -m pat_core demo --backend cuda` on your GPU, try your
# own block tables through `PrefixAttentionWrapper(backend="cuda")`, and compare packers with
# `bench/gpu_kernels.py`. The design notes explain how the pieces fit together.
