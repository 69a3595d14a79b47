"""Host cost of a decode step called without a CUDA graph, next to the graph-replayed step.

    python3 bench/lab/host_path.py --out DIR [--label NAME] [--calls 300] [--reps 30]
    python3 bench/lab/host_path.py --compare A.json B.json

For each small batch (the issue's eager set, plus the quick-start batch) at 32:8 and 32:32
heads, pat's default plan, fp16, head_dim 128, page 16:

* ``host_us``: host microseconds per ``PrefixAttentionWrapper.run(q, (k, v))`` call, the way a
  user calls it (the output allocated per call), averaged over ``--calls`` calls enqueued back
  to back; ``host_out_us`` the same with ``out=``; ``backend_us``: ``CudaBackend.run(plan, q,
  k, v, out=out)`` alone.  The GPU is slower than the host on none of these for long enough to
  fill the launch queue (``--calls`` steps are queued at most).
* ``graph_us`` / ``eager_flush_us``: median of ``--reps`` single steps between two CUDA events
  with the L2 flushed before each (``bench/compare.py``'s method): the graph-replayed step and
  the wrapper call.  The flush (a ~45 us kernel) runs while the host enqueues the eager call,
  so host time up to the flush's length is hidden there.
* ``loop_eager_us`` / ``loop_graph_us``: per step over ``--calls`` steps issued back to back
  (events around the loop, L2 warm, no flush): what a loop calling ``run()`` on the same inputs
  sees, host bound when the host cost exceeds the step, against the same loop of graph replays.
* ``layers_plan_us`` / ``layers_call_us``: a model's eager decode steps: ``plan()`` once per
  step, then one ``run()`` per layer over 32 layers with a KV cache each, so every call is an
  input set new to the backend (host microseconds per plan and per call).

Every configuration's output is checked against float64 attention before it is timed.
Writes ``DIR/host_path_<label>.json`` (environment and rows) and prints a table last;
``--compare`` prints two such files side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/host_path.py
    sys.path.insert(0, str(ROOT))

from bench.common import host_us, profile_calls  # noqa: E402

CASES = (
    ("1,16_2048,128", (32, 8)), ("1,16_2048,128", (32, 32)),
    ("1,4,64_256,1024,64", (32, 8)), ("1,4,64_256,1024,64", (32, 32)),
    ("1,2,8,128_512,128,256,32", (32, 8)), ("1,2,8,128_512,128,256,32", (32, 32)),
    ("1,4,16_128,256,1024", (32, 8)),
)
COLUMNS = ("host_us", "host_out_us", "backend_us", "graph_us", "eager_flush_us",
           "loop_graph_us", "loop_eager_us", "layers_plan_us", "layers_call_us")


def _loop_us(fn, calls: int) -> float:
    """GPU microseconds per call over ``calls`` calls issued back to back."""
    import torch
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def measure(spec: str, heads: tuple, calls: int, reps: int, flush) -> dict:
    import torch
    from bench.common import capture_graph, time_events
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    hq, hk = heads
    b = build_tree_batch(spec, page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((b.num_pages, 16, hk, 128), generator=g, device="cuda", dtype=torch.float16)
    v = torch.randn(k.shape, generator=g, device="cuda", dtype=torch.float16)
    q = torch.randn((b.batch_size, hq, 128), generator=g, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    backend = w._gpu_backend
    kv = (k, v)
    run = lambda: w.run(q, kv)                            # noqa: E731
    run_out = lambda: w.run(q, kv, out=out)               # noqa: E731
    run_backend = lambda: backend.run(plan, q, k, v, out=out)   # noqa: E731
    # correctness first: float64 attention of every request over its own tokens
    from pat_core.reference import dense_attention, relative_error
    got = run().double().cpu().numpy()
    ref = dense_attention(q.double().cpu().numpy(), (k.double().cpu().numpy(),
                          v.double().cpu().numpy()), b.block_tables, b.seq_lens, 16)
    err = relative_error(got, ref)
    if not err < 2.0 ** -10:
        raise AssertionError(f"{spec} {hq}:{hk}: relative error {err:.2e}")
    for fn in (run, run_out, run_backend):
        for _ in range(10):
            fn()
    row = {"spec": spec, "heads": f"{hq}:{hk}", "rel_err": err, "num_ctas": plan.num_ctas,
           "launch_groups": sum(1 for *_, bb, e in plan.groups() if e > bb),
           "host_us": host_us(run, calls), "host_out_us": host_us(run_out, calls),
           "backend_us": host_us(run_backend, calls)}
    graph = capture_graph(run_out)
    row["graph_us"] = float(np.median(time_events(graph.replay, reps, flush=flush))) * 1e3
    row["eager_flush_us"] = float(np.median(time_events(run, reps, flush=flush))) * 1e3
    row["loop_graph_us"] = _loop_us(graph.replay, calls)
    row["loop_eager_us"] = _loop_us(run, calls)
    row.update(_layers(w, b, q, k, v, hq, hk))
    return row


def _layers(w, b, q, k, v, hq: int, hk: int, num_layers: int = 32, steps: int = 4) -> dict:
    """A model's decode steps run eagerly: each step plans once, then calls ``run()`` for
    ``num_layers`` layers, each with its own KV cache (so each call is an input set the backend
    has not seen with this plan).  Host microseconds per ``plan()`` and per layer call."""
    import torch
    caches = [(k.clone(), v.clone()) for _ in range(num_layers)]
    plan_s = call_s = 0.0
    for step in range(steps + 1):                # the first step warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)
        t1 = time.perf_counter()
        for kc, vc in caches:
            w.run(q, (kc, vc))
        t2 = time.perf_counter()
        if step:
            plan_s += t1 - t0
            call_s += t2 - t1
    torch.cuda.synchronize()
    del caches
    return {"layers_plan_us": plan_s / steps * 1e6,
            "layers_call_us": call_s / (steps * num_layers) * 1e6}


def breakdown(spec: str = "1,4,64_256,1024,64", heads=(32, 8), calls: int = 300,
              profile: bool = False) -> dict:
    """Host microseconds per call of each piece of ``CudaBackend.run`` on one plan: the input
    descriptors, the output allocation, the stream lookup, one launch on its own, the enqueue
    of the plan's launches, the whole call, and a cache miss (``StaticState.prepare``)."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core import cuda_backend as cb
    from pat_core.workloads import build_tree_batch
    hq, hk = heads
    b = build_tree_batch(spec, page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)
    k = torch.randn((b.num_pages, 16, hk, 128), device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn((b.batch_size, hq, 128), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    be = w._gpu_backend
    be.run(plan, q, k, v, out=out)
    qd, kd, vd = cb._Dev(q, "q"), cb._Dev(k, "k"), cb._Dev(v, "v")
    st = be.state_for(plan)                     # the plan's device state (run() wrote it)
    prep = next(iter(st.prepared.values()))
    launches, merge = st.live_launches(prep)
    caller = be._caller_stream(qd)
    rt = be.cp.cuda.runtime
    res = {"spec": spec, "heads": f"{hq}:{hk}", "launches": len(launches),
           "merge": merge is not None}
    pieces = {
        "three _Dev": lambda: (cb._Dev(q, "q"), cb._Dev(k, "k"), cb._Dev(v, "v")),
        "sig tuple": lambda: ("NHD", qd.sig(), kd.sig(), vd.sig()),
        "torch.empty out": lambda: be._alloc_like(qd, (b.batch_size, hq, 128), "float16"),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "stream handle": lambda: be._caller_stream(qd),
        "getDevice": lambda: rt.getDevice(),
        "one launch (first)": lambda: launches[0](caller),
        "_enqueue": lambda: be._enqueue(launches, merge, caller),
        "backend.run(out=)": lambda: be.run(plan, q, k, v, out=out),
        "wrapper.run": lambda: w.run(q, (k, v)),
    }
    if merge is not None:
        pieces["merge launch"] = lambda: merge(caller)
    for name, fn in pieces.items():
        for _ in range(5):
            fn()
        res[name] = host_us(fn, calls)
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        st.prepare(qd, kd, vd, "NHD")
    torch.cuda.synchronize()
    res["prepare (cache miss)"] = (time.perf_counter() - t0) / n * 1e6
    if profile:
        print(profile_calls(lambda: st.prepare(qd, kd, vd, "NHD"), n, "cumulative", 30))
    return res


def env() -> dict:
    """kernel_lab's environment record (device, git sha, versions) and the host's CPU, whose
    speed these numbers depend on."""
    import platform
    from bench.lab.kernel_lab import environment
    return dict(environment(), cpu=platform.processor() or platform.machine())


def _table(rows: list, label: str) -> str:
    head = f"{'batch':<28} {'heads':>5} " + " ".join(f"{c:>14}" for c in COLUMNS) + \
        f" {'loop e/g':>8}"
    lines = [f"== {label}", head]
    for r in rows:
        lines.append(f"{r['spec']:<28} {r['heads']:>5} "
                     + " ".join(f"{r[c]:14.1f}" for c in COLUMNS)
                     + f" {r['loop_eager_us'] / r['loop_graph_us']:8.2f}")
    return "\n".join(lines)


def compare(a_path: str, b_path: str) -> str:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    lines = [f"A: {a['label']} ({a['env']['git_sha']})   B: {b['label']} ({b['env']['git_sha']})",
             f"{'batch':<28} {'heads':>5} {'host A':>8} {'host B':>8} {'loop e/g A':>10} "
             f"{'loop e/g B':>10} {'flush e/g A':>11} {'flush e/g B':>11} {'layer A':>8} "
             f"{'layer B':>8}"]
    rows_b = {(r["spec"], r["heads"]): r for r in b["rows"]}
    for ra in a["rows"]:
        rb = rows_b.get((ra["spec"], ra["heads"]))
        if rb is None:
            continue
        lines.append(
            f"{ra['spec']:<28} {ra['heads']:>5} {ra['host_us']:8.1f} {rb['host_us']:8.1f} "
            f"{ra['loop_eager_us'] / ra['loop_graph_us']:10.2f} "
            f"{rb['loop_eager_us'] / rb['loop_graph_us']:10.2f} "
            f"{ra['eager_flush_us'] / ra['graph_us']:11.2f} "
            f"{rb['eager_flush_us'] / rb['graph_us']:11.2f} "
            f"{ra.get('layers_call_us', float('nan')):8.1f} "
            f"{rb.get('layers_call_us', float('nan')):8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder for host_path_<label>.json")
    ap.add_argument("--label", default="head")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    ap.add_argument("--breakdown", action="store_true",
                    help="only time the pieces of one backend call (printed, not saved)")
    ap.add_argument("--profile", action="store_true",
                    help="with --breakdown: a cProfile of the cache-miss path")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if args.breakdown:
        for spec, heads in (("1,4,64_256,1024,64", (32, 8)), ("1,16_2048,128", (32, 8))):
            for key, val in breakdown(spec, heads, args.calls, args.profile).items():
                print(f"{key:<24} {val:9.2f}" if isinstance(val, float) else f"{key:<24} {val}")
        return 0
    if not args.out:
        ap.error("--out is required unless --compare or --breakdown")
    if args.calls < 1 or args.reps < 1:
        ap.error("--calls and --reps must be positive")
    from bench.common import l2_flusher
    flush = l2_flusher(128 << 20)
    rows = []
    for spec, heads in CASES:
        rows.append(measure(spec, heads, args.calls, args.reps, flush))
        r = rows[-1]
        print(f"{spec} {r['heads']}: host {r['host_us']:.1f} us, graph {r['graph_us']:.1f} us, "
              f"loop eager/graph {r['loop_eager_us']:.1f}/{r['loop_graph_us']:.1f}", flush=True)
    res = {"label": args.label, "env": env(), "calls": args.calls, "reps": args.reps,
           "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host_path_{args.label}.json").write_text(json.dumps(res, indent=1))
    print(_table(rows, f"{args.label} on {res['env']['device']} ({res['env']['git_sha']})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
