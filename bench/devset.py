"""The development set: decode-step workloads of a serving engine, in one place.

Three steps files in ``bench/trace_replay.py``'s format (``table_i`` int32 ``[batch_i,
max_pages_i]``, ``lens_i`` int32 ``[batch_i]``, JSON ``meta``), each timed on the GPU with
``python bench/trace_replay.py time --steps-file DIR/NAME.npz --out RESULTS``:

* ``conv.npz``: 12 decode steps of the conversation trace given as ``--trace`` (the Mooncake
  chat trace's conversation part, one JSON request per line). Its replay (256 requests, 32,768
  pages of 16 tokens) runs the whole hour in ~15 s of CPU; steps are sampled from 300 s (past the
  first minutes, when the batch is still filling) to the trace's last arrival (3,537 s: the drain
  after it, down to one request, is an artefact of the trace's end). Small batches (~20-40) of
  long prompts (~12k tokens) that share little (unique/read KV ~0.95).
* ``agent.npz``: 12 decode steps of ``bench/agent_trace.py``'s trace (defaults, seed 0):
  three long templates, multi-turn sessions that share their own history, short outputs.
  Replayed with 256 requests and 98,304 pages (its steady state holds 55-70k pages, so
  admission never waits for KV); steps sampled from 20 s to 250 s: the ramp-up, the steady
  state (150-200 requests) and the ramp-down as sessions stop starting, unique/read KV
  ~0.3-0.5.
* ``synthetic.npz``: the tree specs of :data:`SYNTHETIC` (one step each,
  :func:`pat_core.workloads.build_tree_batch`): parallel sampling and RL rollouts, multi-level
  and deep trees, long shared prefixes, nothing shared, small batches; batches 1 to 512.

Commands::

    python bench/devset.py prepare --out DIR [--trace TRACE.jsonl] [--parts conv agent ...]
    python bench/devset.py list [--dir DIR]
    python bench/devset.py time --dir DIR --out RESULTS [--heads 32:8 64:8] [--methods ...]

``time`` (GPU) runs ``bench/trace_replay.py time`` on every part and writes one
``RESULTS/devset.json`` with each step's bandwidth floor (unique KV + q + out at the copy
bandwidth measured in the same run) and a summary per part: time / floor per method and pat's
speed-up over FlashInfer decode, graph replay and eager.

``list`` prints every workload (name, batch, unique and read KV tokens): the synthetic specs
always, the trace steps of the files found in ``--dir``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):     # run as a script: python bench/devset.py
    sys.path.insert(0, str(ROOT))

from bench.trace_replay import (load_steps, pat_plan_kw, prepare_steps,  # noqa: E402
                                prepare_synthetic_steps)
from pat_core.cuda_compile import HEAD_DIMS  # noqa: E402

STEPS = 12
PAGE_SIZE = 16
DEFAULT_DIR = ROOT / ".trace_steps" / "devset"       # git-ignored

# replay engine and sample window of each trace part (see the module docstring)
CONV = dict(max_batch=256, kv_pages=32768, sample_start_ms=300_000.0)   # to the last arrival
AGENT = dict(max_batch=256, kv_pages=98304, sample_start_ms=20_000.0,
             sample_end_ms=250_000.0)

# (name, tree spec, what it stands for); spec format: pat_core.workloads.parse_tree_spec
SYNTHETIC = (
    # parallel sampling / RL rollouts: P prompts, n samples each (batch = P * n)
    ("sample-32x8", "32,256_1024,128", "RL rollouts: 32 prompts x 8 samples"),
    ("sample-8x16", "8,128_2048,256", "best-of-16 on 8 long prompts"),
    ("sample-64x8", "64,512_512,64", "512 short rollouts of 64 prompts"),
    ("sample-4x16", "4,64_4096,512", "16 long samples of 4 long prompts"),
    # multi-level trees
    ("tree-16", "1,4,16_128,256,1024", "the PAT paper's example tree"),
    ("tree-64", "1,8,64_2048,512,128", "system prompt, 8 documents, 64 questions"),
    ("tree-256", "1,32,256_64,64,1024", "short shared levels over long private suffixes"),
    ("agent-48", "1,3,48_1024,6144,4096", "system prompt, 3 tool templates, 48 sessions"),
    # deep trees of short nodes (tree search, speculative branches)
    ("deep-64", "1,2,4,8,16,32,64_256,32,32,32,32,32,32", "binary tree, 32-token nodes"),
    ("deep-256", "1,4,16,64,256_512,256,128,64,32", "4-ary tree, halving node lengths"),
    # one long shared prefix
    ("prefix-16k-16", "1,16_16384,16", "16 questions on a 16k-token document"),
    ("prefix-4k-64", "1,64_4096,64", "64 requests behind a 4k-token system prompt"),
    # nothing shared
    ("flat-128x2k", "128_2048", "128 independent 2k-token requests"),
    ("flat-512x1k", "512_1024", "512 independent 1k-token requests"),
    ("flat-1x8k", "1_8192", "one 8k-token request"),
    ("flat-8x4k", "8_4096", "8 independent 4k-token requests"),
    # small batches
    ("small-1", "1_512", "one short request"),
    ("small-2", "1,2_2048,64", "2 samples of a 2k-token prompt"),
    ("small-4", "1,4_1024,32", "4 samples of a 1k-token prompt"),
)
PARTS = ("conv", "agent", "synthetic")


def synthetic_specs() -> list:
    """The tree specs of :data:`SYNTHETIC`, in order (each checked by ``parse_tree_spec``)."""
    from pat_core.workloads import parse_tree_spec
    for name, spec, _ in SYNTHETIC:
        parse_tree_spec(spec)
    return [spec for _, spec, _ in SYNTHETIC]


def spec_counts(spec: str) -> tuple:
    """``(batch, unique_tokens, read_tokens)`` of a tree spec: the requests, the KV tokens of
    the tree's nodes (each once), the KV tokens a per-request kernel reads."""
    from pat_core.workloads import parse_tree_spec
    counts, lens = parse_tree_spec(spec)
    unique = sum(c * n for c, n in zip(counts, lens))
    return counts[-1], unique, counts[-1] * sum(lens)


def _last_arrival_ms(trace) -> float:
    """The largest ``timestamp`` of a trace file (ms)."""
    last = 0.0
    with open(trace) as fh:
        for line in fh:
            if line.strip():
                last = max(last, float(json.loads(line)["timestamp"]))
    return last


def prepare_agent(out, *, steps: int = STEPS, verbose: bool = True) -> dict:
    """Generate the agent trace (:mod:`agent_trace`, defaults) into a temporary file and store
    ``steps`` of its decode steps in ``out``; returns the steps file's ``meta``."""
    from bench import agent_trace
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agent_trace.jsonl"
        agent_trace.write_jsonl(agent_trace.generate(), path)
        return prepare_steps(path, out, steps=steps, page_size=PAGE_SIZE, verbose=verbose,
                             **AGENT)


def prepare(out_dir, *, trace=None, parts=PARTS, steps: int = STEPS,
            verbose: bool = True) -> dict:
    """Write ``parts`` of the development set into ``out_dir`` (``conv.npz``, ``agent.npz``,
    ``synthetic.npz``).  Returns ``{part: {"file", "seconds", "meta"}}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for part in parts:
        path = out_dir / f"{part}.npz"
        t0 = time.perf_counter()
        if part == "conv":
            end = _last_arrival_ms(trace)
            start = CONV["sample_start_ms"] if end > CONV["sample_start_ms"] else 0.0
            meta = prepare_steps(trace, path, steps=steps, page_size=PAGE_SIZE,
                                 verbose=verbose, **dict(CONV, sample_start_ms=start,
                                                         sample_end_ms=end or None))
        elif part == "agent":
            meta = prepare_agent(path, steps=steps, verbose=verbose)
        elif part == "synthetic":
            meta = prepare_synthetic_steps(synthetic_specs(), path, page_size=PAGE_SIZE,
                                           verbose=verbose)
        else:
            raise ValueError(f"unknown part {part!r} (choose from {PARTS})")
        done[part] = dict(file=str(path), seconds=time.perf_counter() - t0, meta=meta)
    return done


def workloads(steps_dir=None) -> list:
    """Rows ``(name, batch, unique_tokens, read_tokens)``: every synthetic spec, then every
    step of ``conv.npz`` / ``agent.npz`` found in ``steps_dir`` (named ``PART/step N``)."""
    rows = [(name, *spec_counts(spec)) for name, spec, _ in SYNTHETIC]
    if steps_dir is not None:
        for part in ("conv", "agent"):
            path = Path(steps_dir) / f"{part}.npz"
            if path.exists():
                meta, _ = load_steps(path)
                rows += [(f"{part}/step {m['step']}", m["batch"], m["unique_tokens"],
                          m["read_tokens"]) for m in meta["steps"]]
    return rows


def _print_rows(rows) -> None:
    print(f"{'workload':<18} {'batch':>5} {'unique KV':>10} {'read KV':>10} {'ratio':>6}")
    for name, b, u, r in rows:
        print(f"{name:<18} {b:>5} {u:>10} {r:>10} {u / max(r, 1):>6.2f}")


def _geo(xs) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def step_floor_us(meta_step: dict, hq: int, hk: int, d: int, bw: float, dtype_bytes: int = 2,
                  *, kv_bytes: int | None = None, q_len: int = 1):
    """Bandwidth floor of one step in us: its unique KV tokens once (K and V, every KV head),
    the queries read and the outputs written once, at the copy bandwidth ``bw`` (bytes/s)."""
    kv = meta_step["unique_tokens"] * hk * 2 * d * (kv_bytes or dtype_bytes)
    qo = 2 * meta_step["batch"] * q_len * hq * d * dtype_bytes
    return (kv + qo) / bw * 1e6


def time_all(steps_dir, out_dir, *, heads=("32:8",), methods=("pat", "pat-graph-bucket",
                                                             "fi-decode"),
             reps: int = 10, parts=PARTS, head_dim: int = 128, kv_dtype: str = "float16",
             q_len: int = 1) -> dict:
    """Time every part of the development set (``bench/trace_replay.py time`` on each steps
    file, into ``out_dir/PART/``), then write ``out_dir/devset.json``: the copy bandwidth, one
    row per (part, step, heads, method) with its bandwidth floor, and per part and heads the
    geometric mean of time / floor per method and pat's speed-up over FlashInfer decode (graph
    replay; eager alongside).  Returns the summary."""
    import platform
    import torch
    from bench import trace_replay
    from bench.common import copy_bandwidth, git_sha
    import pat_core
    out_dir = Path(out_dir)
    bw = copy_bandwidth()
    rows, summary, fi_version = [], {}, None
    for part in parts:
        f = Path(steps_dir) / f"{part}.npz"
        if not f.is_file():
            raise SystemExit(f"{f}: missing (python bench/devset.py prepare --out {steps_dir})")
        trace_replay.main(["time", "--steps-file", str(f), "--out", str(out_dir / part),
                           "--heads", *heads, "--methods", *methods, "--reps", str(reps),
                           "--head-dim", str(head_dim), "--kv-dtype", kv_dtype,
                           "--q-len", str(q_len)])
        res = json.loads((out_dir / part / "trace_replay.json").read_text())
        fi_version = res.get("versions", {}).get("flashinfer", fi_version)
        meta = {m["step"]: m for m in load_steps(f)[0]["steps"]}
        for r in res["rows"]:
            hq, hk = (int(x) for x in r["heads"].split(":"))
            fl = step_floor_us(meta[r["step"]], hq, hk, res["head_dim"], bw,
                               kv_bytes=1 if kv_dtype == "float8_e4m3fn" else 2, q_len=q_len)
            rows.append(dict(part=part, step=r["step"], heads=r["heads"], method=r["method"],
                             batch=meta[r["step"]]["batch"], spec=meta[r["step"]].get("spec"),
                             floor_us=fl, graph_us=r.get("graph_us"),
                             eager_us=r.get("eager_us"), error=r.get("error"),
                             correct=r.get("correct")))
    for part in parts:
        for h in heads:
            sel = [r for r in rows if r["part"] == part and r["heads"] == h]
            by = {}
            for r in sel:
                by.setdefault(r["step"], {})[r["method"]] = r
            s = {}
            for m in methods:
                for kind in ("graph_us", "eager_us"):
                    xs = [v[m][kind] / v[m]["floor_us"] for v in by.values()
                          if m in v and v[m].get(kind)]
                    if xs:
                        s[f"{m}_{kind[:-3]}_over_floor_geo"] = round(_geo(xs), 3)
            fi = "fi-prefill" if q_len > 1 else "fi-decode"    # FlashInfer's path for it
            for kind in ("graph_us", "eager_us"):
                sp = [v[fi][kind] / v["pat"][kind] for v in by.values()
                      if "pat" in v and fi in v and v["pat"].get(kind) and v[fi].get(kind)]
                if sp:
                    s[f"fi_over_pat_{kind[:-3]}_geo"] = round(_geo(sp), 3)
                    s[f"fi_over_pat_{kind[:-3]}_min"] = round(min(sp), 3)
            inv = [v["pat-invariant"]["graph_us"] / v["pat"]["graph_us"] for v in by.values()
                   if "pat" in v and "pat-invariant" in v and v["pat"].get("graph_us")
                   and v["pat-invariant"].get("graph_us")]
            if inv:      # the price of batch_invariant=True (graph)
                s["invariant_over_pat_graph_geo"] = round(_geo(inv), 3)
            summary[f"{part} {h}"] = s
    res = dict(benchmark="devset", device=torch.cuda.get_device_name(), git_sha=git_sha(),
               versions=dict(python=platform.python_version(), torch=torch.__version__,
                             pat=pat_core.__version__, flashinfer=fi_version),
               copy_bandwidth_Bps=bw, heads=list(heads), head_dim=head_dim,
               kv_dtype=kv_dtype, q_len=q_len,
               methods=list(methods), reps=reps,
               method_note="bench/trace_replay.py time per part; floor = unique KV + q + out "
                           "at the copy bandwidth", rows=rows, summary=summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "devset.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"\n== development set ({res['device']}, copy {bw / 1e12:.2f} TB/s) ==")
    for key, s in summary.items():
        print(f"{key:<16} " + "  ".join(f"{k} {v}" for k, v in s.items()))
    return summary


def graph_safe_bucket(gpu: str, limits, group: int, head_dim: int, kv_dtype: str) -> tuple:
    """``(planner, launch_set)`` of a graph-safe wrapper with ``limits`` (a
    :class:`~pat_core.static_plan.StaticLimits`) on ``gpu``, as the wrapper sets them up
    (default tuning, the backend's default ``graph_fused``): the planner with the tuning the
    wrapper gives it (:func:`~pat_core.static_plan.graph_safe_tuning`) and the launch set
    ``(tiles, fused)`` (:func:`~pat_core.static_plan.graph_safe_launch_set`)."""
    import dataclasses
    from pat_core import Planner
    from pat_core.static_plan import graph_safe_launch_set, graph_safe_tuning
    planner = Planner("pat", gpu)
    auto = graph_safe_tuning(planner.gpu, planner.tuning, limits, group, head_dim, kv_dtype)
    planner.tuning = dataclasses.replace(planner.tuning, **auto)
    return planner, graph_safe_launch_set(planner.gpu, planner.tuning, limits, group,
                                          head_dim, kv_dtype)


def sim_error(steps_dir, results, *, gpu: str = "h100") -> dict:
    """The simulator against a measured ``devset.json`` (``results``): every step planned as
    the measured ``pat`` method plans it (default planner, that file's heads, head_dim, KV
    dtype and query tokens per request), predicted in graph and eager timing
    (:func:`sim.simulate`, packaged constants), and the relative error
    ``predicted / measured - 1`` per part: median and largest absolute, mean signed.  The
    graph-safe methods measured in the file (``pat-graph``, ``pat-graph-bucket``; one token
    per request) are priced with their wrapper's planner tuning and launch set
    (:func:`graph_safe_bucket`; ``simulate(..., launch_set=)``), under keys ending in the
    method's name.  Runs on the CPU."""
    import numpy as np
    from pat_core import Planner
    from pat_core.static_plan import StaticLimits
    from sim import simulate
    from bench.trace_replay import GRAPH_SAFE, batch_bucket, graph_safe_buckets
    res = json.loads(Path(results).read_text())
    d = int(res.get("head_dim", 128))
    kv_dtype, q_len = res.get("kv_dtype", "float16"), int(res.get("q_len", 1))
    methods = ["pat"] + ([m for m in GRAPH_SAFE if m in res.get("methods", ())]
                         if q_len == 1 else [])
    meas = {(r["part"], r["step"], r["heads"], r["method"]): r for r in res["rows"]}
    planner = Planner("pat", gpu)
    out = {}
    for part in sorted({r["part"] for r in res["rows"]}):
        meta, steps = load_steps(Path(steps_dir) / f"{part}.npz")
        ps = meta["config"]["page_size"]
        for heads in res["heads"]:
            hq, hk = (int(x) for x in heads.split(":"))
            plans = [planner.plan(table, lens, hq, hk, d, ps,
                                  **pat_plan_kw(kv_dtype, q_len, len(lens)))
                     for _, table, lens in steps]
            for method in methods:
                errs = {"graph": [], "eager": []}
                sets = {}
                if method != "pat":
                    buckets = method == "pat-graph-bucket"
                    for key, lim in graph_safe_buckets(plans, steps, ps, buckets).items():
                        sets[key] = graph_safe_bucket(gpu, StaticLimits.make(*lim), hq // hk,
                                                      d, kv_dtype)
                for (m, table, lens), plan in zip(steps, plans):
                    row = meas.get((part, m["step"], heads, method))
                    if row is None:
                        continue
                    launch_set = None
                    if method != "pat":
                        # as the wrapper plans it: its own tuning (graph_safe_tuning's)
                        bp, launch_set = sets[batch_bucket(plan.batch_size, buckets)]
                        plan = bp.plan(table, lens, hq, hk, d, ps,
                                       **pat_plan_kw(kv_dtype, q_len, len(lens)))
                    for timing in errs:
                        if row.get(f"{timing}_us"):
                            pred = simulate(plan, gpu, timing=timing,
                                            launch_set=launch_set).latency_us
                            errs[timing].append(pred / row[f"{timing}_us"] - 1.0)
                tag = "" if method == "pat" else f" {method}"
                for timing, e in errs.items():
                    if e:
                        a = np.abs(e)
                        out[f"{part} {heads} {timing}{tag}"] = dict(
                            steps=len(e), median_abs=round(float(np.median(a)), 4),
                            max_abs=round(float(a.max()), 4), mean=round(float(np.mean(e)), 4))
    for timing in ("graph", "eager"):
        for method in methods:
            tag = "" if method == "pat" else f" {method}"
            every = [k for k in out if k.endswith(f" {timing}{tag}")
                     and (tag or k.endswith(f" {timing}"))]
            if every:
                print(f"{timing}{tag}: " + ", ".join(
                    f"{k.split(' ')[0]} median {100 * out[k]['median_abs']:.1f}% (max "
                    f"{100 * out[k]['max_abs']:.1f}%)" for k in every))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write conv.npz, agent.npz and synthetic.npz")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--trace", help="the conversation trace (.jsonl; needed for the conv part)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--steps", type=int, default=STEPS, help="decode steps per trace part")
    ls = sub.add_parser("list", help="print the workloads")
    ls.add_argument("--dir", default=str(DEFAULT_DIR),
                    help="prepared steps files whose trace steps to list too")
    tm = sub.add_parser("time", help="time every part on the GPU into one results file")
    tm.add_argument("--dir", default=str(DEFAULT_DIR), help="the prepared steps files")
    tm.add_argument("--out", required=True, help="output directory")
    tm.add_argument("--heads", nargs="+", default=["32:8"])
    tm.add_argument("--methods", nargs="+", default=["pat", "pat-graph-bucket", "fi-decode"])
    tm.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    tm.add_argument("--reps", type=int, default=10)
    tm.add_argument("--head-dim", type=int, default=128, choices=HEAD_DIMS,
                    help="head_dim of the timed model (one of the CUDA kernels' head_dims)")
    tm.add_argument("--kv-dtype", default="float16", choices=("float16", "float8_e4m3fn"))
    tm.add_argument("--q-len", type=int, default=1, help="query tokens per request (1..16)")
    se = sub.add_parser("sim-error", help="the simulator's error on a measured devset.json "
                                          "(CPU)")
    se.add_argument("--dir", default=str(DEFAULT_DIR), help="the prepared steps files")
    se.add_argument("--results", required=True, help="devset.json of `devset.py time`")
    se.add_argument("--gpu", default="h100")
    args = ap.parse_args(argv)
    if args.cmd == "sim-error":
        print(json.dumps(sim_error(args.dir, args.results, gpu=args.gpu), indent=1))
        return 0
    if args.cmd == "time":
        time_all(args.dir, args.out, heads=args.heads, methods=args.methods, reps=args.reps,
                 parts=args.parts, head_dim=args.head_dim, kv_dtype=args.kv_dtype,
                 q_len=args.q_len)
        return 0
    if args.cmd == "list":
        _print_rows(workloads(args.dir))
        return 0
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if "conv" in args.parts and (args.trace is None or not Path(args.trace).is_file()):
        ap.error(f"--trace {args.trace}: no such file (the conv part replays it)")
    done = prepare(args.out, trace=args.trace, parts=args.parts, steps=args.steps)
    print("\n== development set ==")
    for part, d in done.items():
        steps = d["meta"]["steps"]
        kb = Path(d["file"]).stat().st_size / 1024
        ratios = [m["unique_tokens"] / max(m["read_tokens"], 1) for m in steps]
        print(f"{part:<10} {kb:8.1f} KB  {d['seconds']:6.1f} s  {len(steps)} steps, batch "
              f"{min(m['batch'] for m in steps)}-{max(m['batch'] for m in steps)}, "
              f"unique/read KV {min(ratios):.2f}-{max(ratios):.2f}")
    print(json.dumps({p: [m["batch"] for m in d["meta"]["steps"]] for p, d in done.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
