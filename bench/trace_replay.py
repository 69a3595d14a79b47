"""Decode steps of a real trace, timed on the GPU: pat, the query packer and FlashInfer decode.

Two stages, so the slow part (replaying the trace's hour of continuous batching, a few minutes
of CPU) runs once, on any machine, and the GPU machine only times:

    python bench/trace_replay.py prepare --trace TRACE.jsonl --steps 20 --out STEPS.npz
    python bench/trace_replay.py time --steps-file STEPS.npz --out DIR [--heads 32:8 ...]

``prepare`` replays the trace with :func:`pat_core.trace.snapshot_steps` (the engine of
``python -m sim trace``: arrivals by timestamp, prompt pages shared by hash id, one token per
running request per step, admission bounded by ``--max-batch`` and ``--kv-pages``; prefill is
out of scope) and stores ``--steps`` decode steps spread evenly over the replay, each with its
block table and lengths.

``time`` fills one random K/V cache of ``kv_pages`` pages (one layer), and for every stored
step and head configuration: plans each method (host ``plan()`` time recorded), checks its
output against float64 attention computed request by request (relative error at most twice
that of a plain same-dtype torch implementation, or 2**-11), then times it with CUDA events,
L2 flushed before each run, median of ``--reps``: eagerly and as a CUDA graph captured for that
step's plan.  Each step first runs its first method once untimed (``--no-throwaway`` skips it):
the graph replay of whichever method came first after the float64 reference measured up to 18%
slow on long steps.  Methods: ``pat``, ``query`` (pat's kernels, one request per CTA),
``fi-decode`` (FlashInfer's batch decode, when it imports) and ``pat-graph``: pat's graph-safe mode, one
wrapper and ONE graph per head configuration, captured at the first step and replayed for every
later step after ``plan()`` (limits from the largest step; ``graph_us`` is that replay, what a
serving loop sees), so its ratio to ``pat`` is the price of graph safety; ``pat-graph-bucket``:
the same with one wrapper and graph per power-of-two batch bucket (``max_batch_size`` = the
bucket), as serving engines capture decode per batch size; ``pat-invariant``: pat planned with
``batch_invariant=True``.  ``--kv-dtype float8_e4m3fn`` stores the cache in FP8 with
``--kv-scales`` (every method reads it; q and outputs stay float16); ``--q-len N`` gives every
request N query tokens, causal among themselves (speculative decoding's verify step), where
``fi-prefill`` (FlashInfer's paged prefill wrapper, causal) is the baseline instead of
``fi-decode``.

``prepare-synthetic --specs SPEC ... --out STEPS.npz`` stores tree specs
(:func:`pat_core.workloads.build_tree_batch`) in the same format, so the synthetic workloads go
through the same timing (each spec is one "step").  Writes ``DIR/trace_replay.json`` (device, git sha,
versions, per-step rows) and prints a per-step table and the summary last: per-step speed-up of
pat over FlashInfer decode (on steps that share pages and on steps that share none), geometric
mean, and the attention time summed over the sampled steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):     # run as a script: python bench/trace_replay.py
    sys.path.insert(0, str(ROOT))

METHODS = ("pat", "query", "fi-decode", "pat-graph", "pat-graph-bucket", "pat-invariant",
           "fi-prefill")
GRAPH_SAFE = ("pat-graph", "pat-graph-bucket")


def prepare(args) -> int:
    """``prepare`` subcommand: :func:`prepare_steps` with the parsed arguments."""
    prepare_steps(args.trace, args.out, steps=args.steps, page_size=args.page_size,
                  block_tokens=args.block_tokens, max_batch=args.max_batch,
                  kv_pages=args.kv_pages, start_ms=args.start_ms, end_ms=args.end_ms,
                  max_steps=args.max_steps, sample_start_ms=args.sample_start_ms,
                  sample_end_ms=args.sample_end_ms)
    return 0


def prepare_steps(trace, out, *, steps: int = 20, page_size: int = 16, block_tokens: int = 512,
                  max_batch: int = 256, kv_pages: int = 32768, start_ms: float = 0.0,
                  end_ms: float | None = None, max_steps: int | None = None,
                  sample_start_ms: float = 0.0, sample_end_ms: float | None = None,
                  verbose: bool = True) -> dict:
    """Replay ``trace`` (requests arriving in ``[start_ms, end_ms)``) and store ``steps``
    decode steps spread evenly over it in ``out`` (.npz): ``table_i`` int32
    ``[batch_i, max_pages_i]`` (``-1`` past a row's pages), ``lens_i`` int32 ``[batch_i]`` and
    ``meta``, a JSON document as uint8 bytes (its dict is returned).

    Steps are drawn from those whose simulated clock lies in ``[sample_start_ms,
    sample_end_ms)`` (the replay still starts at the first arrival, so the sampled steps see a
    warm cache and a filled batch, and it stops at ``sample_end_ms`` or after ``max_steps``
    steps); with the default window, first and last step included, as
    :func:`pat_core.trace.snapshot_steps` picks them.  Raises ``SystemExit`` when no step is
    left to sample.
    """
    from pat_core.trace import ReplayConfig, load_trace, replay
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if sample_end_ms is not None and sample_end_ms <= sample_start_ms:
        raise ValueError(f"sample_end_ms = {sample_end_ms} must exceed sample_start_ms = "
                         f"{sample_start_ms}")
    cfg = ReplayConfig(page_size=page_size, block_tokens=block_tokens, max_batch=max_batch,
                       kv_pages=kv_pages)
    reqs = load_trace(trace, start_ms=start_ms, end_ms=end_ms, block_tokens=block_tokens)
    t0 = time.perf_counter()
    eligible = []                 # first pass: count, no tables
    for s in replay(reqs, cfg, max_steps=max_steps, tables=False):
        if sample_end_ms is not None and s.time_ms >= sample_end_ms:
            break
        if s.time_ms >= sample_start_ms:
            eligible.append(s.step)
    if not eligible:
        raise SystemExit(f"--trace {trace}: the replay has no decode step to sample")
    pick = np.unique(np.linspace(0, len(eligible) - 1, num=min(steps, len(eligible)))
                     .round().astype(int))
    want = {eligible[i] for i in pick}
    taken = [s for s in replay(reqs, cfg, max_steps=max(want) + 1, tables=want)
             if s.step in want]
    arrays = {}
    meta = []
    for i, s in enumerate(taken):
        arrays[f"table_{i}"] = s.block_table.astype(np.int32)
        arrays[f"lens_{i}"] = s.seq_lens.astype(np.int32)
        meta.append(dict(step=int(s.step), time_ms=float(s.time_ms), batch=s.batch_size,
                         unique_tokens=int(s.unique_tokens), read_tokens=int(s.read_tokens)))
    doc = dict(trace=os.path.basename(str(trace)), requests=len(reqs), steps=meta,
               config=dict(page_size=cfg.page_size, block_tokens=cfg.block_tokens,
                           max_batch=cfg.max_batch, kv_pages=cfg.kv_pages),
               sample_ms=[float(sample_start_ms),
                          None if sample_end_ms is None else float(sample_end_ms)])
    arrays["meta"] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    if verbose:
        print(f"{len(taken)} steps of {len(reqs)} requests in {time.perf_counter() - t0:.0f} s "
              f"-> {out}")
        for m in meta:
            print(f"  step {m['step']:>6}  t {m['time_ms'] / 1e3:7.1f} s  batch {m['batch']:>4}"
                  f"  unique/read KV {m['unique_tokens'] / max(m['read_tokens'], 1):.2f}")
    return doc


def prepare_synthetic(args) -> int:
    """``prepare-synthetic`` subcommand: :func:`prepare_synthetic_steps`."""
    prepare_synthetic_steps(args.specs, args.out, page_size=args.page_size)
    return 0


def prepare_synthetic_steps(specs, out, *, page_size: int = 16, verbose: bool = True) -> dict:
    """Store each tree spec of ``specs`` (:func:`pat_core.workloads.build_tree_batch`, seed =
    its index) as one step in ``out`` (.npz), in :func:`prepare_steps`'s format; ``meta``'s
    ``kv_pages`` is the largest step's page count.  Returns the ``meta`` dict."""
    from bench.common import unique_kv_tokens
    from pat_core.workloads import build_tree_batch, parse_tree_spec
    arrays, meta, n_pages = {}, [], 1
    for i, spec in enumerate(specs):
        parse_tree_spec(spec)
        b = build_tree_batch(spec, page_size=page_size, seed=i)
        arrays[f"table_{i}"] = b.block_tables.astype(np.int32)
        arrays[f"lens_{i}"] = b.seq_lens.astype(np.int32)
        n_pages = max(n_pages, int(b.num_pages))
        meta.append(dict(step=i, time_ms=0.0, batch=int(b.batch_size), spec=spec,
                         unique_tokens=int(unique_kv_tokens(b.block_tables, b.seq_lens,
                                                            page_size)),
                         read_tokens=int(b.seq_lens.astype(np.int64).sum())))
    doc = dict(trace="synthetic", requests=0, steps=meta,
               config=dict(page_size=page_size, block_tokens=0, max_batch=0, kv_pages=n_pages))
    arrays["meta"] = np.frombuffer(json.dumps(doc).encode(), dtype=np.uint8)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    if verbose:
        print(f"{len(meta)} synthetic steps -> {out}")
    return doc


def load_steps(path):
    z = np.load(path)
    meta = json.loads(bytes(z["meta"]).decode())
    steps = [(m, z[f"table_{i}"], z[f"lens_{i}"]) for i, m in enumerate(meta["steps"])]
    return meta, steps


def time_steps(args) -> int:
    import torch
    from bench.common import git_sha, graph_times, l2_flusher, time_events
    from bench.compare import (make_fi_decode, make_fi_prefill, reference_fp64, rel_err,
                               torch_attention)
    import pat_core

    meta, steps = load_steps(args.steps_file)
    ps = meta["config"]["page_size"]
    n_pages = meta["config"]["kv_pages"]
    d = args.head_dim
    dtype = torch.float16
    fp8 = args.kv_dtype == "float8_e4m3fn"
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    ql = args.q_len
    ks, vs = args.kv_scales if fp8 else (1.0, 1.0)
    scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    flashinfer = None
    fi_error = None
    if "fi-decode" in args.methods or "fi-prefill" in args.methods:
        os.environ.setdefault("NVCC_APPEND_FLAGS", "-static-global-template-stub=false")
        try:
            import flashinfer
        except Exception as e:  # reported; pat's methods still run
            fi_error = f"{type(e).__name__}: {e}"[:200]
    flush = l2_flusher()
    rows = []
    for heads in args.heads:
        hq, hk = (int(x) for x in heads.split(":"))
        g = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn((n_pages, ps, hk, d), generator=g, device="cuda", dtype=dtype)
        v = torch.randn(k.shape, generator=g, device="cuda", dtype=dtype)
        if fp8:      # values spread over the format's range; the scales give them unit size
            k, v = (k / ks).to(kv_dtype), (v / vs).to(kv_dtype)
        gs = {m: _GraphSafe(pat_core, torch, steps, hq, hk, d, ps, k, v,
                            buckets=m.partition("@")[0] == "pat-graph-bucket",
                            plan_kw=pat_plan_kw(args.kv_dtype, args.q_len, 0), run_kw=scales,
                            q_len=ql, label=m.partition("@")[2])
              for m in args.methods if m.partition("@")[0] in GRAPH_SAFE}
        for i, (m, table, lens) in enumerate(steps):
            q = torch.randn((table.shape[0] * ql, hq, d), generator=g, device="cuda",
                            dtype=dtype)
            akw = dict(q_len=ql, **scales)
            ref = reference_fp64(torch, q, k, v, table, lens, ps, **akw)
            tol = max(2 * rel_err(torch, torch_attention(torch, q, k, v, table, lens, ps, **akw),
                                  ref), 2.0 ** -11)
            # a throwaway run of one method first: on long steps the first method timed after
            # the reference got a slow graph replay (up to 18%; bench/NOTES.md, round 8)
            first = [x for x in args.methods if x not in gs][:1] if args.throwaway \
                else []
            for j, method in enumerate(first + list(args.methods)):
                row = dict(throwaway=j < len(first), step=m["step"], time_ms=m["time_ms"],
                           batch=m["batch"],
                           heads=heads, method=method, unique_tokens=m["unique_tokens"],
                           read_tokens=m["read_tokens"], shares=m["unique_tokens"] <
                           m["read_tokens"])
                try:
                    if method in gs:
                        g_s = gs[method]
                        t0 = time.perf_counter()
                        plan = g_s.plan(table, lens)
                        row["plan_ms"] = (time.perf_counter() - t0) * 1e3
                        st = plan.stats()
                        row.update(num_ctas=st["num_ctas"], total_bytes=st["total_bytes"],
                                   tiles=st["tiles"], launches=g_s.num_launches)
                        out = g_s.replay(q)
                        row["rel_err"] = rel_err(torch, out, ref)
                        row["correct"] = bool(row["rel_err"] <= tol)
                        if row["correct"]:
                            row["eager_us"] = float(np.median(time_events(
                                g_s.eager, args.reps, flush=flush))) * 1e3
                            row["graph_us"] = float(np.median(time_events(
                                g_s.graph.replay, args.reps, flush=flush))) * 1e3
                        else:
                            print(f"step {m['step']} {heads} {method}: WRONG "
                                  f"({row['rel_err']:.2e})")
                        rows.append(row)
                        continue
                    if method in ("fi-decode", "fi-prefill"):
                        if flashinfer is None:
                            row["skipped"] = f"flashinfer unavailable: {fi_error}"
                            rows.append(row)
                            continue
                        if (method == "fi-decode") != (ql == 1):
                            row["skipped"] = f"{method} at --q-len {ql}"
                            rows.append(row)
                            continue
                        t0 = time.perf_counter()
                        b = _Batch(table, lens, ps)
                        w, _ = (make_fi_decode(torch, flashinfer, b, hq, hk, d, ps, dtype,
                                               kv_dtype) if ql == 1 else
                                make_fi_prefill(torch, flashinfer, b, hq, hk, d, ps, dtype, ql,
                                                kv_dtype))
                        row["plan_ms"] = (time.perf_counter() - t0) * 1e3
                        fn = lambda: w.run(q, (k, v), **scales)  # noqa: E731
                    else:
                        packer, _, label = method.partition("@")
                        invariant = packer == "pat-invariant"
                        if invariant:
                            packer = "pat"
                        w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer)
                        if label:     # an ablation: one of the lab's planner tunings
                            from bench.lab.kernel_lab import apply_tuning
                            apply_tuning(label, w.planner)
                        t0 = time.perf_counter()
                        plan = w.plan(table, lens, hq, hk, d, ps,
                                      **pat_plan_kw(args.kv_dtype, args.q_len, len(lens),
                                                    invariant=invariant))
                        row["plan_ms"] = (time.perf_counter() - t0) * 1e3
                        st = plan.stats()
                        row.update(num_ctas=st["num_ctas"], total_bytes=st["total_bytes"],
                                   tiles=st["tiles"])
                        fn = lambda: w.run(q, (k, v), **scales)  # noqa: E731
                    out = fn()
                    torch.cuda.synchronize()
                    row["rel_err"] = rel_err(torch, out, ref)
                    row["correct"] = bool(row["rel_err"] <= tol)
                    if not row["correct"]:
                        rows.append(row)
                        print(f"step {m['step']} {heads} {method}: WRONG ({row['rel_err']:.2e})")
                        continue
                    row["eager_us"] = float(np.median(time_events(fn, args.reps, flush=flush))) * 1e3
                    row["graph_us"] = float(np.median(graph_times(fn, args.reps, flush))) * 1e3
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
            rows[:] = [r for r in rows if not r.pop("throwaway", False)]
            _print_step([r for r in rows if r["step"] == m["step"] and r["heads"] == heads])
            del q, ref
        del k, v
        torch.cuda.empty_cache()
    summary = summarise(rows)
    res = dict(benchmark="trace_replay", device=torch.cuda.get_device_name(),
               git_sha=git_sha(), versions=dict(python=platform.python_version(),
                                                torch=torch.__version__,
                                                flashinfer=getattr(flashinfer, "__version__",
                                                                   None),
                                                pat=pat_core.__version__),
               trace=meta["trace"], trace_requests=meta["requests"], config=meta["config"],
               head_dim=d, dtype="float16", kv_dtype=args.kv_dtype, q_len=ql,
               kv_scales=[ks, vs], reps=args.reps,
               method_note="CUDA events, L2 flushed before each run, median; graph = one "
                           "capture per step's plan", rows=rows, summary=summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace_replay.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n== summary ==")
    for heads, s in summary.items():
        print(f"{heads}: " + "; ".join(f"{k} {v}" for k, v in s.items()))
    return 0 if all(r.get("correct", True) and "error" not in r for r in rows) else 1


def pat_plan_kw(kv_dtype: str, q_len: int, batch: int, invariant: bool = False) -> dict:
    """pat's ``plan()`` keywords for a run's KV dtype, query tokens per request (``batch``
    requests; 0: the graph-safe probe, which sets it per step) and batch invariance."""
    kw = dict(kv_data_type=kv_dtype)
    if kv_dtype != "float16":
        kw["q_data_type"] = "float16"
    if q_len > 1 and batch:
        kw["qo_indptr"] = np.arange(batch + 1, dtype=np.int32) * q_len
    if invariant:
        kw["batch_invariant"] = True
    return kw


def graph_safe_buckets(plans, steps, ps: int, buckets: bool) -> dict:
    """The graph-safe wrappers :class:`_GraphSafe` makes for a run of steps: ``{bucket:
    (max_batch_size, max_num_pages, max_ctas, max_partials)}`` from the steps' plain
    ``plans`` (``steps``: ``(meta, table, seq_lens)``), one bucket (key 0) sized for the
    largest step, or with ``buckets`` one per power-of-two batch size (:func:`batch_bucket`)."""
    limits = {}
    for p, (_, _, ln) in zip(plans, steps):
        key = batch_bucket(p.batch_size, buckets)
        entries = int(((ln.astype(np.int64) + ps - 1) // ps).sum())
        old = limits.get(key, (0, 0, 0, 0))
        limits[key] = (max(old[0], key if buckets else p.batch_size),
                       max(old[1], entries), max(old[2], p.num_ctas),
                       max(old[3], p.num_partial_rows))   # max_partials: rows
    return limits


def batch_bucket(batch: int, buckets: bool) -> int:
    """The graph-safe bucket of a step of ``batch`` requests: the power of two at or above it,
    or 0 (one bucket) without ``buckets``."""
    return 1 << max(0, int(batch) - 1).bit_length() if buckets else 0


class _GraphSafe:
    """pat's graph-safe mode over a run of steps: one wrapper sized for the largest step, one
    graph captured at the first plan and replayed for every later one.  With ``buckets``, as
    serving engines capture decode: one wrapper and graph per power-of-two batch bucket
    (``max_batch_size`` = the bucket, the other limits from the steps that fall in it), each
    captured at its first step."""

    def __init__(self, pat_core, torch, steps, hq, hk, d, ps, k, v, buckets=False, *,
                 plan_kw=None, run_kw=None, q_len: int = 1, label: str = ""):
        from pat_core import Planner
        from pat_core.gpus import detect_gpu_name
        self.pat_core, self.torch, self.k, self.v = pat_core, torch, k, v
        self.label = label     # an ablation: one of the lab's planner tunings (bench/lab)
        self.hq, self.hk, self.d, self.ps = hq, hk, d, ps
        self.plan_kw, self.run_kw, self.q_len = dict(plan_kw or {}), dict(run_kw or {}), q_len
        probe = Planner("pat", detect_gpu_name(torch.cuda.get_device_name()) or "h100")
        self._tune(probe)
        plans = [probe.plan(t, ln, hq, hk, d, ps, **self._kw(len(ln))) for _, t, ln in steps]
        self.buckets = buckets
        self.limits = graph_safe_buckets(plans, steps, ps, buckets)
        self.states = {}       # bucket -> [wrapper, q, out, graph]
        self.cur = None
        self.batch = 0
        self.num_launches = None

    def _tune(self, planner) -> None:
        if self.label:
            from bench.lab.kernel_lab import apply_tuning
            apply_tuning(self.label, planner)

    def _kw(self, batch: int) -> dict:
        kw = dict(self.plan_kw)
        if self.q_len > 1:
            kw["qo_indptr"] = np.arange(batch + 1, dtype=np.int32) * self.q_len
        return kw

    def _bucket(self, batch: int) -> int:
        return batch_bucket(batch, self.buckets)

    def plan(self, table, lens):
        key = self._bucket(table.shape[0])
        st = self.states.get(key)
        if st is None:
            max_b, entries, ctas, slots = self.limits[key]
            extra = dict(max_num_qo_tokens=max_b * self.q_len) if self.q_len > 1 else {}
            w = self.pat_core.PrefixAttentionWrapper(
                backend="cuda", packer="pat", use_cuda_graph=True, max_batch_size=max_b,
                max_num_pages=entries, max_ctas=ctas, max_partials=slots, **extra)
            self._tune(w.planner)
            q = self.torch.zeros((max_b * self.q_len, self.hq, self.d),
                                 dtype=self.torch.float16, device="cuda")
            st = self.states[key] = [w, q, self.torch.zeros_like(q), None]
        self.cur = st
        plan = st[0].plan(table, lens, self.hq, self.hk, self.d, self.ps,
                          **self._kw(len(lens)))
        self.batch = plan.batch_size
        if st[3] is None:
            torch = self.torch
            self.eager()
            torch.cuda.synchronize()
            st[3] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st[3]):
                self.eager()
            torch.cuda.synchronize()
        self.num_launches = len(st[0]._static.variants) + 1
        return plan

    @property
    def graph(self):
        return self.cur[3]

    def eager(self):
        w, q, out, _ = self.cur
        return w.run(q, (self.k, self.v), out=out, **self.run_kw)

    def replay(self, q):
        n = self.batch * self.q_len
        self.cur[1][:n] = q
        self.cur[3].replay()
        self.torch.cuda.synchronize()
        return self.cur[2][:n].clone()


class _Batch:
    """What make_fi_decode reads from a workload batch."""

    def __init__(self, table, lens, ps):
        self.block_tables, self.seq_lens, self.page_size = table, lens, ps


def _print_step(rows):
    if not rows:
        return
    r0 = rows[0]
    cells = []
    for r in rows:
        t = r.get("graph_us")
        cells.append(f"{r['method']} {t:7.1f}" if t else f"{r['method']} {'-':>7}")
    print(f"step {r0['step']:>6} {r0['heads']:>6} batch {r0['batch']:>4} "
          f"unique/read {r0['unique_tokens'] / max(r0['read_tokens'], 1):.2f}  "
          + "  ".join(cells) + "  (graph us)", flush=True)


def summarise(rows) -> dict:
    """Per head config: pat / FlashInfer decode speed-ups (graph) over sharing and
    non-sharing steps, and the summed attention time per method."""
    out = {}
    for heads in sorted({r["heads"] for r in rows}):
        by = {}
        for r in rows:
            if r["heads"] == heads and r.get("graph_us"):
                by.setdefault(r["step"], {})[r["method"]] = r
        s = {}
        for method in METHODS:
            t = [v[method]["graph_us"] for v in by.values() if method in v]
            if t:
                s[f"{method}_total_us"] = round(float(sum(t)), 1)
        fi = "fi-prefill" if any("fi-prefill" in v for v in by.values()) else "fi-decode"
        for label, share in (("sharing", True), ("no_sharing", False)):
            sp = [v[fi]["graph_us"] / v["pat"]["graph_us"] for v in by.values()
                  if "pat" in v and fi in v and v["pat"]["shares"] == share]
            if sp:
                s[f"{label}_steps"] = len(sp)
                s[f"{label}_speedup_geomean"] = round(math.exp(float(np.mean(np.log(sp)))), 3)
                s[f"{label}_speedup_min"] = round(float(min(sp)), 3)
        spq = [v["query"]["graph_us"] / v["pat"]["graph_us"] for v in by.values()
               if "pat" in v and "query" in v]
        if spq:
            s["vs_query_geomean"] = round(math.exp(float(np.mean(np.log(spq)))), 3)
        inv = [v["pat-invariant"]["graph_us"] / v["pat"]["graph_us"] for v in by.values()
               if "pat" in v and "pat-invariant" in v]
        if inv:      # the price of batch invariance (> 1: slower)
            s["invariant_over_pat_geomean"] = round(math.exp(float(np.mean(np.log(inv)))), 3)
            s["invariant_over_pat_max"] = round(float(max(inv)), 3)
        # graph-safe replay over the graph captured for each step's own plan (> 1: slower)
        for gm, tag in (("pat-graph", ""), ("pat-graph-bucket", "_bucket")):
            gsr = [v[gm]["graph_us"] / v["pat"]["graph_us"] for v in by.values()
                   if "pat" in v and gm in v]
            if gsr:
                s[f"graph_safe{tag}_over_exact_geomean"] = round(
                    math.exp(float(np.mean(np.log(gsr)))), 3)
                s[f"graph_safe{tag}_over_exact_max"] = round(float(max(gsr)), 3)
                s[f"graph_safe{tag}_within_10pct"] = f"{sum(x <= 1.1 for x in gsr)}/{len(gsr)}"
        out[heads] = s
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="replay the trace on the CPU and store sampled steps")
    p.add_argument("--trace", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--kv-pages", type=int, default=32768)
    p.add_argument("--start-ms", type=float, default=0.0)
    p.add_argument("--end-ms", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--sample-start-ms", type=float, default=0.0,
                   help="sample only steps whose simulated clock is at least this (the replay "
                        "still starts at the first arrival: a warm cache and batch)")
    p.add_argument("--sample-end-ms", type=float, default=None,
                   help="sample only steps before this clock; the replay stops there")
    y = sub.add_parser("prepare-synthetic", help="store tree specs as steps")
    y.add_argument("--specs", nargs="+", required=True)
    y.add_argument("--out", required=True, help="output .npz")
    y.add_argument("--page-size", type=int, default=16)
    t = sub.add_parser("time", help="time the stored steps on the GPU")
    t.add_argument("--steps-file", required=True)
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--heads", nargs="+", default=["32:8"])
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"of {METHODS}; also METHOD@LABEL for pat's methods: the method with "
                        "bench/lab/kernel_lab.py's planner tuning LABEL (an ablation; a graph-safe "
                        "method's wrappers and their sizing plans take it)")
    t.add_argument("--reps", type=int, default=10)
    t.add_argument("--kv-dtype", default="float16", choices=("float16", "float8_e4m3fn"),
                   help="the KV cache's dtype (queries and outputs stay float16)")
    t.add_argument("--kv-scales", type=float, nargs=2, default=(0.5, 0.75),
                   metavar=("K_SCALE", "V_SCALE"), help="the FP8 cache's scales")
    t.add_argument("--q-len", type=int, default=1,
                   help="query tokens per request, causal among themselves (speculative "
                        "decoding's verify step); fi-prefill is FlashInfer's baseline there")
    t.add_argument("--no-throwaway", dest="throwaway", action="store_false",
                   help="time the methods without a throwaway run of the first one per step")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        if args.steps < 1:
            ap.error("--steps must be at least 1")
        if args.sample_end_ms is not None and args.sample_end_ms <= args.sample_start_ms:
            ap.error("--sample-end-ms must exceed --sample-start-ms")
        return prepare(args)
    if args.cmd == "prepare-synthetic":
        return prepare_synthetic(args)
    for m in args.methods:
        base, _, label = m.partition("@")
        if base not in METHODS or (label and base == "fi-decode"):
            ap.error(f"--methods: unknown method {m!r}")
        if label:
            from bench.lab.kernel_lab import TUNINGS     # the lab's ablations, on request
            if label not in TUNINGS:
                ap.error(f"--methods {m!r}: no planner tuning {label!r} in bench/lab/kernel_lab.py "
                         f"(choose from {sorted(TUNINGS)})")
    if not 1 <= args.q_len <= 16:
        ap.error("--q-len must be in 1..16")
    for h in args.heads:
        parts = h.split(":")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts) \
                or int(parts[0]) % int(parts[1]):
            ap.error(f"--heads {h!r}: expected HQ:HK with HQ a multiple of HK")
    return time_steps(args)


if __name__ == "__main__":
    sys.exit(main())
