"""Host time of one layer's ``run()`` call, pat against FlashInfer decode, outside any engine.

16 layers of paged caches (``--requests`` private requests of ``--tokens`` tokens), one plan
per "step", then every layer's run with ``out=`` given; medians of the calls after each
step's first.  ``--busy-thread`` adds a Python thread that wakes every 50 us (as an engine's
other threads might), to show whether a call loses time waiting for the GIL.

    python bench/lab/run_host_cost.py [--busy-thread]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4100)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--heads", default="16:4")
    ap.add_argument("--busy-thread", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile pat's steps (printed)")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the pieces of one pat run() call in tight loops (printed)")
    a = ap.parse_args(argv)
    import torch
    import flashinfer
    from pat_core import PrefixAttentionWrapper
    hq, hk = (int(x) for x in a.heads.split(":"))
    d, ps = 128, 16
    per = -(-a.tokens // ps)
    pages = a.requests * per
    indptr = np.arange(a.requests + 1, dtype=np.int32) * per
    indices = np.random.default_rng(0).permutation(pages).astype(np.int32)
    last = np.full(a.requests, a.tokens - (per - 1) * ps, dtype=np.int32)
    caches = [(torch.randn(pages, ps, hk, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(pages, ps, hk, d, device="cuda", dtype=torch.bfloat16))
              for _ in range(a.layers)]
    q = torch.randn(a.requests, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    stop = threading.Event()
    if a.busy_thread:
        def busy():
            while not stop.is_set():
                time.sleep(50e-6)
                sum(range(200))
        threading.Thread(target=busy, daemon=True).start()

    w = PrefixAttentionWrapper(backend="cuda")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=hq // hk >= 4)

    def plan_pat():
        w.plan_csr(indptr, indices, last, hq, hk, d, ps, kv_data_type=torch.bfloat16,
                   q_data_type=torch.bfloat16)

    def plan_fi():
        fi.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
                hq, hk, d, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    impls = {"pat": (plan_pat, lambda kv: w.run(q, kv, out=out)),
             "pat-backend": (plan_pat, lambda kv: w._gpu_backend.run(w.current_plan, q, kv[0],
                                                                     kv[1], out=out)),
             "fi-decode": (plan_fi, lambda kv: fi.run(q, kv, out=out))}
    for name, (plan, run) in impls.items():
        plan()
        for kv in caches:
            run(kv)
        torch.cuda.synchronize()
        plans, calls = [], []
        for _ in range(a.steps):
            t = time.perf_counter()
            plan()
            plans.append(time.perf_counter() - t)
            for i, kv in enumerate(caches):
                t = time.perf_counter()
                run(kv)
                if i:
                    calls.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        if a.profile and name == "pat":
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                plan()
                for kv in caches:
                    run(kv)
                torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
            pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
        print(f"{name:<10} plan {np.median(plans) * 1e3:.3f} ms  run {np.median(calls) * 1e3:.3f} ms"
              f" (p90 {np.percentile(calls, 90) * 1e3:.3f})  busy thread {a.busy_thread}",
              flush=True)
    stop.set()
    if a.breakdown:
        breakdown(w, q, out, caches, fi)


def breakdown(w, q, out, caches, fi, n: int = 2000):
    """Mean host cost (us per call, the device waits excluded) of each piece of pat's run
    path in tight loops, the current plan's state prepared for ``caches[0]``, and FlashInfer's
    ``run`` for comparison: what a layer call pays on this host, hot caches."""
    import torch
    from pat_core.cuda_launch import _torch_stream_handle
    from pat_core.cuda_views import _Dev
    be = w._gpu_backend
    kv = caches[0]
    plan = w.current_plan
    w.run(q, kv, out=out)
    st = next(s for s in be._states.values() if s.plan is plan)
    prep = next(iter(st.prepared.values()))
    launches, merge = prep["live"][2], prep["live"][3]
    qd = _Dev(q, "q")
    kd, vd = _Dev(kv[0], "k"), _Dev(kv[1], "v")
    dev = qd.device
    caller = _torch_stream_handle(dev)
    sig = ("NHD", qd.sig_any_rows(), kd.sig(), vd.sig(), be.options, (1.0, 1.0))

    def ctx():
        with be.cp.cuda.Device(dev):
            pass

    pieces = {
        "wrapper.run": lambda: w.run(q, kv, out=out),
        "backend.run": lambda: be.run(plan, q, kv[0], kv[1], out=out),
        "_run_state": lambda: be._run_state(st, qd, kv[0], kv[1], "NHD", False, out, None,
                                            None),
        "_Dev(q)": lambda: _Dev(q, "q"),
        "3 x sig": lambda: (qd.sig_any_rows(), kd.sig(), vd.sig()),
        "prepared lookup": lambda: st.prepared.get(sig),
        "Device ctx": ctx,
        "stream handle": lambda: _torch_stream_handle(dev),
        "torch current_stream": lambda: torch.cuda.current_stream(),
        "_outputs (cached)": lambda: be._outputs(qd, st.batch, st.num_qo_heads, st.head_dim,
                                                 st.dtype, False, out, None, {}, checked=prep),
        f"enqueue ({len(launches)} + {int(merge is not None)})":
            lambda: be._enqueue(launches, merge, caller, prep["live"][4]),
        "one launch": lambda: launches[0](caller),
        "fi.run": lambda: fi.run(q, kv, out=out),
    }
    for name, fn in pieces.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        host = 0.0
        for _ in range(n // 100):            # chunks of 100 calls: the launch queue stays
            t = time.perf_counter()          # short, and the waits are not counted
            for _ in range(100):
                fn()
            host += time.perf_counter() - t
            torch.cuda.synchronize()
        dt = host / (n // 100 * 100)
        print(f"  {name:<28} {dt * 1e6:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
