"""``python -m sim trace``: replay a request trace through the planner and the simulator.

The decode loop itself (arrivals, prefix-cached pages, admission, one token per request per
step) is :func:`pat_core.trace.replay`; this module plans each step's block table with every
method (one :class:`pat_core.Planner` per method, kept across steps so the lazy update applies),
simulates the plan, and reports:

* per method, the predicted attention time per step (distribution, total over the replay) and
  its ratio to the query-centric method;
* the unique-vs-read KV ratio and the batch size over time;
* the measured wall time of ``Planner.plan()`` per step (and which path it took: ``full``,
  ``lengths`` (lazy update) or ``reuse``).

Planning and simulating every step of an hour is slow (tens of ms per method and step), so
``every`` evaluates one step in ``every`` (the scheduling itself runs every step).  The step
just before an evaluated one is planned too, untimed, so that the timed ``plan()`` is a real
next-step call, as in a serving loop.  Totals over the replay are estimated as the mean over
the evaluated steps times the number of steps.  Prefill is not modelled (see
:mod:`pat_core.trace`).

Example::

    python -m sim trace --trace conversation_trace.jsonl --duration-s 600 --every 4 --out t
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from pat_core import Planner
from pat_core.gpus import get_gpu
from pat_core.trace import ReplayConfig, ReplayStats, load_trace, replay

from .constants import load_constants
from .methods import METHODS, method_options
from .model import simulate

DEFAULT_METHODS = ("pat", "query", "cascade")
# The engine's free list holds one Python int per page: 2^22 pages is ~150 MB of host memory
# (and 2^26 tokens of KV at 16-token pages, far beyond one GPU's cache for one layer).
MAX_KV_PAGES = 2**22


# ---------------------------------------------------------------------------- CLI wiring
def add_parser(sub) -> None:
    """Register the ``trace`` subcommand on ``sub`` (an argparse subparsers object)."""
    from pat_core.__main__ import _positive

    from .args import _heads, _methods, _nonneg_number, _positive_number
    p = sub.add_parser("trace", help="replay a request trace (JSON lines) as continuous-"
                                     "batching decode steps through planner and simulator")
    p.add_argument("--trace", required=True, help="trace file: one JSON object a line with "
                   "timestamp (ms), input_length, output_length, hash_ids")
    p.add_argument("--out", required=True, help="output file prefix: writes OUT.json and "
                   "OUT.png (a directory is refused: name a file in it)")
    p.add_argument("--methods", type=_methods, default=list(DEFAULT_METHODS),
                   help="comma-separated (default pat,query,cascade)")
    g = p.add_argument_group("cutting the trace")
    g.add_argument("--start-s", type=_nonneg_number, default=0.0,
                   help="keep arrivals from here (s)")
    g.add_argument("--duration-s", type=_positive_number, default=None,
                   help="keep arrivals in [start, start + duration) (default: to the end)")
    g.add_argument("--sample", type=_positive_number, default=1.0,
                   help="keep each request with this probability (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed of --sample")
    g.add_argument("--max-requests", type=_positive, default=None)
    g.add_argument("--max-steps", type=_positive, default=None,
                   help="stop after this many steps")
    g.add_argument("--every", type=_positive, default=1,
                   help="plan and simulate one step in EVERY (default 1: all of them)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-batch", type=_positive, default=256, help="most running requests")
    g.add_argument("--kv-pages", type=_kv_pages, default=32768,
                   help=f"KV-cache capacity in pages (at most {MAX_KV_PAGES}: the engine keeps "
                        f"a free list of every page)")
    g.add_argument("--step-ms", type=_positive_number, default=25.0,
                   help="simulated time per step")
    g.add_argument("--block-tokens", type=_positive, default=512, help="tokens per hash id")
    g = p.add_argument_group("model and GPU")
    g.add_argument("--heads", type=_heads, default=(32, 8), help="query:KV heads (32:8)")
    g.add_argument("--head-dim", type=_positive, default=128)
    g.add_argument("--page-size", type=_positive, default=16)
    g.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    g.add_argument("--gpu", default="h100", help="a100, h100 or h200 (default h100)")
    g.add_argument("--constants", default=None, help="constants JSON (default sim/data/<gpu>)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--no-plot", action="store_true", help="JSON only")


def _kv_pages(s: str) -> int:
    """``--kv-pages``: a positive int up to :data:`MAX_KV_PAGES`."""
    import argparse

    from pat_core.__main__ import _positive
    v = _positive(s)
    if v > MAX_KV_PAGES:
        raise argparse.ArgumentTypeError(f"{v} pages; the limit is {MAX_KV_PAGES}")
    return v


def run_cli(args) -> int:
    """The ``trace`` subcommand: replay, write ``OUT.json`` and ``OUT.png``, print a summary."""
    from .args import out_prefix
    out_prefix(args.out)                         # a bad --out fails before the replay
    cfg = ReplayConfig(page_size=args.page_size, block_tokens=args.block_tokens,
                       max_batch=args.max_batch, kv_pages=args.kv_pages, step_ms=args.step_ms)
    start_ms = 1000.0 * args.start_s
    end_ms = None if args.duration_s is None else start_ms + 1000.0 * args.duration_s
    t0 = time.perf_counter()
    reqs = load_trace(args.trace, start_ms=start_ms, end_ms=end_ms, sample=args.sample,
                      seed=args.seed, max_requests=args.max_requests,
                      block_tokens=args.block_tokens)
    load_s = time.perf_counter() - t0
    if not reqs:
        raise ValueError(f"{args.trace}: no request in the chosen window")
    res = replay_report(reqs, cfg, args.methods, heads=args.heads, head_dim=args.head_dim,
                        gpu=args.gpu, dtype=args.dtype, constants=args.constants,
                        every=args.every, max_steps=args.max_steps,
                        progress=not args.no_progress)
    res["wall_s"]["load"] = round(load_s, 3)
    res["wall_s"]["total"] = round(time.perf_counter() - t0, 3)
    res["trace"] = {"file": os.path.basename(args.trace), "start_s": args.start_s,
                    "duration_s": args.duration_s, "sample": args.sample, "seed": args.seed,
                    "max_requests": args.max_requests, "max_steps": args.max_steps,
                    "requests": len(reqs)}
    res["command"] = "python -m sim " + " ".join(_argv_tail())
    res["git_sha"] = _git_sha()
    with open(args.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    if not args.no_plot:
        trace_plot(res, args.out + ".png")
    print(format_summary(res))
    print(f"-> {args.out}.json" + ("" if args.no_plot else f", {args.out}.png"))
    return 0


def _argv_tail():
    argv = sys.argv[1:]
    out = []
    for a in argv:                     # keep the trace's file name, not where it lives
        out.append(os.path.basename(a) if a.endswith(".jsonl") else a)
    return out


def _git_sha():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------------------- the replay
class _Progress:
    """One self-overwriting stderr line, at most twice a second."""

    def __init__(self, enabled: bool, end_ms: float, start_ms: float):
        self.enabled, self.end_ms, self.start_ms = enabled, end_ms, start_ms
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, step, force: bool = False):
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < 0.5:
            return
        self.last = now
        el = now - self.t0
        span = max(self.end_ms - self.start_ms, 1.0)
        frac = min(max((step.time_ms - self.start_ms) / span, 1e-9), 1.0)
        eta = f"{el * (1 - frac) / frac:6.0f} s" if frac > 0.01 else "     ? s"
        sys.stderr.write(f"\rtrace: {frac * 100:5.1f}%  t={step.time_ms / 1e3:8.1f} s  "
                         f"step {step.step:7d}  batch {step.batch_size:4d}  "
                         f"queued {step.queued:4d}  wall {el:6.0f} s  eta {eta} ")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _pct(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {}
    q = np.percentile(x, [10, 50, 90, 99])
    return {"mean": float(x.mean()), "p10": float(q[0]), "p50": float(q[1]),
            "p90": float(q[2]), "p99": float(q[3]), "min": float(x.min()),
            "max": float(x.max())}


def replay_report(requests, config: ReplayConfig, methods, *, heads=(32, 8), head_dim=128,
                  gpu="h100", dtype="float16", constants=None, every: int = 1,
                  max_steps: int | None = None, progress: bool = False) -> dict:
    """Replay ``requests`` (see :func:`pat_core.trace.replay`) and evaluate one step in
    ``every`` with each of ``methods``; returns the JSON-ready report (module docstring)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {sorted(METHODS)}, got "
                         f"{list(methods)}")
    hq, hk = heads
    consts = load_constants(gpu, constants)
    planners = {m: Planner(METHODS[m][0], gpu) for m in methods}
    kws = {m: dict(method_options(m, head_dim)[1], kv_data_type=dtype) for m in methods}
    st = ReplayStats()
    cols = {k: [] for k in ("step", "time_s", "batch", "queued", "read_tokens",
                            "unique_tokens", "used_pages")}
    pred = {m: [] for m in methods}
    plan_ms = {m: [] for m in methods}
    paths = {m: {} for m in methods}
    ctas = {m: [] for m in methods}
    all_batch = []
    all_ratio = []
    t_plan = t_sim = 0.0
    last_arrival = requests[-1].arrival_ms if requests else 0.0
    bar = _Progress(progress, last_arrival, requests[0].arrival_ms if requests else 0.0)
    _warm_up(methods, gpu, kws, hq, hk, head_dim, config.page_size)
    t_start = time.perf_counter()
    # block tables are needed only on evaluated steps and the steps right before them
    wanted = _TableSteps(every)
    for s in replay(requests, config, max_steps=max_steps, stats=st, tables=wanted):
        all_batch.append(s.batch_size)
        all_ratio.append(s.unique_tokens / s.read_tokens)
        bar.update(s)
        pos = s.step % every
        if every > 1 and pos == every - 1:
            for m in methods:                 # warm the lazy update: the previous step
                planners[m].plan(s.block_table, s.seq_lens, hq, hk, head_dim, s.page_size,
                                 **kws[m])
            continue
        if pos != 0:
            continue
        cols["step"].append(s.step)
        cols["time_s"].append(round(s.time_ms / 1e3, 3))
        cols["batch"].append(s.batch_size)
        cols["queued"].append(s.queued)
        cols["read_tokens"].append(s.read_tokens)
        cols["unique_tokens"].append(s.unique_tokens)
        cols["used_pages"].append(s.used_pages)
        for m in methods:
            t = time.perf_counter()
            plan = planners[m].plan(s.block_table, s.seq_lens, hq, hk, head_dim, s.page_size,
                                    **kws[m])
            dt = time.perf_counter() - t
            t_plan += dt
            p = planners[m].last_path
            paths[m][p] = paths[m].get(p, 0) + 1
            plan_ms[m].append(round(dt * 1e3, 4))
            t = time.perf_counter()
            r = simulate(plan, gpu, consts)
            t_sim += time.perf_counter() - t
            pred[m].append(round(r.latency_us, 3))
            ctas[m].append(plan.num_ctas)
    if st.steps:
        bar.update(s, force=True)
    bar.close()
    if not st.steps:
        raise ValueError(_nothing_scheduled(requests, config, st))
    wall = time.perf_counter() - t_start
    n_eval = len(cols["step"])
    summary = {}
    for m in methods:
        x = np.asarray(pred[m], dtype=np.float64)
        row = {"predicted_us": _pct(x),
               "total_ms_evaluated": float(x.sum() / 1e3),
               "total_ms_estimated": float(x.mean() * st.steps / 1e3) if n_eval else 0.0,
               "plan_ms": _pct(plan_ms[m]), "plan_paths": paths[m],
               "ctas": _pct(ctas[m])}
        if "query" in methods and m != "query" and n_eval:
            ratio = np.asarray(pred["query"], dtype=np.float64) / np.maximum(x, 1e-9)
            row["speedup_vs_query"] = dict(_pct(ratio),
                                           geomean=float(np.exp(np.log(ratio).mean())))
        summary[m] = row
    ab = np.asarray(all_batch, dtype=np.float64)
    ar = np.asarray(all_ratio, dtype=np.float64)
    return {
        "config": {"page_size": config.page_size, "block_tokens": config.block_tokens,
                   "max_batch": config.max_batch, "kv_pages": config.kv_pages,
                   "step_ms": config.step_ms},
        "model": {"heads": [hq, hk], "head_dim": head_dim, "dtype": dtype,
                  "gpu": get_gpu(gpu).name, "constants_source": consts.source},
        "methods": list(methods), "every": every,
        "prefill": "not modelled: prompt KV appears at admission at no cost",
        "replay": {"steps": st.steps, "evaluated_steps": n_eval, "admitted": st.admitted,
                   "finished": st.finished, "rejected": len(st.rejected),
                   "simulated_s": round(st.end_ms / 1e3 - (requests[0].arrival_ms / 1e3
                                                           if requests else 0.0), 3),
                   "max_batch_seen": st.max_batch_seen, "max_used_pages": st.max_used_pages,
                   "batch": _pct(ab), "unique_over_read": _pct(ar)},
        "wall_s": {"replay": round(wall, 3), "plan": round(t_plan, 3),
                   "simulate": round(t_sim, 3)},
        "summary": summary,
        "series": dict(cols, predicted_us=pred, plan_ms=plan_ms),
    }


def _nothing_scheduled(requests, config: ReplayConfig, st: ReplayStats) -> str:
    """Why a replay ran no step: every request was rejected as larger than the whole cache
    (a report of zero steps would have no statistics to show)."""
    need = max(-(-(r.input_length + r.output_length) // config.page_size) for r in requests)
    return (f"no request can ever be scheduled: {len(st.rejected)} of {len(requests)} "
            f"rejected as larger than the KV cache ({config.kv_pages} pages of "
            f"{config.page_size} tokens, --kv-pages); the largest needs about {need} pages "
            f"for its prompt and output")


def _warm_up(methods, gpu, kws, hq, hk, head_dim, page_size) -> None:
    """Plan a two-request batch once per method with a throwaway planner, so the compile time
    of the planner's Numba kernels does not land in the first timed step."""
    table = np.array([[0, 1], [0, 2]], dtype=np.int32)
    for m in methods:
        Planner(METHODS[m][0], gpu).plan(table, np.array([page_size + 1, page_size + 2],
                                                         dtype=np.int32),
                                         hq, hk, head_dim, page_size, **kws[m])


class _TableSteps:
    """Container of the step indices whose block table a report needs (``in`` only)."""

    def __init__(self, every: int):
        self.every = every

    def __contains__(self, step) -> bool:
        pos = step % self.every
        return pos == 0 or pos == self.every - 1


# ---------------------------------------------------------------------------- output
def format_summary(res: dict) -> str:
    rp, cfg = res["replay"], res["config"]
    lines = [
        f"{res['trace']['requests'] if 'trace' in res else '?'} requests, {rp['steps']} decode "
        f"steps ({rp['simulated_s']:.0f} s at {cfg['step_ms']} ms/step), {rp['evaluated_steps']} "
        f"evaluated (every {res['every']}); admitted {rp['admitted']}, finished "
        f"{rp['finished']}, rejected {rp['rejected']}",
        f"batch mean {rp['batch']['mean']:.1f} (max {rp['max_batch_seen']}), unique/read KV "
        f"mean {rp['unique_over_read']['mean']:.3f} (min {rp['unique_over_read']['min']:.3f}), "
        f"peak pages {rp['max_used_pages']} of {cfg['kv_pages']}",
        f"wall: {res['wall_s'].get('total', res['wall_s']['replay']):.1f} s "
        f"(plan {res['wall_s']['plan']:.1f} s, simulate {res['wall_s']['simulate']:.1f} s)",
        f"{'method':<11} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'total s':>8} "
        f"{'x query':>8} {'plan p50 ms':>11} {'plan p99':>9}  paths",
    ]
    for m, r in res["summary"].items():
        sp = r.get("speedup_vs_query", {}).get("geomean")
        pu, pm = r["predicted_us"], r["plan_ms"]
        if not pu:
            continue
        lines.append(f"{m:<11} {pu['p50']:>8.1f} {pu['p90']:>8.1f} {pu['p99']:>8.1f} "
                     f"{r['total_ms_estimated'] / 1e3:>8.2f} "
                     f"{(f'{sp:.3f}' if sp else '-'):>8} {pm['p50']:>11.3f} {pm['p99']:>9.3f}"
                     f"  {r['plan_paths']}")
    return "\n".join(lines)


def trace_plot(res: dict, path: str) -> None:
    """Six panels: batch size and queue, unique/read KV, predicted time per step over time and
    its CDF, plan() time per step, speed-up over the query-centric method."""
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = res["series"]
    t = np.asarray(s["time_s"], dtype=np.float64)
    fig, ax = plt.subplots(3, 2, figsize=(13, 11))
    a = ax[0, 0]
    a.plot(t, s["batch"], lw=0.6, label="running (batch)")
    a.plot(t, s["queued"], lw=0.6, label="queued")
    a.set_ylabel("requests")
    a.set_title("batch size over time")
    a.legend(loc="upper right", fontsize=8)
    a = ax[0, 1]
    read = np.maximum(np.asarray(s["read_tokens"], dtype=np.float64), 1)
    a.plot(t, np.asarray(s["unique_tokens"]) / read, lw=0.6)
    a.set_ylim(0, 1.02)
    a.set_ylabel("unique / read KV tokens")
    a.set_title("unique / read KV tokens over time (1: nothing shared)")
    a = ax[1, 0]
    for m, ys in s["predicted_us"].items():
        a.plot(t, ys, lw=0.5, label=m)
    a.set_ylabel("predicted attention time per step (us)")
    a.set_title(f"{res['model']['gpu']}, heads {res['model']['heads'][0]}:"
                f"{res['model']['heads'][1]}, d {res['model']['head_dim']}, one layer")
    a.legend(fontsize=8)
    a = ax[1, 1]
    for m, ys in s["predicted_us"].items():
        y = np.sort(np.asarray(ys, dtype=np.float64))
        if y.size:
            a.plot(y, np.arange(1, y.size + 1) / y.size, label=m)
    a.set_xlabel("predicted attention time per step (us)")
    a.set_ylabel("fraction of steps")
    a.set_title("distribution over steps")
    a.legend(fontsize=8)
    a = ax[2, 0]
    for m, ys in s["plan_ms"].items():
        a.plot(t, ys, lw=0.4, label=m)
    a.set_yscale("log")
    a.set_ylabel("plan() wall time (ms)")
    a.set_xlabel("trace time (s)")
    a.set_title("measured planning time per step (this CPU)")
    a.legend(fontsize=8)
    a = ax[2, 1]
    if "query" in s["predicted_us"]:
        q = np.asarray(s["predicted_us"]["query"], dtype=np.float64)
        for m, ys in s["predicted_us"].items():
            if m == "query":
                continue
            r = q / np.maximum(np.asarray(ys, dtype=np.float64), 1e-9)
            a.plot(t, r, lw=0.5, label=m)
        a.axhline(1.0, color="k", lw=0.5)
        a.set_ylabel("predicted speed-up over query-centric")
    a.set_xlabel("trace time (s)")
    a.set_title("per-step speed-up")
    a.legend(fontsize=8)
    fig.suptitle(f"trace replay: {res.get('trace', {}).get('file', '')}, "
                 f"{res['replay']['steps']} steps, every {res['every']} evaluated; "
                 "decode only (prefill not modelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
