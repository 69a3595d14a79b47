"""Plots and the markdown summary of a bench/compare.py result.

* ``perf_<heads>.png``: performance per workload normalised to pat (latency of pat / latency of
  the method; pat = 1, higher is faster), bars per method, one figure per head config, as in the
  PAT paper's kernel figure;
* ``bandwidth.png``: effective bandwidth of each method against the copy bandwidth (the floor);
* ``fasttree.png``: pat's speed-up over FastTree per configuration where both were timed;
* ``summary.md``: the headline numbers, time / floor per method, pat against FastTree per
  configuration, and one latency table per page size.
"""
from __future__ import annotations

import math
import os

import numpy as np

ORDER = ("pat", "query", "node", "compute", "pat-fixed", "pat-serial", "fi-decode", "fi-cascade",
         "fasttree")
FI = ("fi-decode", "fi-cascade")
SHARING_FREE = ("128_2048", "256_4096")


def _geo(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def _by_config(result):
    by = {}
    for r in result["rows"]:
        by.setdefault((r["workload"], tuple(r["heads"]), r["page_size"]), {})[r["method"]] = r
    return by


def _pair(a, b):
    """Latencies of two timed rows, like with like: graph replay when both have it, else
    eager; ``(a_us, b_us, "graph" | "eager")``."""
    if "latency_graph_us" in a and "latency_graph_us" in b:
        return a["latency_graph_us"], b["latency_graph_us"], "graph"
    if "latency_eager_us" in a and "latency_eager_us" in b:
        return a["latency_eager_us"], b["latency_eager_us"], "eager"
    return a["latency_us"], b["latency_us"], a.get("timing", "?")


def _status(r) -> str:
    """Why a row has no time: the skip reason, "wrong", "error", or "" when timed."""
    if r is None:
        return "not run"
    if "latency_us" in r:
        return ""
    if "skipped" in r:
        return r["skipped"]
    if r.get("correct") is False:
        return f"wrong (rel. err {r.get('rel_err', float('nan')):.1e})"
    if "error" in r:
        return "error: " + r["error"][:80]
    return "no time"


def fasttree_table(result) -> list:
    """pat against FastTree per configuration (every configuration with a FastTree row, run
    or not): dicts with workload, heads, page_size, pat_us, fasttree_us, speedup (FastTree time /
    pat time, > 1 means pat is faster), pat_eager_us, fasttree_eager_us, speedup_eager, timing;
    times are None and ``status`` says why where one side has none."""
    out = []
    for (wl, heads, ps), m in _by_config(result).items():
        ft = m.get("fasttree")
        if ft is None:
            continue
        pat = m.get("pat")
        row = dict(workload=wl, heads=list(heads), page_size=ps, pat_us=None, fasttree_us=None,
                   speedup=None, pat_eager_us=None, fasttree_eager_us=None, speedup_eager=None,
                   timing=None, status=_status(ft) or (_status(pat) and "pat: " + _status(pat)))
        if pat is not None and "latency_us" in pat and "latency_us" in ft:
            p, f, how = _pair(pat, ft)
            row.update(pat_us=p, fasttree_us=f, speedup=f / p, timing=how)
            if "latency_eager_us" in pat and "latency_eager_us" in ft:
                pe, fe = pat["latency_eager_us"], ft["latency_eager_us"]
                row.update(pat_eager_us=pe, fasttree_eager_us=fe, speedup_eager=fe / pe)
        out.append(row)
    return out


def floor_ratios(result, methods=None) -> dict:
    """Geometric mean of latency / floor per method over the sharing configurations:
    ``{method: {"all": (geomean, n), "fasttree_set": (geomean, n)}}``; "all" over every
    sharing configuration where the method was timed, "fasttree_set" over those where FastTree
    was timed too (the like-for-like set)."""
    by = _by_config(result)
    methods = methods or [m for m in ORDER if any(r["method"] == m for r in result["rows"])]
    out = {}
    for meth in methods:
        every, common = [], []
        for (wl, _, _), m in by.items():
            r = m.get(meth)
            if wl in SHARING_FREE or r is None or "latency_us" not in r:
                continue
            every.append(r["latency_us"] / r["floor_us"])
            if "latency_us" in m.get("fasttree", {}):
                common.append(r["latency_us"] / r["floor_us"])
        out[meth] = {"all": (_geo(every), len(every)), "fasttree_set": (_geo(common),
                                                                        len(common))}
    return out


def headline(result) -> dict:
    """Targets of the comparison, computed from the rows."""
    sp_best, floor_ratio, nosh, wins, total = [], [], [], 0, 0
    for (wl, heads, ps), m in _by_config(result).items():
        pat = m.get("pat")
        if pat is None or "latency_us" not in pat:
            continue
        fis = [_pair(pat, m[b])[:2] for b in FI if b in m and "latency_us" in m[b]]
        if wl in SHARING_FREE:
            if "fi-decode" in m and "latency_us" in m["fi-decode"]:
                p, f, _ = _pair(pat, m["fi-decode"])
                nosh.append(f / p)
            continue
        floor_ratio.append(pat["latency_us"] / pat["floor_us"])
        if fis:
            total += 1
            wins += all(p < f for p, f in fis)
            sp_best.append(min(f / p for p, f in fis))
    ftt = [x for x in fasttree_table(result) if x["speedup"] is not None]
    sp_ft = [x["speedup"] for x in ftt]
    sp_fte = [x["speedup_eager"] for x in ftt if x["speedup_eager"] is not None]
    return dict(sharing_configs=total, pat_faster_than_all_fi=wins,
                geomean_speedup_vs_best_fi=_geo(sp_best),
                geomean_floor_ratio=_geo(floor_ratio),
                min_nosharing_ratio_vs_fi_decode=min(nosh) if nosh else float("nan"),
                fasttree_configs=len(ftt),
                pat_faster_than_fasttree=int(sum(x > 1 for x in sp_ft)),
                geomean_speedup_vs_fasttree=_geo(sp_ft),
                geomean_speedup_vs_fasttree_eager=_geo(sp_fte),
                min_speedup_vs_fasttree=min(sp_ft) if sp_ft else float("nan"))


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
    # pat over FastTree, per configuration
    ftt = [x for x in fasttree_table(result) if x["speedup"] is not None]
    if ftt:
        fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(ftt)), 4))
        xs = np.arange(len(ftt))
        sp = [x["speedup"] for x in ftt]
        ax.bar(xs, sp, 0.8, color=["tab:green" if v > 1 else "tab:red" for v in sp])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x['workload']} {x['heads'][0]}:{x['heads'][1]} p{x['page_size']}"
                            for x in ftt], rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("FastTree time / pat time")
        ax.set_title(f"{result['device']}: pat over FastTree ({sum(v > 1 for v in sp)} of "
                     f"{len(sp)} faster, geomean {_geo(sp):.2f}x)")
        fig.tight_layout()
        path = os.path.join(out_dir, "fasttree.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines.append(f"wrote {path}")
    # summary
    h = headline(result)
    heads_lines = [
        f"- sharing configs where pat beats both FlashInfer methods: "
        f"{h['pat_faster_than_all_fi']} / {h['sharing_configs']}",
        f"- geometric-mean speed-up of pat over the faster FlashInfer method (sharing): "
        f"{h['geomean_speedup_vs_best_fi']:.2f}x",
        (f"- sharing configs where pat beats FastTree: {h['pat_faster_than_fasttree']} / "
         f"{h['fasttree_configs']}; geometric-mean speed-up of pat over FastTree "
         f"{h['geomean_speedup_vs_fasttree']:.2f}x "
         f"(eager {h['geomean_speedup_vs_fasttree_eager']:.2f}x), "
         f"worst {h['min_speedup_vs_fasttree']:.2f}x" if h["fasttree_configs"] else
         "- FastTree: no configuration timed"),
        f"- geometric mean of pat latency / floor (sharing): {h['geomean_floor_ratio']:.2f}",
        f"- worst no-sharing ratio fi-decode / pat: {h['min_nosharing_ratio_vs_fi_decode']:.3f}"]
    ver = result.get("versions", {})
    md = [f"# pat vs FlashInfer and FastTree on {result['device']}", "",
          f"git {result['git_sha'][:10]}, {result['dtype']}, head_dim {result['head_dim']}, "
          f"median of {result['reps']}, L2 flushed ({result.get('l2_flush', 'dirty')}); "
          f"copy bandwidth "
          f"{result['copy_bandwidth'] / 1e12:.2f} TB/s; versions {ver}", ""]
    if result.get("command"):
        md += [f"command: `{result['command']}`", ""]
    md += heads_lines + [""]
    if result.get("not_run"):
        md += [f"**{len(result['not_run'])} configurations not run** (time budget).", ""]
    # time / floor per method
    fr = floor_ratios(result, methods)
    md += ["## latency / floor, geometric mean over sharing configurations", "",
           "(graph replay where captured, else eager; \"FastTree's set\": the configurations "
           "where FastTree was timed)", "",
           "| method | all sharing configs | n | FastTree's set | n |", "|---|---|---|---|---|"]
    for m in methods:
        (ga, na), (gc, nc) = fr[m]["all"], fr[m]["fasttree_set"]
        md.append(f"| {m} | {ga:.2f} | {na} | {gc:.2f} | {nc} |" if nc else
                  f"| {m} | {ga:.2f} | {na} | - | 0 |")
    md.append("")
    ftt = fasttree_table(result)
    if ftt:
        md += ["## pat vs FastTree per configuration", "",
               "speed-up = FastTree time / pat time (> 1: pat faster); graph replay when both "
               "were captured, else eager", "",
               "| workload | heads | page | pat us | FastTree us | speed-up | eager speed-up |"
               " timing / why not |", "|---|---|---|---|---|---|---|---|"]
        for x in ftt:
            f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
            md.append(f"| {x['workload']} | {x['heads'][0]}:{x['heads'][1]} | "
                      f"{x['page_size']} | {f(x['pat_us'], '.1f')} | "
                      f"{f(x['fasttree_us'], '.1f')} | {f(x['speedup'], '.2f')} | "
                      f"{f(x['speedup_eager'], '.2f')} | {x['timing'] or x['status']} |")
        md.append("")
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
                if floor is None:
                    continue
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
                md.append(f"| {wl} | {heads[0]}:{heads[1]} | {floor:.1f} | " +
                          " | ".join(cells) + " |")
        md.append("")
    reasons = {}
    for r in result["rows"]:
        if "latency_us" not in r and r.get("skipped"):
            reasons.setdefault((r["method"], r["skipped"]), 0)
            reasons[(r["method"], r["skipped"])] += 1
    if reasons:
        md += ["## not run, and why", ""]
        md += [f"- {m}: {why} ({n} configs)" for (m, why), n in sorted(reasons.items())]
        md.append("")
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")
    lines.append(f"wrote {path}")
    lines.extend(heads_lines)
    return lines
