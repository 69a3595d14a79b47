"""Host planning in a serving loop: plan() per decode step, fresh against incremental.

    python bench/plan_loop.py --requests 128,512,2048 --steps 300 --out FILE.json

A :class:`pat_core.workloads.ServingLoop` runs the steps: every request grows by one token
per step and takes a fresh page when its last one is full, requests finish and new ones join
under a few shared prompts.  Each step is planned twice, in the same process:

* ``incremental``: one :class:`pat_core.Planner` reused over the whole loop (what an engine
  does: it keeps whatever the planner carries from step to step);
* ``fresh``: a new ``Planner`` per step (the whole chain from the block table).

Both are timed with ``time.perf_counter`` around ``plan()`` alone (the loop's own table
update is not timed).  Before the loop the planner is warmed up as an engine would at
start-up (``Planner.warmup`` / ``PrefixAttentionWrapper.warmup``: every planning path's compiled
code loaded, and with ``--backend cuda`` the configuration's kernels), timed apart
(``warmup_s``; ``--no-planner-warmup`` skips it); the first ``--warmup`` steps are then planned but
not counted.  ``--check`` compares the two plans' arrays at every step (not timed) and
counts the steps where they differ.  ``--gap-ms`` puts that many ms of other Python work
before each step's plan (an engine's step between two plans; the caches are then as cold as
the engine leaves them).  ``--tree`` also times fresh plans of a tree batch
(``pat_core.workloads.build_tree_batch``), median of ``--tree-reps``.

``--backend cuda`` (a GPU machine) times ``PrefixAttentionWrapper(backend="cuda").plan()``
instead, reused over the loop: the plan plus its device copy (packing into pinned memory and
one asynchronous copy on the current stream).  Each step first enqueues ``--busy-ms`` of GPU
work (``torch.cuda._sleep``, standing in for the step's attention that is still running while
the host plans the next one), times ``plan()``, then waits for the stream (the engine reading
the step's output).  A ``plan()`` that waited for the device would take at least ``busy_ms``:
the row reports the longest plan against it.  Each ``plan()`` also runs under torch's
sync-debug mode ``"error"``, which raises at any torch operation that would synchronise.

Writes JSON with the machine (CPU model, cores, and its speed on three fixed kernels,
``cpu_speed``, so that two machines' plan times compare), the versions (Python, NumPy,
Numba) and the git sha; prints one line per configuration.  Targets (issue 37, a CI-like
2-core CPU, medians over >= 200 steps, p99 <= 3x median): incremental <= 0.15 ms per step at
128 requests, <= 0.5 ms at 512, <= 1.5 ms at 2048; a fresh plan of a 1024-request five-level
tree <= 1 ms.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

if __package__ in (None, ""):                  # run as a script: the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_name, git_sha, write_result  # noqa: E402

import numba  # noqa: E402

import pat_core  # noqa: E402
from pat_core import Planner  # noqa: E402
from pat_core.workloads import SERVING_ORDERS, ServingLoop, build_tree_batch  # noqa: E402

TARGETS_MS = {128: 0.15, 512: 0.5, 2048: 1.5}
TREE_TARGET_MS = 1.0
DEFAULT_TREE = "1,4,16,64,1024_1024,512,256,128,100"


def plans_equal(a, b) -> bool:
    """Same arrays and metadata (the plan's ``version`` and ``extra`` aside)."""
    if (a.batch_size, a.packer, a.serial, a.num_qo_heads, a.num_kv_heads) != \
            (b.batch_size, b.packer, b.serial, b.num_qo_heads, b.num_kv_heads):
        return False
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in a.ARRAY_FIELDS)


def other_work(ms: float) -> None:
    """``ms`` milliseconds of Python work (a loop over a list), standing in for what an engine
    does between two plans: it pushes the planner's code and data out of the CPU's caches."""
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1e3
    junk = list(range(4096))
    while time.perf_counter() < end:
        sum(junk)


def cpu_speed(reps: int = 5) -> dict:
    """The host's speed on three fixed kernels of the kinds planning is made of (median ms of
    ``reps``): a Python loop of 200k iterations (the glue), a NumPy sort of 1M int64 (vectorised
    work) and a compiled Numba walk over 4M int64 (the planner's own loops), so plan times of two
    machines compare through them: a host slower on all three by one factor is a slower CPU,
    not a slower planner."""
    from numba import njit

    @njit(cache=False, nogil=True)
    def walk(a):
        s = 0
        for i in range(a.shape[0]):
            s += a[i] ^ (s >> 3)
        return s

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 1 << 40, 1 << 20)
    big = rng.integers(0, 1 << 20, 1 << 22)
    walk(big[:16])                                   # compile outside the clock

    def py_loop():
        s = 0
        for i in range(200_000):
            s += i & 7
        return s

    out = {}
    for name, fn in (("python_loop_ms", py_loop), ("numpy_sort_ms", lambda: np.sort(keys)),
                     ("numba_walk_ms", lambda: walk(big))):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = float(np.median(ts)) * 1e3
    return out


def summary(ts) -> dict:
    ms = np.asarray(ts) * 1e3
    med = float(np.median(ms))
    p99 = float(np.percentile(ms, 99))
    return dict(median_ms=med, p99_ms=p99, mean_ms=float(ms.mean()), max_ms=float(ms.max()),
                p99_over_median=p99 / med if med > 0 else float("nan"))


def run_loop(args, requests: int, hq: int, hk: int) -> dict:
    lo, hi = (int(x) for x in args.private.split(","))
    loop = ServingLoop(requests, args.prompts, args.prompt_len, (lo, hi), args.page_size,
                       seed=args.seed, order=args.order)
    inc = Planner(args.packer, args.gpu)
    t_w = time.perf_counter()
    if not args.no_planner_warmup:
        inc.warmup(hq, hk, args.head_dim, args.page_size)
    warmup_s = time.perf_counter() - t_w
    t_inc, t_fresh, paths, entries, ctas, by_path = [], [], {}, [], [], {}
    differ = 0
    for step in range(args.warmup + args.steps):
        table, lens = loop.step()
        other_work(args.gap_ms)
        t0 = time.perf_counter()
        p_inc = inc.plan(table, lens, hq, hk, args.head_dim, args.page_size)
        t1 = time.perf_counter()
        if not args.no_fresh:
            fresh = Planner(args.packer, args.gpu)
            other_work(args.gap_ms)
            t2 = time.perf_counter()
            p_fresh = fresh.plan(table, lens, hq, hk, args.head_dim, args.page_size)
            t3 = time.perf_counter()
        if step < args.warmup:
            continue
        t_inc.append(t1 - t0)
        path = inc.last_path
        paths[path] = paths.get(path, 0) + 1
        by_path.setdefault(path, []).append(t1 - t0)
        entries.append(int((-(-lens.astype(np.int64) // args.page_size)).sum()))
        ctas.append(p_inc.num_ctas)
        if not args.no_fresh:
            t_fresh.append(t3 - t2)
            if args.check and not plans_equal(p_inc, p_fresh):
                differ += 1
    row = dict(requests=requests, shared_prompts=args.prompts, prompt_len=args.prompt_len,
               gap_ms=args.gap_ms,
               private=[lo, hi], page_size=args.page_size, order=args.order, warmup_s=warmup_s,
               steps=args.steps, seed=args.seed,
               page_entries_mean=float(np.mean(entries)), ctas_mean=float(np.mean(ctas)),
               incremental=summary(t_inc), paths=paths,
               incremental_by_path={k: summary(v) for k, v in by_path.items()})
    if t_fresh:
        row["fresh"] = summary(t_fresh)
    if args.check and not args.no_fresh:
        row["steps_differing_from_fresh"] = differ
    tgt = TARGETS_MS.get(requests)
    if tgt is not None:
        row["target_ms"] = tgt
        row["target_met"] = bool(row["incremental"]["median_ms"] <= tgt
                                 and row["incremental"]["p99_over_median"] <= 3.0)
    return row


def run_device_loop(args, requests: int, hq: int, hk: int) -> dict:
    """``--backend cuda``: the wrapper's plan() (plan + device copy) per step, with the GPU
    busy for ``--busy-ms`` when each plan starts (module docstring)."""
    import torch
    lo, hi = (int(x) for x in args.private.split(","))
    loop = ServingLoop(requests, args.prompts, args.prompt_len, (lo, hi), args.page_size,
                       seed=args.seed, order=args.order)
    w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=args.packer)
    t_w = time.perf_counter()
    if not args.no_planner_warmup:
        w.warmup(hq, hk, args.head_dim, args.page_size)
    warmup_s = time.perf_counter() - t_w
    # cycles of torch.cuda._sleep per millisecond, from one timed sleep
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    torch.cuda._sleep(10_000_000)
    ev1.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / ev0.elapsed_time(ev1)
    # the planner's share of each plan(): its plan() timed inside the wrapper's
    inner, planner_ts = w.planner.plan, []

    def timed_plan(*a, **kw):
        t = time.perf_counter()
        r = inner(*a, **kw)
        planner_ts.append(time.perf_counter() - t)
        return r
    w.planner.plan = timed_plan
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    ts, paths = [], {}
    for step in range(args.warmup + args.steps):
        table, lens = loop.step()
        torch.cuda._sleep(int(args.busy_ms * cycles_per_ms))
        if prof is not None and step >= args.warmup:
            prof.enable()
        # torch's sync-debug mode raises at any torch operation in plan() that would wait
        # for the device (a .cpu(), .item(), a blocking copy); pat's own copy goes through
        # CuPy, which the busy GPU checks instead (a plan that waited lasts >= busy_ms)
        torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        try:
            w.plan(table, lens, hq, hk, args.head_dim, args.page_size)
        finally:
            t1 = time.perf_counter()
            torch.cuda.set_sync_debug_mode("default")
        if prof is not None:
            prof.disable()
        torch.cuda.synchronize()
        if step >= args.warmup:
            ts.append(t1 - t0)
            path = w.planner.last_path
            paths[path] = paths.get(path, 0) + 1
    planner_ts = planner_ts[args.warmup:]
    row = dict(requests=requests, backend="cuda", device=torch.cuda.get_device_name(),
               busy_ms=args.busy_ms, warmup_s=warmup_s, steps=args.steps, order=args.order,
               plan_and_copy=summary(ts), planner=summary(planner_ts),
               rest=summary(np.subtract(ts, planner_ts)), paths=paths)
    if prof is not None:
        import io
        import pstats
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(40)
        row["profile"] = buf.getvalue().splitlines()
    row["waited_for_device"] = bool(row["plan_and_copy"]["max_ms"] >= args.busy_ms)
    # steps whose plan() took the GPU's queued time or longer: the ones that may have waited
    row["steps_at_least_busy"] = int(sum(t * 1e3 >= args.busy_ms for t in ts))
    row["sync_debug_mode"] = "error"     # every plan() ran under it (a sync would have raised)
    return row


def run_tree(args, spec: str, hq: int, hk: int) -> dict:
    b = build_tree_batch(spec, page_size=16, seed=0)
    call = lambda: Planner(args.packer, args.gpu).plan(  # noqa: E731
        b.block_tables, b.seq_lens, hq, hk, args.head_dim, 16)
    call()                                   # warm-up: Numba's cache
    ts = []
    for _ in range(args.tree_reps):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return dict(tree=spec, page_size=16, reps=args.tree_reps, fresh=summary(ts),
                page_entries=int((-(-b.seq_lens.astype(np.int64) // 16)).sum()),
                target_ms=TREE_TARGET_MS,
                target_met=bool(float(np.median(ts)) * 1e3 <= TREE_TARGET_MS))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default="128,512,2048",
                    help="comma-separated batch sizes (requests per step)")
    ap.add_argument("--prompts", type=int, default=4, help="shared prompts")
    ap.add_argument("--prompt-len", type=int, default=2048, help="tokens per shared prompt")
    ap.add_argument("--private", default="128,3072",
                    help="lo,hi: a request's private tokens at the end of its life")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--no-planner-warmup", action="store_true",
                    help="skip the planner's warmup() before the loop (first-use loads then "
                         "fall in the steps)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="CPU loop: ms of other Python work before each step's plan (an "
                         "engine's step between two plans; 0: plans back to back)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", default="keep", choices=SERVING_ORDERS,
                    help="how the engine keeps its rows when requests leave")
    ap.add_argument("--heads", default="32:8", help="num_qo_heads:num_kv_heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--packer", default="pat")
    ap.add_argument("--gpu", default="h100", help="GPU the plans are made for")
    ap.add_argument("--no-fresh", action="store_true", help="time the incremental path only")
    ap.add_argument("--check", action="store_true",
                    help="count steps whose incremental plan differs from the fresh one")
    ap.add_argument("--tree", default=DEFAULT_TREE,
                    help="tree spec for the fresh-plan timing ('' to skip)")
    ap.add_argument("--tree-reps", type=int, default=200)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: time the CUDA wrapper's plan() with its device copy")
    ap.add_argument("--profile", action="store_true",
                    help="--backend cuda: cProfile the timed plan() calls (the profile's "
                         "slowdown shows in that run's times)")
    ap.add_argument("--busy-ms", type=float, default=5.0,
                    help="--backend cuda: GPU work enqueued before each plan()")
    args = ap.parse_args(argv)
    hq, hk = (int(x) for x in args.heads.split(":"))
    load_start = list(os.getloadavg())     # other work on the machine skews the timings
    rows = []
    for n in (int(x) for x in args.requests.split(",") if x):
        if args.backend == "cuda":
            row = run_device_loop(args, n, hq, hk)
            rows.append(row)
            pc = row["plan_and_copy"]
            print(f"{n:>5} req  plan + copy {pc['median_ms']:.3f} ms (planner "
                  f"{row['planner']['median_ms']:.3f}, rest {row['rest']['median_ms']:.3f}; "
                  f"p99 {pc['p99_ms']:.3f}, max {pc['max_ms']:.3f}; GPU busy {args.busy_ms} ms: "
                  f"{'WAITED' if row['waited_for_device'] else 'no wait'} in "
                  f"{row['steps_at_least_busy']} of {args.steps} steps)  paths "
                  f"{row['paths']}", flush=True)
            continue
        row = run_loop(args, n, hq, hk)
        rows.append(row)
        inc = row["incremental"]
        line = (f"{n:>5} req  entries {row['page_entries_mean']:>9.0f}  CTAs "
                f"{row['ctas_mean']:>6.0f}  incremental {inc['median_ms']:.3f} ms "
                f"(p99 {inc['p99_ms']:.3f})")
        if "fresh" in row:
            fr = row["fresh"]
            line += f"  fresh {fr['median_ms']:.3f} ms (p99 {fr['p99_ms']:.3f})"
        line += f"  paths {row['paths']}"
        if "steps_differing_from_fresh" in row:
            line += f"  differ {row['steps_differing_from_fresh']}"
        print(line, flush=True)
    tree = None
    if args.tree:
        tree = run_tree(args, args.tree, hq, hk)
        print(f"tree {args.tree}: fresh {tree['fresh']['median_ms']:.3f} ms "
              f"(p99 {tree['fresh']['p99_ms']:.3f})", flush=True)
    result = dict(
        benchmark="plan_loop", packer=args.packer, gpu=args.gpu, heads=[hq, hk],
        head_dim=args.head_dim, git_sha=git_sha(),
        command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), platform=platform.platform(),
                     loadavg_at_end=list(os.getloadavg()),
                     loadavg_at_start=load_start, speed=cpu_speed()),
        versions=dict(python=platform.python_version(), numpy=np.__version__,
                      numba=numba.__version__, pat=pat_core.__version__),
        targets_ms=dict(incremental={str(k): v for k, v in TARGETS_MS.items()},
                        fresh_tree_1024=TREE_TARGET_MS, p99_over_median=3.0),
        rows=rows, tree=tree,
    )
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
