"""What every benchmark script shares: the code version, GPU event timing, the L2 flush and
the device's copy bandwidth.  Torch is imported inside the GPU helpers so that CPU-only
scripts (plan_loop.py, lab/plan_overhead.py) can use :func:`git_sha` and
:func:`cpu_name` without it.
"""
from __future__ import annotations

import os
import platform
import subprocess

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for benchmark records."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_sha() -> str:
    """Commit of the measured tree: ``PAT_GIT_SHA`` when set (a copy without .git), else git."""
    if os.environ.get("PAT_GIT_SHA"):
        return os.environ["PAT_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=ROOT,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_result(path, result: dict) -> None:
    """Write a script's result JSON to ``path`` (its folder made when missing) and say so;
    nothing when ``path`` is empty (no ``--out`` given)."""
    if not path:
        return
    import json
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", path)


def heads_of(h) -> tuple:
    """``(num_qo_heads, num_kv_heads)`` from a results row's ``heads``: ``"32:8"`` or ``[32, 8]``."""
    return tuple(int(x) for x in (h.split(":") if isinstance(h, str) else h))


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


def spread(runs) -> float:
    """Interquartile range of ``runs`` over their median: :func:`sim.calibration.run_spread`,
    the rule the simulator's report counts with."""
    from sim.calibration import run_spread
    return run_spread(runs)


def stable_runs(measure, max_spread: float, tries: int = 3) -> tuple:
    """``(runs, tries_made)``: call ``measure()`` (returning a list of run times) until its
    runs' :func:`spread` is at most ``max_spread``, at most ``tries`` times, and keep the try
    with the smallest spread (the first of equals)."""
    if tries < 1:
        raise ValueError(f"tries must be >= 1, got {tries!r}")
    if not max_spread >= 0:
        raise ValueError(f"max_spread must be >= 0, got {max_spread!r}")
    best, best_s = None, float("inf")
    for k in range(1, tries + 1):
        runs = list(measure())
        s = spread(runs)
        if s < best_s:
            best, best_s = runs, s
        if s <= max_spread:
            return best, k
    return best, tries


def host_us(fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` calls enqueued back to back (the
    device synchronised before and after, outside the clock)."""
    import time
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def profile_calls(fn, calls: int, sort: str = "tottime", lines: int = 25) -> str:
    """A cProfile report (``lines`` entries by ``sort``) of ``calls`` calls of ``fn``."""
    import cProfile
    import io
    import pstats
    import torch
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats(sort).print_stats(lines)
    return sio.getvalue()


def capture_graph(fn):
    """``fn`` run twice on a side stream (warm-up, as torch asks before a capture), then
    captured once in a CUDA graph; returns the graph."""
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
    return g


def graph_times(fn, iters: int, flush=None) -> list:
    """Capture ``fn`` once in a CUDA graph and time its replays (no host launch gaps), ms."""
    return time_events(capture_graph(fn).replay, iters, flush=flush)


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


FLUSH_MODES = ("clean", "dirty")


def flush_mode() -> str:
    """The L2 flush the benchmarks use: ``PAT_L2_FLUSH`` (``clean`` or ``dirty``), default clean.

    ``dirty`` overwrites a buffer larger than L2, which leaves L2 full of modified lines: the
    timed run then pays their write-back to DRAM as it evicts them (up to the L2's size, ~50 MB
    on an H100, on a run that reads that much).  ``clean`` reads the buffer instead, so the
    timed run starts with L2 holding unmodified lines, as it does in a decode step whose previous
    kernels mostly read weights.  Both leave none of the timed run's own data in L2.  Results
    before this option existed (bench/NOTES.md, round 20) were measured with ``dirty``.
    """
    import os as _os
    mode = _os.environ.get("PAT_L2_FLUSH", "clean")
    if mode not in FLUSH_MODES:
        raise ValueError(f"PAT_L2_FLUSH must be one of {FLUSH_MODES}, got {mode!r}")
    return mode


def l2_flusher(nbytes: int = 256 << 20, mode: str | None = None):
    """A function that evicts L2 through a buffer of ``nbytes`` (larger than L2), so the next run
    starts cold; ``mode`` as in :func:`flush_mode` (default: that function's answer)."""
    import torch
    mode = flush_mode() if mode is None else mode
    if mode not in FLUSH_MODES:
        raise ValueError(f"l2_flusher: mode must be one of {FLUSH_MODES}, got {mode!r}")
    buf = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    if mode == "dirty":
        return lambda: buf.fill_(1)
    return lambda: buf.max()        # a read of the whole buffer; L2 ends with clean lines


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


_L2_READ_SRC = r"""
extern "C" __global__ void l2_read(const uint4* __restrict__ src, long long n16, int passes,
                                   unsigned int* __restrict__ sink) {
  // every thread strides over the buffer `passes` times; the XOR keeps the loads alive
  // (__ldcg: cached in L2 only; a thread re-reads the same lines every pass, which L1 would
  // otherwise serve once an SM's share of the buffer fits it)
  unsigned int acc = 0;
  long long stride = (long long)gridDim.x * blockDim.x;
  for (int p = 0; p < passes; ++p) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {   // four loads in flight per thread
      uint4 a = __ldcg(src + i), b = __ldcg(src + i + stride);
      uint4 c = __ldcg(src + i + 2 * stride), d = __ldcg(src + i + 3 * stride);
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y
             ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
      uint4 v = __ldcg(src + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;   // practically never: no store traffic
}
"""


def l2_read_bandwidth(nbytes: int | None = None, passes: int = 50, iters: int = 20) -> float:
    """Read bandwidth of the L2 in bytes/s: every SM re-reads a buffer that fits in L2.

    ``nbytes`` defaults to a quarter of the L2 (so it stays resident across passes; the L2 of
    the H100/H200 is two partitions).  One kernel makes ``passes`` passes, so its launch cost
    is amortised; the first pass brings the buffer in from HBM and is counted as an L2 read
    too (1 of ``passes``).  Median of ``iters`` runs."""
    import cupy as cp
    import torch
    dev = torch.cuda.get_device_properties(0)
    l2 = int(getattr(dev, "L2_cache_size", 50 << 20) or (50 << 20))
    nbytes = int(nbytes or l2 // 4) // 16 * 16
    buf = cp.ones(nbytes // 4, dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.uint32)
    kern = cp.RawKernel(_L2_READ_SRC, "l2_read")
    grid = dev.multi_processor_count * 4
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def run():
        kern((grid,), (512,), (buf, np.int64(nbytes // 16), np.int32(passes), sink),
             stream=stream)
    ms = float(np.median(time_events(run, iters)))
    return nbytes * passes / (ms * 1e-3)


# an empty kernel: each block reads one int and exits.  Callers pass live[0] = 0, so no block
# reaches the shared-memory store; it is there so that a launch asking for a plan kernel's
# dynamic shared memory keeps that request (the compiler cannot drop it).
TRIVIAL_KERNEL_SRC = r"""
extern "C" __global__ void trivial(const int* live) {
  extern __shared__ int s[];
  if ((int)blockIdx.x >= live[0]) return;
  s[threadIdx.x] = 0;
}
"""


def graph_launch_costs(counts=(1, 2, 4, 8), grid: int = 132, reps: int = 100) -> dict:
    """What each extra launch in a replayed CUDA graph costs, from graphs of empty kernels.

    For each ``k`` in ``counts``: a graph of ``k`` trivial kernels forked onto ``k`` streams
    and joined by one more (a plan's launch groups and its merge), and a graph of ``k + 1``
    trivial kernels chained on one stream, each timed as every benchmark here times a replay
    (events, L2 flushed before each run; median of ``reps``).  Returns ``{"forked_us": {k: us},
    "chained_us": {k: us}, "fork_slope_ns": ns, "chain_slope_ns": ns, "interval_ns": ns,
    "join_ns": ns}``: the slopes are the least-squares cost of one more forked (resp. chained)
    launch over all ``counts``; ``interval_ns`` is the forked slope over ``k >= 2`` (one more
    launch beside others) and ``join_ns`` what the second concurrent branch costs beyond that,
    ``forked(2) - forked(1) - interval`` (a graph of one branch runs as a chain)."""
    import cupy as cp
    import torch
    kern = cp.RawKernel(TRIVIAL_KERNEL_SRC, "trivial")
    live = cp.zeros(1, dtype=cp.int32)
    flush = l2_flusher(128 << 20)
    pool = [torch.cuda.Stream() for _ in range(max(counts))]

    def launch(tstream):
        kern((grid,), (32,), (live,), stream=cp.cuda.ExternalStream(tstream.cuda_stream))

    def forked(k):
        main = torch.cuda.current_stream()
        for s in pool[:k]:
            s.wait_stream(main)
            launch(s)
        for s in pool[:k]:
            main.wait_stream(s)
        launch(main)

    def chained(k):
        main = torch.cuda.current_stream()
        for _ in range(k + 1):
            launch(main)

    out = {"forked_us": {}, "chained_us": {}}
    for name, body in (("forked_us", forked), ("chained_us", chained)):
        for k in counts:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body(k)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body(k)
            torch.cuda.synchronize()
            out[name][k] = float(np.median(time_events(g.replay, reps, flush=flush))) * 1e3
    ks = np.array(counts, dtype=np.float64)
    for name, slope in (("forked_us", "fork_slope_ns"), ("chained_us", "chain_slope_ns")):
        ys = np.array([out[name][k] for k in counts])
        out[slope] = float(np.polyfit(ks, ys, 1)[0]) * 1e3
    many = [k for k in counts if k >= 2]
    if len(many) >= 2 and 1 in counts:
        out["interval_ns"] = float(np.polyfit(np.array(many, dtype=np.float64),
                                              [out["forked_us"][k] for k in many], 1)[0]) * 1e3
        out["join_ns"] = (out["forked_us"][2] - out["forked_us"][1]) * 1e3 - out["interval_ns"]
    return out
