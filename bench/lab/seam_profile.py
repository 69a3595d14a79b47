"""Where a decode step's attention calls spend host time inside transformers, per implementation.

Runs ``bench/engine_e2e.py``'s model and workload, then for each implementation one
``generate_batch`` with its attention function wrapped: host time of every call (the step's
first call, which plans, apart from the rest), CUDA-event time of every call, a cProfile of
the calls only (the engine runs them on its own thread), and a second run that queues ~2 ms of
GPU sleep before each call to see whether the call waits for the device.

    python bench/lab/seam_profile.py --model gqa-small --workload none --requests 64 \
        --impls "paged|pat paged|fi-decode" --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench import engine_e2e as e2e   # noqa: E402


def wrapped(fn, rec, prof, sleep_cycles):
    import torch

    def call(*a, **kw):
        step_key = id(kw.get("cu_seq_lens_q"))
        decode = int(kw.get("max_seqlen_q") or 0) <= e2e.MAX_QO_LEN
        if sleep_cycles and decode:
            torch.cuda._sleep(sleep_cycles)
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        t = time.perf_counter()
        if decode and prof is not None:
            prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            if decode and prof is not None:
                prof.disable()
            dt = time.perf_counter() - t
            e.record()
            if decode:
                first = rec["last_key"] != step_key
                rec["last_key"] = step_key
                rows = int(a[1].shape[2])
                rec["first" if first else "rest"].append((rows, dt))
                rec["events"].append((s, e, first, rows))
    return call


def run_impl(model, impl, prompts, args, seam, sleep_cycles, profile):
    import torch
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    fn = ALL_ATTENTION_FUNCTIONS[impl]
    rec = {"last_key": None, "first": [], "rest": [], "events": []}
    prof = cProfile.Profile() if profile else None
    AttentionInterface.register(impl, wrapped(fn, rec, prof, sleep_cycles))
    if seam is not None:
        seam.reset_stats()
    try:
        t0 = time.perf_counter()
        e2e.generate(model, impl, prompts, args.new_tokens, args)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        AttentionInterface.register(impl, fn)
    # the full batch's steps only (requests join as their prefills end)
    top = max(r for *_, r in rec["events"])
    ev_first = [s.elapsed_time(e) for s, e, f, r in rec["events"] if f and r == top]
    ev_rest = [s.elapsed_time(e) for s, e, f, r in rec["events"] if not f and r == top]
    for k in ("first", "rest"):
        rec[k] = [dt for r, dt in rec[k] if r == top]
    s = io.StringIO()
    s2 = io.StringIO()
    if prof is not None:
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(40)
    med = lambda x: float(np.median(x)) * 1e3 if len(x) else None   # noqa: E731
    return {"impl": impl, "sleep_cycles": sleep_cycles, "profiled": profile, "wall_s": wall,
            "rows": top, "calls_first": len(rec["first"]), "calls_rest": len(rec["rest"]),
            "host_ms_first_median": med(rec["first"]), "host_ms_rest_median": med(rec["rest"]),
            "host_ms_rest_p90": float(np.percentile(rec["rest"], 90)) * 1e3
            if rec["rest"] else None,
            "event_ms_first_median": float(np.median(ev_first)) if ev_first else None,
            "event_ms_rest_median": float(np.median(ev_rest)) if ev_rest else None,
            "seam_stats": dict(seam.stats) if seam is not None else None,
            "profile_tottime": s.getvalue(), "profile_cumulative": s2.getvalue()}


PHASES = (("pat_core.wrapper", "PrefixAttentionWrapper", "run"),
          ("pat_core.cuda_backend", "CudaBackend", "run"),
          ("pat_core.cuda_backend", "CudaBackend", "_run_state"),
          ("pat_core.cuda_backend", "CudaBackend", "_outputs"),
          ("pat_core.cuda_backend", "CudaBackend", "_enqueue"),
          ("pat_core.cuda_state", "StaticState", "live_launches"),
          ("pat_core.cuda_state", "StaticState", "check_inputs"),
          ("pat_core.wrapper", "PrefixAttentionWrapper", "plan_csr"),
          ("pat_core.cuda_backend", "CudaBackend", "upload"),
          ("pat_core.integrations.transformers", "PatPagedAttention", "plan_step"),
          ("pat_core.cuda_launch", "_Launch", "__call__"),
          ("pat_core.cuda_views", "_Dev", "__init__"),
          ("pat_core.integrations.transformers", "PatPagedAttention", "_query_rows"),
          ("pat_core.integrations.transformers", "PatPagedAttention", "_new_step"),
          ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper", "run"),
          ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper", "plan"))


TOP = {"run", "_query_rows", "_new_step", "plan_step", "plan"}   # not nested in one another


def install_phase_timers(times: dict, top: bool = False):
    """Wrap each PHASES method (``top``: only those named in :data:`TOP`, so no timer runs
    inside another) with a perf_counter timer appending to ``times[name]``; returns the undo
    list."""
    import importlib
    undo = []
    for mod, cls, meth in PHASES:
        if top and (meth not in TOP or cls == "CudaBackend"):
            continue
        try:
            c = getattr(importlib.import_module(mod), cls)
        except Exception:
            continue
        orig = c.__dict__[meth]
        lst = times.setdefault(f"{cls}.{meth}", [])

        def timed(*a, __orig=orig, __lst=lst, **kw):
            t = time.perf_counter()
            try:
                return __orig(*a, **kw)
            finally:
                __lst.append(time.perf_counter() - t)
        setattr(c, meth, timed)
        undo.append((c, meth, orig))
    return undo


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gqa-small")
    ap.add_argument("--workload", default="none")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--impls", default="paged|pat paged|fi-decode")
    ap.add_argument("--sleep-cycles", type=int, default=4_000_000)
    ap.add_argument("--phases", action="store_true",
                    help="only time the run path's phases (one run per implementation)")
    ap.add_argument("--top", action="store_true",
                    help="with --phases: only the outermost calls (run, plan, query rows)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    args = e2e.parse_args(["--model", a.model, "--workload", a.workload, "--requests",
                           str(a.requests), "--prompt-tokens", str(a.prompt_tokens),
                           "--new-tokens", str(a.new_tokens)])
    os.makedirs(a.out, exist_ok=True)
    model, cfg = e2e.build_model(args.model, args.dtype, "cuda", None, 0)
    lo, hi = (int(x) for x in args.suffix.split(","))
    prompts, _ = e2e.build_workload(args.workload, args.requests, args.prompt_tokens,
                                    cfg["vocab_size"], 1, suffix=(lo, hi), samples=8,
                                    templates=4, turns=4)
    from pat_core.integrations.transformers import register_pat
    seams = {}
    for impl in a.impls.split():
        seams[impl] = register_pat(impl) if impl == e2e.PAT_IMPL else \
            e2e.register_flashinfer_decode(impl)
        e2e.generate(model, impl, prompts, 4, args)          # warm-up (compiles)
    rows = []
    if a.phases:
        for impl in a.impls.split():
            times = {}
            undo = install_phase_timers(times, a.top)
            try:
                r = run_impl(model, impl, prompts, args, seams[impl], 0, False)
            finally:
                for c, meth, orig in undo:
                    setattr(c, meth, orig)
            r["phases_us_median"] = {k: float(np.median(v)) * 1e6 for k, v in times.items() if v}
            r["phases_calls"] = {k: len(v) for k, v in times.items() if v}
            rows.append(r)
            print(impl, f"host rest {r['host_ms_rest_median']:.3f} ms",
                  json.dumps({k: round(v, 1) for k, v in r["phases_us_median"].items()}),
                  flush=True)
        with open(os.path.join(a.out, "phases.json"), "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("profile")}
                       for r in rows], f, indent=1)
        return
    for sleep, profile in ((0, True), (0, False), (a.sleep_cycles, False)):
        for impl in a.impls.split():
            r = run_impl(model, impl, prompts, args, seams[impl], sleep, profile)
            rows.append(r)
            print(f"{impl:<18} sleep {sleep:>9} prof {profile:d} rows {r['rows']} ({r['calls_rest']})"
                  f"  host first "
                  f"{r['host_ms_first_median']:.3f} rest {r['host_ms_rest_median']:.3f} "
                  f"(p90 {r['host_ms_rest_p90']:.3f}) ms  event first "
                  f"{r['event_ms_first_median']:.3f} rest {r['event_ms_rest_median']:.3f} ms",
                  flush=True)
            if not profile:
                continue
            tag = impl.replace("|", "_")
            with open(os.path.join(a.out, f"prof_{tag}.txt"), "w") as f:
                f.write(r["profile_tottime"] + "\n\n" + r["profile_cumulative"])
    with open(os.path.join(a.out, "seam_profile.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if not k.startswith("profile")} for r in rows],
                  f, indent=1)


if __name__ == "__main__":
    main()
