"""Measure our kernels for the simulator's calibration (run on a GPU with the CUDA backend).

For every standard workload (``pat_core.workloads.DESIGN_WORKLOADS``) x method x head config, plan with
``pat_core.PrefixAttentionWrapper(backend="cuda", packer=...)``, then time ``run`` with CUDA
events: warm-up first (compiles happen there), L2 flushed before every timed run, median of
``--reps`` (>= 20).  Each record holds the measured latency next to the simulator's prediction
under the constants it had at the time; the file also holds the device name, git sha, versions
and the device's copy bandwidth (which the fit uses as ``hbm_bandwidth``).

    python bench/calibrate.py --out bench/results            # writes calibration_<gpu>.json
    python -m sim fit --measurements bench/results/calibration_h100.json
    python -m sim calibration-report --measurements bench/results/calibration_h100.json

Methods: the packers ``pat``, ``node``, ``compute``, ``query``, ``cascade`` and the ablations
``pat-fixed`` (one 64x128 tile) and ``pat-serial`` (tile groups one after another).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth, git_sha, time_events  # noqa: E402

METHODS = ("pat", "node", "compute", "query", "cascade", "pat-fixed", "pat-serial")


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
    from pat_core.workloads import DESIGN_WORKLOADS, HEAD_CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results", help="output directory")
    ap.add_argument("--workloads", nargs="*", default=list(DESIGN_WORKLOADS))
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--heads", nargs="*", default=[f"{a}:{b}" for a, b in HEAD_CONFIGS])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be >= 20 (median of at least 20 runs)")

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
    print(f"device {dev.name} ({gpu}), copy bandwidth {bw:.0f} GB/s", flush=True)
    l2 = int(getattr(dev, "L2_cache_size", 50 << 20) or (50 << 20))
    scratch = torch.empty(2 * l2 // 4 + 1, dtype=torch.float32, device="cuda")
    flush = scratch.zero_

    records = []
    t_start = time.time()
    for wl in args.workloads:
        batch = build_tree_batch(wl, args.page_size)
        for heads in args.heads:
            hq, hk = (int(x) for x in heads.split(":"))
            gen = torch.Generator(device="cuda").manual_seed(0)
            shape = (batch.num_pages, args.page_size, hk, args.head_dim)
            k = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            v = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
            q = torch.randn((batch.batch_size, hq, args.head_dim), generator=gen, device="cuda",
                            dtype=dtype)
            for method in args.methods:
                packer, kw = planner_kwargs(method)
                rec = {"workload": wl, "method": method, "num_qo_heads": hq, "num_kv_heads": hk,
                       "head_dim": args.head_dim, "page_size": args.page_size,
                       "dtype": args.dtype}
                try:
                    w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer, gpu=gpu)
                    plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, args.head_dim,
                                  args.page_size, kv_data_type=args.dtype, **kw)
                    runs = time_us(lambda: w.run(q, (k, v)), flush, args.warmup,
                                    args.reps)
                    rec["measured_us"] = statistics.median(runs)
                    rec["runs_us"] = [round(x, 3) for x in runs]
                    rec["predicted_us"] = simulate(plan, gpu, consts).latency_us
                    rec["stats"] = {kk: vv for kk, vv in plan.stats().items() if kk != "tiles"}
                    rec["tiles"] = plan.stats()["tiles"]
                    print(f"{wl:28s} {heads:>6s} {method:11s} measured {rec['measured_us']:9.2f}"
                          f" us  predicted {rec['predicted_us']:9.2f} us", flush=True)
                except Exception as exc:  # noqa: BLE001 - keep going, record the failure
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"{wl:28s} {heads:>6s} {method:11s} ERROR {rec['error']}", flush=True)
                records.append(rec)
            del k, v, q
            torch.cuda.empty_cache()

    good = [r for r in records if "measured_us" in r]
    out = {
        "device": dev.name, "gpu": gpu, "git_sha": git_sha(), "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bandwidth_gbps": bw, "warmup": args.warmup, "reps": args.reps,
        "timing": "CUDA events around run(), L2 flushed before each run, median",
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
        from sim.calibration import format_report, report
        print(format_report(report(out, consts, gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
