"""Which KV tile table a large graph-safe bucket should plan with, as the simulator prices it
(CPU only).

A graph-safe wrapper launches every tile of its launch set on every replay; a tile the step
does not use still costs a launch (``sim.simulate(..., launch_set=)``).  The GPU's KV-length
table gives three ``n`` per ``m`` (eleven or twelve tiles for a bucket that reaches 128-row
CTAs); a table with fewer ``n`` means fewer idle launches and CTAs of wider tiles (masked
columns on short KV).  For every step of the development set (``bench/devset.py prepare``
steps files), one wrapper per part or per power-of-two bucket as ``bench/trace_replay.py``
sizes them, this prices each table's plan and launch set and writes the predicted graph-safe
time per step and table, with the ratio to the GPU table's::

    python bench/lab/sim_graph_safe_tables.py --out FILE.json [--gpu h100] [--heads 32:8 16:4]
        [--tables gpu 96:32,inf:64 inf:64]

A prediction to measure, not a measurement: ``bench/lab/graph_safe_cost.py --compact TABLE``
times the same choice on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from bench.devset import DEFAULT_DIR, PARTS, graph_safe_bucket  # noqa: E402
from bench.trace_replay import batch_bucket, graph_safe_buckets, load_steps  # noqa: E402


def parse_table(text: str):
    """``"gpu"`` (None: the GPU's own) or ``"MAXLEN:N,...,inf:N"`` as a KV tile table."""
    if text == "gpu":
        return None
    out = []
    for part in text.split(","):
        ln, n = part.split(":")
        out.append((1 << 62 if ln == "inf" else int(ln), int(n)))
    if out[-1][0] != 1 << 62:
        raise ValueError(f"table {text!r}: the last entry must be inf:N")
    return tuple(out)


def study(steps_dir, gpu: str, heads, tables, head_dim: int = 128) -> list:
    from pat_core import Planner
    from pat_core.static_plan import StaticLimits, reachable_tiles
    from sim import simulate
    rows = []
    base = Planner("pat", gpu)
    for part in PARTS:
        path = os.path.join(steps_dir, f"{part}.npz")
        if not os.path.exists(path):
            continue
        meta, steps = load_steps(path)
        ps = meta["config"]["page_size"]
        for hq, hk in heads:
            plans = [base.plan(t, ln, hq, hk, head_dim, ps) for _, t, ln in steps]
            for buckets in (False, True):
                sizes = graph_safe_buckets(plans, steps, ps, buckets)
                for (m, t, ln), plain in zip(steps, plans):
                    lim = StaticLimits.make(*sizes[batch_bucket(plain.batch_size, buckets)])
                    bp, (_, fused) = graph_safe_bucket(gpu, lim, hq // hk, head_dim, "float16")
                    # a bucket the wrapper plans otherwise (small, fused); every wrapper keeps
                    # the coarse split parts (merge_min_part), which the tables then share
                    if fused or dataclasses.replace(bp.tuning, merge_min_part=None) != \
                            base.tuning:
                        continue
                    row = dict(part=part, step=int(m["step"]), heads=f"{hq}:{hk}",
                               buckets=buckets, batch=int(plain.batch_size), us={}, tiles={})
                    for name, table in tables:
                        pl = Planner("pat", gpu, bp.tuning)
                        if table is not None:
                            pl.tuning = dataclasses.replace(pl.tuning, kv_tile_table=table)
                        plan = pl.plan(t, ln, hq, hk, head_dim, ps)
                        tiles = reachable_tiles(pl.tile_selector(head_dim, "float16"), table,
                                                max_rows=lim.max_cta_rows(hq // hk))
                        res = simulate(plan, gpu, launch_set=(tiles, False))
                        row["us"][name] = round(res.latency_us, 2)
                        row["tiles"][name] = len(tiles)
                    rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="prepared steps files")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--heads", nargs="+", default=["32:8", "16:4"])
    ap.add_argument("--tables", nargs="+", default=["gpu", "96:32,inf:64", "inf:64"])
    a = ap.parse_args(argv)
    heads = [tuple(int(x) for x in h.split(":")) for h in a.heads]
    tables = [(t, parse_table(t)) for t in a.tables]
    rows = study(a.dir, a.gpu, heads, tables)
    ref = tables[0][0]
    summary = {}
    for part in sorted({r["part"] for r in rows}):
        for buckets in (False, True):
            sel = [r for r in rows if r["part"] == part and r["buckets"] == buckets]
            if not sel:
                continue
            key = f"{part} {'bucket' if buckets else 'one'}"
            summary[key] = {}
            for name, _ in tables[1:]:
                q = np.array([r["us"][name] / r["us"][ref] for r in sel])
                summary[key][name] = dict(geo=round(float(np.exp(np.log(q).mean())), 4),
                                          min=round(float(q.min()), 4),
                                          max=round(float(q.max()), 4), steps=len(sel))
                print(f"{key:18} {name:14} / {ref}: geo {summary[key][name]['geo']:.3f} "
                      f"({summary[key][name]['min']:.3f}-{summary[key][name]['max']:.3f}), "
                      f"{len(sel)} steps")
    with open(a.out, "w") as f:
        json.dump(dict(gpu=a.gpu, tables=a.tables, heads=a.heads, summary=summary, rows=rows),
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
