"""Measure our kernels for the simulator's calibration (run on a GPU with the CUDA backend).

Workloads: the benchmarks' development set (``pat_core.workloads.DESIGN_WORKLOADS`` and
``DEEP_WORKLOADS``, page 16) forms the fit set; :data:`VALIDATION_WORKLOADS` were never used
to develop or tune anything (deep trees of 32-token nodes only, multi-root forests, page size
32) and form the validation set.  The file records that split, so
``python -m sim fit`` fits on the first and ``calibration-report`` judges on the second.

For every workload x method x head config (``HEAD_CONFIGS``, GQA 1 to 8), plan with
``pat_core.PrefixAttentionWrapper(backend="cuda", packer=...)``, then time ``run`` with CUDA
events, twice: eagerly (``run()`` from Python, each launch paying the host's cost) and as a
CUDA-graph replay of the same call (what a serving loop that captures decode sees).  Warm-up
first (compiles happen there), L2 flushed before every timed run, median of ``--reps`` (>= 20);
a record whose runs spread more than ``--max-spread`` (interquartile range over median, 10%) is
timed again, up to ``--tries`` times, and the steadiest try is kept (``tries_*`` and
``spread_*`` in the record).
Each record holds both measured latencies next to the simulator's predictions under the
constants it had at the time; the file also holds the device name, its L2 size, git sha,
versions, the split and device measurements: three the fit takes as they are instead of fitting
them (the copy bandwidth, ``hbm_bandwidth``; from replayed graphs of empty kernels the cost of
one more forked launch, ``graph_launch_ns``, and of joining concurrent launches,
``graph_join_ns``; ``common.graph_launch_costs``, the mean of a small and a large grid), and the
L2 read bandwidth of a buffer that stays in L2 (``l2_bandwidth_gbps``, for reference: the fit's
``l2_bandwidth`` is what blocks re-reading the same pages get, which is more; see
``sim.calibration``).

    python bench/calibrate.py --out bench/results            # writes calibration_<gpu>.json
    python -m sim fit --measurements bench/results/calibration_h100.json --out sim/data/h100.json
    python -m sim calibration-report --measurements bench/results/calibration_h100.json

``--workloads`` takes tree specs, ``SPEC@PAGE`` for another page size than ``--page-size``.

Methods: the packers ``pat``, ``node``, ``compute``, ``query``, ``cascade`` and the ablation
``pat-fixed`` (one 64x128 tile).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

if __package__ in (None, ""):     # run as a script: python bench/calibrate.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (copy_bandwidth, flush_mode, git_sha,  # noqa: E402
                          graph_launch_costs, graph_times, l2_flusher, l2_read_bandwidth, spread,
                          stable_runs, time_events)
from sim.calibration import UNSTEADY  # noqa: E402

METHODS = ("pat", "node", "compute", "query", "cascade", "pat-fixed")

# workloads unlike the design set, measured for out-of-sample validation: (tree spec, page size)
VALIDATION_WORKLOADS = (
    ("1,2,4,8,16,32_32,32,32,32,32,32", 16),                 # deep: six levels of 32 tokens
    ("1,2,4,8,16,32,64,128_32,32,32,32,32,32,32,32", 16),    # deeper: eight levels, 128 requests
    ("1,4,16,64_32,32,32,32", 16),                           # wide and deep, 32-token nodes
    ("4,32_1024,128", 16),                                   # forest of four roots
    ("8,64_512,256", 16),                                    # forest of eight roots
    ("2,8,64_256,512,64", 32),                               # page size 32
    ("1,16,128_1024,64,32", 32),
    ("1,64_2048,64", 32),
)


def parse_workload(text: str, page_size: int) -> tuple:
    """``"SPEC"`` or ``"SPEC@PAGE"`` -> ``(spec, page_size)``."""
    spec, _, ps = text.partition("@")
    try:
        return spec, int(ps) if ps else page_size
    except ValueError:
        raise ValueError(f"--workloads: bad page size in {text!r}") from None


def versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "cupy", "numba", "pat_core"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    try:
        import torch
        out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return out


def time_us(fn, flush, warmup: int, reps: int) -> list:
    """Latencies (us) of ``fn`` with CUDA events, L2 flushed before each timed run."""
    return [t * 1e3 for t in time_events(fn, reps, warmup=warmup, flush=flush)]


def planner_kwargs(method: str) -> tuple:
    from sim.methods import METHODS as TABLE
    packer, kw = TABLE[method]
    return packer, dict(kw)


def main(argv=None) -> int:
    from pat_core.workloads import DEEP_WORKLOADS, DESIGN_WORKLOADS, HEAD_CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results", help="output directory")
    ap.add_argument("--workloads", nargs="*", default=None,
                    help="tree specs (SPEC or SPEC@PAGE); default: the design and deep "
                         "workloads (fit set) and VALIDATION_WORKLOADS")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--heads", nargs="*", default=[f"{a}:{b}" for a, b in HEAD_CONFIGS])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-graph", action="store_true", help="time eagerly only")
    ap.add_argument("--no-throwaway", dest="throwaway", action="store_false",
                    help="skip the untimed run of the first method per workload and heads")
    ap.add_argument("--max-spread", type=float, default=UNSTEADY,
                    help="time a record again when its runs' interquartile range exceeds this "
                         "share of their median (common.stable_runs)")
    ap.add_argument("--tries", type=int, default=3,
                    help="timings per record at most (the steadiest is kept)")
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be >= 20 (median of at least 20 runs)")
    if not args.max_spread >= 0:
        ap.error(f"--max-spread must be >= 0, got {args.max_spread}")
    if args.tries < 1:
        ap.error(f"--tries must be >= 1, got {args.tries}")
    if args.workloads is None:
        fit_set = [(w, args.page_size) for w in DESIGN_WORKLOADS + DEEP_WORKLOADS]
        val_set = list(VALIDATION_WORKLOADS)
    else:
        fit_set = [parse_workload(w, args.page_size) for w in args.workloads]
        val_set = []
    todo = fit_set + val_set

    import torch

    import pat_core
    from pat_core.gpus import detect_gpu_name
    from pat_core.workloads import build_tree_batch
    from sim import simulate
    from sim.constants import load_constants

    if not torch.cuda.is_available():
        print("no CUDA device: calibration needs a GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_properties(0)
    gpu = detect_gpu_name(dev.name)
    consts = load_constants(gpu)
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth(1 << 30, 20) / 1e9          # GB/s == bytes/ns
    l2_bw = l2_read_bandwidth() / 1e9
    launches = None
    if not args.no_graph:
        # a small and a large grid (a step's launches have tens to thousands of blocks)
        sms = dev.multi_processor_count
        launches = {"grids": {g: graph_launch_costs(grid=g) for g in (sms, 10 * sms)}}
        for key in ("interval_ns", "join_ns"):
            launches[key] = float(np.mean([v[key] for v in launches["grids"].values()]))
    print(f"device {dev.name} ({gpu}), copy bandwidth {bw:.0f} GB/s, L2 read bandwidth "
          f"{l2_bw:.0f} GB/s" + (f"; graph: one more forked launch {launches['interval_ns']:.0f}"
                                 f" ns, join of concurrent launches {launches['join_ns']:.0f} ns"
                                 if launches else ""), flush=True)
    l2 = int(getattr(dev, "L2_cache_size", 50 << 20) or (50 << 20))
    flush = l2_flusher(2 * l2)

    records = []
    t_start = time.time()
    for wl, page_size in todo:
        batch = build_tree_batch(wl, page_size)
        for heads in args.heads:
            hq, hk = (int(x) for x in heads.split(":"))
            gen = torch.Generator(device="cuda").manual_seed(0)
            shape = (batch.num_pages, page_size, hk, args.head_dim)
            k = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            v = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            q = torch.randn((batch.batch_size, hq, args.head_dim), generator=gen, device="cuda",
                            dtype=dtype)

            def planned(method):
                """``(plan, run)`` of ``method`` on this batch and head configuration."""
                packer, kw = planner_kwargs(method)
                w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer, gpu=gpu)
                plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, args.head_dim,
                              page_size, kv_data_type=args.dtype, **kw)
                return plan, lambda: w.run(q, (k, v))

            if args.throwaway and args.methods:
                # the first method timed after new K/V got a slow graph replay in other
                # benchmarks (bench/NOTES.md, round 8), and pat, timed first here, measured
                # up to 30% above identical node plans (round 10): run it once untimed
                try:
                    fn = planned(args.methods[0])[1]
                    time_us(fn, flush, 1, 2)
                    if not args.no_graph:
                        graph_times(fn, 2, flush=flush)
                except Exception:  # noqa: BLE001 - the timed run reports the failure
                    pass
            for method in args.methods:
                rec = {"workload": wl, "method": method, "num_qo_heads": hq, "num_kv_heads": hk,
                       "head_dim": args.head_dim, "page_size": page_size,
                       "dtype": args.dtype,
                       "set": "fit" if (wl, page_size) in fit_set else "validation"}
                try:
                    plan, fn = planned(method)
                    # a try whose runs disagree (something else on the device) is timed again
                    runs, tries = stable_runs(lambda: time_us(fn, flush, args.warmup,
                                                              args.reps),
                                              args.max_spread, args.tries)
                    rec["measured_eager_us"] = statistics.median(runs)
                    rec["runs_eager_us"] = [round(x, 3) for x in runs]
                    rec["tries_eager"], rec["spread_eager"] = tries, round(spread(runs), 4)
                    rec["predicted_eager_us"] = simulate(plan, gpu, consts,
                                                         timing="eager").latency_us
                    if not args.no_graph:
                        try:
                            g, tries = stable_runs(
                                lambda: [t * 1e3 for t in graph_times(fn, args.reps,
                                                                      flush=flush)],
                                args.max_spread, args.tries)
                            rec["measured_graph_us"] = statistics.median(g)
                            rec["runs_graph_us"] = [round(x, 3) for x in g]
                            rec["tries_graph"], rec["spread_graph"] = tries, round(spread(g), 4)
                            rec["predicted_graph_us"] = simulate(
                                plan, gpu, consts, timing="graph").latency_us
                        except Exception as exc:  # noqa: BLE001 - eager timing stands
                            rec["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    rec["stats"] = {kk: vv for kk, vv in plan.stats().items() if kk != "tiles"}
                    rec["tiles"] = plan.stats()["tiles"]
                    print(f"{wl:28s}@{page_size} {heads:>6s} {method:11s} eager "
                          f"{rec['measured_eager_us']:9.2f} us (pred "
                          f"{rec['predicted_eager_us']:9.2f})  graph "
                          f"{rec.get('measured_graph_us', float('nan')):9.2f} us (pred "
                          f"{rec.get('predicted_graph_us', float('nan')):9.2f})", flush=True)
                except Exception as exc:  # noqa: BLE001 - keep going, record the failure
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"{wl:28s}@{page_size} {heads:>6s} {method:11s} ERROR {rec['error']}",
                          flush=True)
                records.append(rec)
            del k, v, q
            torch.cuda.empty_cache()

    good = [r for r in records if "measured_eager_us" in r]
    fit_names = sorted({w for w, _ in fit_set})
    out = {
        "device": dev.name, "gpu": gpu, "git_sha": git_sha(), "versions": versions(),
        "sm_count": dev.multi_processor_count, "l2_cache_bytes": l2,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bandwidth_gbps": bw, "l2_bandwidth_gbps": l2_bw, "graph_launch": launches,
        "warmup": args.warmup, "reps": args.reps, "max_spread": args.max_spread,
        "tries": args.tries,
        "throwaway": bool(args.throwaway),
        "timing": "CUDA events around run() (eager) and around a CUDA-graph replay of it "
                  "(graph), L2 flushed before each run, median",
        "l2_flush": flush_mode(),
        "split": {"unit": "tree spec", "fit": fit_names,
                  "validation": sorted({w for w, _ in val_set} - set(fit_names))},
        "constants_used": {"source": consts.source, **consts.as_dict()},
        "records": good, "failed": [r for r in records if "error" in r],
        "elapsed_s": round(time.time() - t_start, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"calibration_{gpu}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}: {len(good)} measurements, {len(out['failed'])} failures", flush=True)
    if good:
        from sim.calibration import format_report, load_measurements, report
        data = load_measurements(path)
        print(format_report(report(data, consts, out["split"]["fit"], gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
