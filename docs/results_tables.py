"""Print the tables of docs/results.md and the README's headline table from one results folder.

    python docs/results_tables.py bench/results/one_path_h100 > tables.md
    python docs/results_tables.py --features bench/results/features_h200    # engine features

Reads the folder's devset.json, devset_fi06.json, devset_hd64.json and baselines.json (as
bench/device/device_session.sh writes them), and devset_hd256.json where the folder has it.
Ratios are geometric means over a part's steps; a floor is the time of a step's unavoidable
bytes at the copy bandwidth of the same run.
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devset import SYNTHETIC  # noqa: E402

NAME = {spec: name for name, spec, _ in SYNTHETIC}
# the parallel-sampling and multi-level trees of the synthetic part (README: "sampling and
# multi-level trees")
MULTI_NAMES = ("sample-32x8", "sample-8x16", "sample-64x8", "sample-4x16",
               "tree-16", "tree-64", "tree-256", "agent-48")
MULTI = [spec for name, spec, _ in SYNTHETIC if name in MULTI_NAMES]
PARTS = (("conv", "chat trace"), ("agent", "agent / tool trace"), ("synthetic", "synthetic"))


def geo(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def load(path: Path) -> dict:
    by = defaultdict(dict)
    for r in json.loads(path.read_text())["rows"]:
        by[(r["part"], r["step"], r["spec"])][r["method"]] = r
    return by


def ratio(by, keys, method, kind="graph_us") -> float:
    return geo([by[k][method][kind] / by[k][method]["floor_us"] for k in keys])


def speedup(by, keys) -> tuple:
    xs = [by[k]["fi-decode"]["graph_us"] / by[k]["pat"]["graph_us"] for k in keys]
    return geo(xs), min(xs)


f1 = "{:.1f}".format   # a time in µs, as the tables print it


def table(head, rows) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def synthetic_table(head_dim: int, by: dict) -> None:
    """The synthetic part at another head_dim (``by``: load()'s rows): pat against FlashInfer
    0.2.5 decode."""
    print(f"\n## synthetic, head_dim {head_dim} (µs)\n")
    print(table(["workload", "requests", "floor", "pat", "pat eager", "FlashInfer 0.2.5",
                 "FI ÷ pat"],
                [[NAME[k[2]], v["pat"]["batch"], f1(v["pat"]["floor_us"]), f1(v["pat"]["graph_us"]),
                  f1(v["pat"]["eager_us"]), f1(v["fi-decode"]["graph_us"]),
                  f"{v['fi-decode']['graph_us'] / v['pat']['graph_us']:.3f}"]
                 for k in by for v in [by[k]]]))


def main(folder: str) -> None:
    d = Path(folder)
    by, fi6, hd64 = load(d / "devset.json"), load(d / "devset_fi06.json"), load(d / "devset_hd64.json")
    keys = {p: [k for k in by if k[0] == p] for p, _ in PARTS}
    multi = [k for k in keys["synthetic"] if k[2] in MULTI]

    def batches(ks, b=by):
        bs = [b[k]["pat"]["batch"] for k in ks]
        return f"{min(bs)}-{max(bs)}"

    print("## README headline\n")
    rows = []
    for label, b, ks in (("chat trace (Mooncake conversation)", by, keys["conv"]),
                         ("agent / tool trace", by, keys["agent"]),
                         ("synthetic batches (all)", by, keys["synthetic"]),
                         ("sampling and multi-level trees", by, multi),
                         ("synthetic batches, head_dim 64", hd64, list(hd64))):
        g, w = speedup(b, ks)
        rows.append([label, len(ks), batches(ks, b), f"{ratio(b, ks, 'pat'):.2f}",
                     f"{ratio(b, ks, 'fi-decode'):.2f}", f"{g:.2f}x, {w:.2f}x"])
    print(table(["workload", "steps", "requests", "pat / floor", "FlashInfer 0.2.5 decode / floor",
                 "FlashInfer time ÷ pat time (mean, worst)"], rows))

    print("\n## Summary per part\n")
    rows = []
    for p, label in PARTS:
        ks = keys[p]
        rows.append([label, len(ks), batches(ks)] + [f"{ratio(by, ks, m, kind):.3f}" for m, kind in (
            ("pat", "graph_us"), ("pat", "eager_us"), ("pat-graph", "graph_us"),
            ("pat-graph-bucket", "graph_us"), ("fi-decode", "graph_us"))]
            + [f"{ratio(fi6, ks, 'fi-decode'):.3f}"])
    print(table(["part", "steps", "requests", "pat", "pat eager", "one graph", "bucket graphs",
                 "FlashInfer 0.2.5", "FlashInfer 0.6.18"], rows))
    for p, label in PARTS:
        g, w = speedup(by, keys[p])
        print(f"\nFlashInfer 0.2.5 ÷ pat, {label}: {g:.3f} (lowest {w:.3f})")
    print(f"sampling and multi-level: pat {ratio(by, multi, 'pat'):.3f}, FlashInfer "
          f"{ratio(by, multi, 'fi-decode'):.3f}; head_dim 64: "
          f"{ratio(hd64, [k for k in hd64 if k[2] in MULTI], 'pat'):.3f}, "
          f"{ratio(hd64, [k for k in hd64 if k[2] in MULTI], 'fi-decode'):.3f}")

    for p, label in PARTS[:2]:
        print(f"\n## {label} (µs)\n")
        print(table(["step", "requests", "floor", "pat", "pat eager", "one graph", "bucket graph",
                     "FlashInfer 0.2.5", "FlashInfer 0.6.18", "FI 0.2.5 ÷ pat"],
                    [[k[1], v["pat"]["batch"], f1(v["pat"]["floor_us"]), f1(v["pat"]["graph_us"]),
                      f1(v["pat"]["eager_us"]), f1(v["pat-graph"]["graph_us"]),
                      f1(v["pat-graph-bucket"]["graph_us"]), f1(v["fi-decode"]["graph_us"]),
                      f1(fi6[k]["fi-decode"]["graph_us"]),
                      f"{v['fi-decode']['graph_us'] / v['pat']['graph_us']:.3f}"]
                     for k in keys[p] for v in [by[k]]]))

    print("\n## synthetic, head_dim 128 (µs)\n")
    print(table(["workload", "spec", "requests", "floor", "pat", "pat eager", "one graph",
                 "bucket graph", "FlashInfer 0.2.5", "FlashInfer 0.6.18", "FI 0.2.5 ÷ pat"],
                [[NAME[k[2]], f"`{k[2]}`", v["pat"]["batch"], f1(v["pat"]["floor_us"]),
                  f1(v["pat"]["graph_us"]), f1(v["pat"]["eager_us"]),
                  f1(v["pat-graph"]["graph_us"]), f1(v["pat-graph-bucket"]["graph_us"]),
                  f1(v["fi-decode"]["graph_us"]), f1(fi6[k]["fi-decode"]["graph_us"]),
                  f"{v['fi-decode']['graph_us'] / v['pat']['graph_us']:.3f}"]
                 for k in keys["synthetic"] for v in [by[k]]]))

    synthetic_table(64, hd64)
    if (d / "devset_hd256.json").is_file():   # a later run at the defaults it names
        hd256 = load(d / "devset_hd256.json")
        synthetic_table(256, hd256)
        g, w = speedup(hd256, list(hd256))
        print(f"\nFlashInfer 0.2.5 ÷ pat, head_dim 256: {g:.3f} (lowest {w:.3f}); pat / floor "
              f"{ratio(hd256, list(hd256), 'pat'):.3f}")

    print("\n## baselines (µs)\n")
    bb = defaultdict(dict)
    for r in json.loads((d / "baselines.json").read_text())["rows"]:
        bb[r["workload"]][r["method"]] = r

    def cell(r):
        if r is None or "skipped" in r:
            return "—"
        return f1(r["latency_us"]) if r.get("correct") else "NaN"
    print(table(["workload", "floor", "pat", "FlashInfer decode", "FlashInfer cascade", "FastTree"],
                [[NAME[w], f1(v["pat"]["floor_us"])]
                 + [cell(v.get(m)) for m in ("pat", "fi-decode", "fi-cascade", "fasttree")]
                 for w, v in bb.items()]))
    ft = [v["fasttree"]["latency_us"] / v["pat"]["latency_us"] for v in bb.values()
          if v.get("fasttree", {}).get("correct")]
    cs = [v["fi-cascade"]["latency_us"] / v["pat"]["latency_us"] for v in bb.values()
          if v.get("fi-cascade", {}).get("correct")]
    print(f"\nFastTree ÷ pat on {len(ft)}: {geo(ft):.2f} (min {min(ft):.2f}, max {max(ft):.2f}); "
          f"cascade ÷ pat on {len(cs)}: {min(cs):.1f}-{max(cs):.1f}")


def features(folder: str) -> None:
    """The engine features' table (docs/results.md) from a folder of
    bench/device/features_session.sh's ``feat_*.json``: per synthetic workload, graph us."""
    d = Path(folder)
    sets = {name: load(d / f"feat_{name}.json") for name in
            ("hd256", "fp16", "fp8", "qlen1", "qlen4", "invariant_chunks")}
    spec_of = {k[2]: k for k in sets["fp8"]}

    def us(name, spec, method, part="synthetic"):
        ks = [k for k in sets[name] if k[0] == part and k[2] == spec]
        r = sets[name][ks[0]].get(method, {}) if ks else {}
        return r.get("graph_us") if r.get("correct") else None

    def cell(x, base=None):
        if x is None:
            return "wrong" if base is not None else "-"
        return f1(x) if base is None else f"{f1(x)} ({x / base:.2f})"

    rows = []
    for name, spec, _ in SYNTHETIC:
        if spec not in spec_of:
            continue
        h, fh = us("hd256", spec, "pat"), us("hd256", spec, "fi-decode")
        p16, p8, f8 = us("fp16", spec, "pat"), us("fp8", spec, "pat"), us("fp8", spec, "fi-decode")
        q1, q4, fp = us("qlen1", spec, "pat"), us("qlen4", spec, "pat"), us("qlen4", spec,
                                                                             "fi-prefill")
        d0, iv = us("invariant_chunks", spec, "pat"), us("invariant_chunks", spec,
                                                         "pat-invariant@chunk1024")
        rows.append([name, f1(h), cell(fh, h), f1(p16), cell(p8, p16), cell(f8, p8), f1(q1),
                     cell(q4, q1), cell(fp, q4), f1(d0), cell(iv, d0)])
    print(table(["workload", "d256 pat", "d256 FlashInfer", "fp16 pat", "fp8 pat", "fp8 FlashInfer",
                 "1 token", "4 tokens", "4 tok. FI prefill", "default", "invariant"], rows))
    inv = sets["invariant_chunks"]
    for part, label in PARTS:
        ks = [k for k in inv if k[0] == part]
        print(f"\ninvariant (chunk 1024) ÷ default, {label}: "
              f"{geo([inv[k]['pat-invariant@chunk1024']['graph_us'] / inv[k]['pat']['graph_us'] for k in ks]):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--features":
        features(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "bench/results/one_path_h100"))
