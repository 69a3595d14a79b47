"""Plots and the markdown summary of a bench/compare.py result.

* ``perf_<heads>.png``: performance per workload normalised to pat (latency of pat / latency of
  the method; pat = 1, higher is faster), bars per method, one figure per head config, as in the
  PAT paper's kernel figure;
* ``bandwidth.png``: effective bandwidth of each method against the copy bandwidth (the floor);
* ``summary.md``: one table per page size plus the headline numbers.
"""
from __future__ import annotations

import math
import os

import numpy as np

ORDER = ("pat", "query", "node", "compute", "pat-fixed", "pat-serial", "fi-decode", "fi-cascade")
SHARING_FREE = ("128_2048", "256_4096")


def _geo(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def headline(result) -> dict:
    """Targets of the FlashInfer comparison, computed from the rows."""
    rows = [r for r in result["rows"] if "latency_us" in r]
    # compare like with like: graph replay when both sides have it, else eager
    by = {}
    for r in rows:
        by.setdefault((r["workload"], tuple(r["heads"]), r["page_size"]), {})[r["method"]] = r
    sp_best, floor_ratio, nosh, wins, total = [], [], [], 0, 0
    def pair(a, b):
        key = "latency_graph_us" if ("latency_graph_us" in a and "latency_graph_us" in b) \
            else ("latency_eager_us" if "latency_eager_us" in a else "latency_us")
        return a.get(key, a["latency_us"]), b.get(key, b["latency_us"])

    for (wl, heads, ps), m in by.items():
        pat = m.get("pat")
        if pat is None:
            continue
        fis = [pair(pat, m[b]) for b in ("fi-decode", "fi-cascade") if b in m]
        if wl in SHARING_FREE:
            if "fi-decode" in m:
                p, f = pair(pat, m["fi-decode"])
                nosh.append(f / p)
            continue
        floor_ratio.append(pat["latency_us"] / pat["floor_us"])
        if fis:
            total += 1
            wins += all(p < f for p, f in fis)
            sp_best.append(min(f / p for p, f in fis))
    return dict(sharing_configs=total, pat_faster_than_all_fi=wins,
                geomean_speedup_vs_best_fi=_geo(sp_best),
                geomean_floor_ratio=_geo(floor_ratio),
                min_nosharing_ratio_vs_fi_decode=min(nosh) if nosh else float("nan"))


def plot_all(result, out_dir) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "latency_us" in r]
    lines = []
    heads_all = sorted({tuple(r["heads"]) for r in result["rows"]})
    ps_all = sorted({r["page_size"] for r in result["rows"]})
    wls = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    methods = [m for m in ORDER if any(r["method"] == m for r in rows)]
    lat = {(r["workload"], tuple(r["heads"]), r["page_size"], r["method"]): r["latency_us"]
           for r in rows}
    ps0 = ps_all[0]
    for heads in heads_all:
        fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(wls)), 4))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            vals = []
            for wl in wls:
                p = lat.get((wl, heads, ps0, "pat"))
                x = lat.get((wl, heads, ps0, m))
                vals.append(p / x if p and x else 0.0)
            ax.bar(np.arange(len(wls)) + i * width, vals, width, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(wls)) + 0.4 - width / 2)
        ax.set_xticklabels(wls, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("performance normalised to pat")
        ax.set_title(f"{result['device']}: heads {heads[0]}:{heads[1]}, page {ps0}, "
                     f"{result['dtype']}, d={result['head_dim']}")
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        path = os.path.join(out_dir, f"perf_{heads[0]}_{heads[1]}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines.append(f"wrote {path}")
    # bandwidth vs floor
    fig, ax = plt.subplots(figsize=(8, 4))
    for m in methods:
        xs = [r["floor_us"] for r in rows if r["method"] == m]
        ys = [r["eff_bandwidth"] / 1e12 for r in rows if r["method"] == m]
        ax.scatter(xs, ys, s=12, label=m)
    ax.axhline(result["copy_bandwidth"] / 1e12, color="k", ls="--", lw=1,
               label="copy bandwidth")
    ax.set_xscale("log")
    ax.set_xlabel("floor latency (us): bytes that must move / copy bandwidth")
    ax.set_ylabel("effective bandwidth (TB/s)")
    ax.set_title(f"{result['device']}: effective bandwidth vs the floor")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = os.path.join(out_dir, "bandwidth.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    lines.append(f"wrote {path}")
    # summary
    h = headline(result)
    md = [f"# pat vs FlashInfer on {result['device']}", "",
          f"git {result['git_sha'][:10]}, {result['dtype']}, head_dim {result['head_dim']}, "
          f"median of {result['reps']}; copy bandwidth {result['copy_bandwidth'] / 1e12:.2f} TB/s;"
          f" versions {result['versions']}", "",
          f"- sharing configs where pat beats both FlashInfer methods: "
          f"{h['pat_faster_than_all_fi']} / {h['sharing_configs']}",
          f"- geometric-mean speed-up of pat over the faster FlashInfer method (sharing): "
          f"{h['geomean_speedup_vs_best_fi']:.2f}x (target >= 2x)",
          f"- geometric mean of pat latency / floor (sharing): {h['geomean_floor_ratio']:.2f} "
          f"(target <= 1.5)",
          f"- worst no-sharing ratio fi-decode / pat: {h['min_nosharing_ratio_vs_fi_decode']:.3f}"
          f" (target >= 0.95)", ""]
    for ps in ps_all:
        md.append(f"## page size {ps}: latency in us (floor, then each method; * = wrong, "
                  f"- = not run)")
        md.append("")
        md.append("| workload | heads | floor | " + " | ".join(methods) + " |")
        md.append("|---|---|---|" + "---|" * len(methods))
        for wl in wls:
            for heads in heads_all:
                cells = []
                floor = next((r["floor_us"] for r in result["rows"] if r["workload"] == wl
                              and tuple(r["heads"]) == heads and r["page_size"] == ps), None)
                for m in methods:
                    r = next((r for r in result["rows"] if r["workload"] == wl and
                              tuple(r["heads"]) == heads and r["page_size"] == ps and
                              r["method"] == m), None)
                    if r is None or ("latency_us" not in r and r.get("correct", True)):
                        cells.append("-")
                    elif "latency_us" not in r:
                        cells.append("*")
                    else:
                        cells.append(f"{r['latency_us']:.1f}")
                md.append(f"| {wl} | {heads[0]}:{heads[1]} | "
                          f"{floor:.1f} | " + " | ".join(cells) + " |" if floor else
                          f"| {wl} | {heads[0]}:{heads[1]} | - | " + " | ".join(cells) + " |")
        md.append("")
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")
    lines.append(f"wrote {path}")
    lines.extend(md[4:9])
    return lines
