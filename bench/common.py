"""What every benchmark script shares: the code version, GPU event timing, the L2 flush and
the device's copy bandwidth.  Torch is imported inside the GPU helpers so that CPU-only
scripts (plan_overhead.py) can use :func:`git_sha` without it.
"""
from __future__ import annotations

import os
import subprocess

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_sha() -> str:
    """Commit of the measured tree: ``PAT_GIT_SHA`` when set (a copy without .git), else git."""
    if os.environ.get("PAT_GIT_SHA"):
        return os.environ["PAT_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=ROOT,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def time_events(fn, iters: int, warmup: int = 3, flush=None) -> list:
    """Per-run milliseconds of ``fn`` between two CUDA events, after ``warmup`` untimed calls;
    ``flush()`` (if given) runs before each timed call, outside the events."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_times(fn, iters: int, flush=None) -> list:
    """Capture ``fn`` once in a CUDA graph and time its replays (no host launch gaps), ms."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return time_events(g.replay, iters, flush=flush)


def kernel_timeline(fn, iters: int, flush, warmup: int = 2) -> list:
    """The device activities of ``iters`` runs of ``fn``, read from the profiler's trace.

    Returns one list per run of ``(name, start_us, duration_us)`` tuples, ``start_us``
    relative to the run's first activity (kernel, memset or copy).  ``flush()`` runs before
    each call; its activities mark where one run ends and the next begins, so it is required.
    Kernels inside a replayed CUDA graph are traced one by one.  The profiler stays attached
    to the process afterwards and slows later host launches: time events before, not after."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    if flush is None:
        raise ValueError("kernel_timeline: flush is required (it separates the runs)")
    for _ in range(warmup):
        flush()
        fn()
    torch.cuda.synchronize()
    # the flush's own kernels, named once so they can be told apart from fn's
    with profile(activities=[ProfilerActivity.CUDA]) as p0:
        flush()
        torch.cuda.synchronize()
    flush_names = {e.name for e in p0.events() if e.device_type.name == "CUDA"}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush()
            fn()
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    runs, cur = [], None
    for e in dev:
        if e.name in flush_names:
            if cur:
                runs.append(cur)
            cur = []
        elif cur is not None:
            cur.append(e)
    if cur:
        runs.append(cur)
    if len(runs) != iters:
        raise RuntimeError(f"kernel_timeline: found {len(runs)} runs in the trace, "
                           f"expected {iters}")
    out = []
    for r in runs:
        t0 = min(e.time_range.start for e in r)
        out.append([(e.name, float(e.time_range.start - t0),
                     float(e.time_range.end - e.time_range.start)) for e in r])
    return out


def kernel_spans(fn, iters: int, flush, warmup: int = 2) -> list:
    """Per-run GPU span of ``fn`` in ms: from the start of its first device activity to the
    end of its last (:func:`kernel_timeline`).  Unlike :func:`time_events` this leaves out the
    time between the host's launch call and the first kernel starting (a graph launch's
    submission latency)."""
    return [max(s + d for _, s, d in r) * 1e-3
            for r in kernel_timeline(fn, iters, flush, warmup)]


def l2_flusher(nbytes: int = 256 << 20):
    """A function that overwrites a buffer larger than L2, so the next run starts cold."""
    import torch
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return lambda: buf.fill_(1)


def unique_kv_tokens(block_tables, seq_lens, page_size: int) -> int:
    """Distinct tokens the batch reads, each shared token once (from the prefix forest)."""
    import sys
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from pat_core.forest import PrefixForest
    from pat_core.inputs import BlockTable
    return PrefixForest(BlockTable.from_padded(block_tables, seq_lens, page_size)).unique_tokens()


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch
    x = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = float(np.median(time_events(lambda: y.copy_(x), iters)))
    del x, y
    torch.cuda.empty_cache()
    return 2 * (nbytes // 2) * 2 / (ms * 1e-3)
