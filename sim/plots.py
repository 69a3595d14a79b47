"""Plots: per-SM Gantt timeline, method sweeps, bytes per method (matplotlib).

Every function takes already-computed results and a file name and returns the path written.
Importing this module leaves matplotlib's backend alone (notebooks keep inline figures); the
command line selects the headless Agg backend before it imports this module.
"""
from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

_MERGE_COLOUR = "#7f7f7f"
_IDLE_COLOUR = "#f7e4e2"
# one marker and dash pattern per series, so that curves lying on top of each other stay visible
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1)), (0, (1, 1)))


def _title(ax, text: str, width: int = 80) -> None:
    """A title wrapped to ``width`` characters, so it fits the figure."""
    ax.set_title("\n".join(textwrap.wrap(text, width)), fontsize=10)


def _idle_intervals(start, end, t0: float, t1: float) -> list:
    """Intervals of ``[t0, t1]`` during which no block runs (``start``/``end``: float [N])."""
    order = np.argsort(start)
    out, cur = [], t0
    for s, e in zip(start[order], end[order]):
        if s > cur:
            out.append((cur, float(s)))
        cur = max(cur, float(e))
    if cur < t1:
        out.append((cur, t1))
    return out


def _rects(x0, x1, y0, h):
    """Vertices of axis-aligned rectangles for a PolyCollection."""
    return np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1),
                     np.stack([x1, y0 + h], 1), np.stack([x0, y0 + h], 1)], 1)


def gantt(result, path: str, title: str | None = None, max_sms: int | None = None) -> str:
    """Per-SM Gantt chart of ``result`` (a :class:`sim.model.SimResult`).

    One row per SM; a row is split into lanes, one per resident block, so blocks that share the
    SM are drawn one above the other.  Forward blocks are coloured by launch (one launch per
    tile config, labelled with it); merge blocks are grey.  Dashed lines mark each
    launch's host issue time; shaded spans are times when no block runs on any SM (waiting for
    a launch to be issued or for the previous kernel to finish).  The legend sits outside the
    axes.
    """
    tl = result.timeline
    nsm = tl.num_sms if max_sms is None else min(max_sms, tl.num_sms)
    lanes = max(1, int(np.nanmax(tl.block_lane)) + 1) if tl.num_blocks else 1
    cmap = plt.get_cmap("tab10" if len(tl.launches) <= 10 else "tab20")
    fig_h = max(3.0, min(14.0, 0.06 * nsm + 1.5))
    fig, ax = plt.subplots(figsize=(12, fig_h))
    handles = []
    for i, ln in enumerate(tl.launches):
        sel = np.zeros(tl.num_blocks, dtype=bool)
        sel[ln.begin:ln.end] = True
        sel &= tl.block_sm < nsm
        colour = _MERGE_COLOUR if ln.kind == "merge" else cmap(i % cmap.N)
        label = "merge" if ln.kind == "merge" else f"launch {i}: {ln.name.split()[-1]}"
        handles.append(Patch(facecolor=colour, edgecolor="none", label=label))
        if not sel.any():
            continue
        x0 = tl.block_start[sel] / 1e3
        x1 = tl.block_end[sel] / 1e3
        y0 = tl.block_sm[sel] + tl.block_lane[sel] / lanes
        pc = PolyCollection(_rects(x0, x1, y0, 0.9 / lanes), facecolors=colour,
                            edgecolors="black", linewidths=0.1)
        ax.add_collection(pc)
    t_end = max(result.latency_us, 1e-3)
    if tl.num_blocks:
        idle = _idle_intervals(tl.block_start / 1e3, tl.block_end / 1e3, 0.0, t_end)
        for a, b in idle:
            ax.axvspan(a, b, color=_IDLE_COLOUR, zorder=0, lw=0)
            if b - a > 0.04 * t_end:
                ax.text((a + b) / 2, nsm * 0.5, f"no block running\n{b - a:.1f} us",
                        ha="center", va="center", fontsize=7, rotation=90, color="#7b241c")
        if idle:
            handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="none",
                                 label="no block running"))
    for i, ln in enumerate(tl.launches):
        x = ln.issue_ns / 1e3
        ax.axvline(x, color="black", lw=0.7, ls="--", alpha=0.6)
        ax.text(x, 0.99, f"issue {'merge' if ln.kind == 'merge' else f'launch {i}'} ",
                rotation=90, va="top", ha="right", fontsize=6.5, color="black",
                transform=ax.get_xaxis_transform())
    handles.append(Line2D([0], [0], color="black", lw=0.7, ls="--",
                          label="host issues a launch"))
    ax.set_xlim(0, t_end * 1.02)
    ax.set_ylim(nsm, 0)
    ax.set_xlabel("time (us)")
    ax.set_ylabel("SM")
    _title(ax, title or (f"{result.plan.packer} on {result.gpu.name}: "
                         f"{result.latency_us:.1f} us predicted, "
                         f"bubble {100 * result.bubble:.1f} %, {tl.num_blocks} blocks"), 110)
    ax.legend(handles=handles[:22], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_plot(sweep: dict, path: str) -> str:
    """Predicted time per method against the swept knob (``sweep`` as :func:`sim.cli.run_sweep`
    returns it: ``{"knob", "values", "methods": {method: [us, ...]}, ...}``).

    Methods with identical predictions would hide each other: each series has its own marker
    and dash pattern, markers shrink from the first series to the last so coinciding ones show
    as nested shapes, and the legend names the methods a curve coincides with.
    """
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    xs = list(range(len(sweep["values"])))
    series = list(sweep["methods"].items())
    same = {m: [o for o, ys2 in series if o != m and list(ys2) == list(ys)] for m, ys in series}
    for i, (method, ys) in enumerate(series):
        label = method + (f" (= {', '.join(same[method])})" if same[method] else "")
        ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], ms=max(3.0, 10.0 - 1.2 * i),
                ls=_DASHES[i % len(_DASHES)], lw=1.4, mfc="none", mew=1.3, label=label,
                zorder=2 + i)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(v) for v in sweep["values"]])
    ax.set_xlabel(sweep.get("knob_label", sweep["knob"]))
    ax.set_ylabel("predicted latency (us)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    _title(ax, sweep.get("title", f"sweep over {sweep['knob']}"), 75)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bytes_plot(rows: list, path: str, title: str = "bytes per method") -> str:
    """Stacked bars of bytes per method: by kind (left) and, when the rows carry
    ``bytes_level``, by where they are served, HBM or L2 (right).

    ``rows``: dicts with ``method``, ``bytes`` (``{"kv", "q", "partial_write", "partial_read",
    "out"}``) and optionally ``bytes_level`` (``{"hbm", "l2"}``).
    """
    kinds = ("kv", "q", "partial_write", "partial_read", "out")
    levels = all("bytes_level" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if levels else 1, figsize=(12 if levels else 8.5, 4.5),
                             squeeze=False)
    ax = axes[0, 0]
    names = [r["method"] for r in rows]
    bottom = np.zeros(len(rows))
    for kind in kinds:
        vals = np.array([r["bytes"][kind] for r in rows], dtype=float) / 1e6
        ax.bar(names, vals, bottom=bottom, label=kind)
        bottom += vals
    ax.set_ylabel("MB")
    _title(ax, title + ": by kind", 60)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    if levels:
        ax = axes[0, 1]
        hbm = np.array([r["bytes_level"]["hbm"] for r in rows], dtype=float) / 1e6
        l2 = np.array([r["bytes_level"]["l2"] for r in rows], dtype=float) / 1e6
        ax.bar(names, hbm, label="HBM", color="#1f77b4")
        ax.bar(names, l2, bottom=hbm, label="L2 hits", color="#ff7f0e")
        ax.set_ylabel("MB")
        _title(ax, title + ": HBM or L2", 60)
        ax.legend(fontsize=8)
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def calibration_plot(predicted_us, measured_us, labels, path: str, title: str = "",
                     in_fit=None) -> str:
    """Predicted against measured latency, log-log, one point per measurement; ``in_fit``
    (bool per point, optional): filled markers for the fit set, open ones for validation."""
    fig, ax = plt.subplots(figsize=(6.5, 6.5))
    p = np.asarray(predicted_us, float)
    m = np.asarray(measured_us, float)
    fit_mask = (np.ones(p.shape[0], bool) if in_fit is None
                else np.asarray(in_fit, dtype=bool))
    groups = sorted(set(labels))
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    for i, g in enumerate(groups):
        sel = np.array([lb == g for lb in labels])
        col = cmap(i % cmap.N)
        ax.scatter(m[sel & fit_mask], p[sel & fit_mask], s=12, color=col, label=g)
        ax.scatter(m[sel & ~fit_mask], p[sel & ~fit_mask], s=14, facecolors="none",
                   edgecolors=col)
    lo = float(min(p.min(), m.min())) * 0.8
    hi = float(max(p.max(), m.max())) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey",
                    alpha=0.15, label="+-20 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (us)")
    ax.set_ylabel("predicted (us)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
