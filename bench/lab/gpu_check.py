"""One-call GPU check: compile, correctness, GPU tests, sanitizer, timings.

    python3 bench/lab/gpu_check.py --out DIR [--jobs 16] [--no-smoke] [--no-pytest] [--no-bench]
                                   [--sanitizer [--sanitizer-tools T ...] [--sanitizer-timeout S]]
                                   [--host] [--sweep]

Needs CuPy, torch, pytest and hypothesis on the GPU machine; run from the repository root, e.g.

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
    python3 bench/lab/gpu_check.py --out results --sanitizer

Steps (each optional, in this order; a failing step is recorded and the next still runs):

1. ``compile``: every kernel variant through the backend's warm-up (worker processes fill
   CuPy's cache), with the wall time.
2. ``smoke``: a few workloads x packers x dtypes x head_dims against the float64 reference,
   printing each relative error next to the plain same-dtype implementation's.
3. ``pytest``: ``tests/test_gpu_kernels.py`` (log to ``DIR/pytest.log``).
4. ``sanitizer``: ``compute-sanitizer`` memcheck and racecheck on small plans, graph-safe
   launch sets included (``bench/device/sanitize_case.py``), summaries to ``DIR/sanitizer_*.txt``.
5. ``bench``: ``bench/lab/gpu_kernels.py`` (JSON to ``DIR/gpu_kernels.json``).
6. ``host`` (``--host``): enqueue cost of ``run()`` and a cProfile of it (``host_profile.txt``).
7. ``sweep`` (``--sweep``): forced tiles / variant overrides (``sweep.json``).

A short table is printed last; everything goes to ``DIR/gpu_check.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests"):     # the repository, and tests/ for check_case
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def step_compile(jobs):
    from pat_core.cuda_backend import CudaBackend
    be = CudaBackend()
    t0 = time.time()
    keys = be.warmup(jobs=jobs)
    return be, {"variants": len(keys), "seconds": time.time() - t0, "arch": be.arch,
                "device": be.device_name}


def step_smoke(be):
    from test_gpu_kernels import check_case
    from pat_core.cuda_compile import HEAD_DIMS
    from pat_core.workloads import build_tree_batch
    rows = []
    cases = [("1,4,16_100,37,61", 16, 32, 8), ("1,3,24_300,45,7", 1, 12, 4),
             ("2,6,12_64,130,17", 32, 8, 8), ("40_33", 16, 28, 4)]
    for spec, ps, hq, hk in cases:
        b = build_tree_batch(spec, page_size=ps, seed=1)
        for packer in ("pat", "query", "node", "compute", "cascade"):
            for dtype in ("float16", "bfloat16"):
                for d in HEAD_DIMS:
                    for layout in ("NHD", "HND"):
                        rec = {"spec": spec, "page_size": ps, "heads": f"{hq}:{hk}",
                               "packer": packer, "dtype": dtype, "head_dim": d,
                               "layout": layout}
                        try:
                            plan, err, plain = check_case(be, packer, b.block_tables, b.seq_lens,
                                                          b.num_pages, ps, hq, hk, d, dtype,
                                                          layout=layout, seed=d)
                            rec.update(ok=True, err=err, plain_err=plain,
                                       tiles=plan.stats()["tiles"])
                        except Exception as e:  # record and continue
                            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:600])
                        rows.append(rec)
    bad = [r for r in rows if not r["ok"]]
    worst = max((r["err"] / max(r["plain_err"], 1e-12) for r in rows if r["ok"]), default=0)
    return {"cases": len(rows), "failed": len(bad), "worst_err_over_plain": worst,
            "failures": bad[:20], "rows": rows}


def step_pytest(out_dir, extra):
    log = Path(out_dir) / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_gpu_kernels.py")] + list(extra)
    t0 = time.time()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    tail = log.read_text().strip().splitlines()[-3:]
    return {"rc": rc, "seconds": time.time() - t0, "tail": tail}


def step_sanitizer(out_dir, tools=("memcheck", "racecheck"), timeout=240):
    res = {}
    for tool in tools:
        path = Path(out_dir) / f"sanitizer_{tool}.txt"
        cmd = ["compute-sanitizer", f"--tool={tool}", "--print-limit", "20",
               sys.executable, str(ROOT / "bench" / "device" / "sanitize_case.py")]
        t0 = time.time()
        # streamed to the file, so that a run cut off by the timeout still shows how far it got
        with open(path, "w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -1
                fh.write(f"\nTIMEOUT: {tool} did not finish in {timeout:.0f} s\n")
        text = path.read_text()
        summ = [ln for ln in text.splitlines() if "SUMMARY" in ln or "finite=" in ln]
        res[tool] = {"rc": rc, "seconds": time.time() - t0, "summary": summ}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out", help="directory for logs and JSON")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-smoke", action="store_true")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--pytest-args", nargs="*", default=[])
    ap.add_argument("--sanitizer", action="store_true")
    ap.add_argument("--sanitizer-tools", nargs="+", default=["memcheck", "racecheck"],
                    choices=["memcheck", "racecheck", "synccheck", "initcheck"])
    ap.add_argument("--sanitizer-timeout", type=float, default=240.0,
                    help="seconds per compute-sanitizer tool")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-workloads", nargs="*", default=None)
    ap.add_argument("--bench-iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time forced tiles x (warps, stages)")
    ap.add_argument("--host", action="store_true", help="profile the launch path on the host")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"argv": sys.argv, "steps": {}}
    t_all = time.time()

    def save():
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    def step(name, fn, *a):
        t0 = time.time()
        print(f"== {name}", flush=True)
        try:
            r = fn(*a)
        except Exception:
            r = {"error": traceback.format_exc()[-3000:]}
            print(r["error"], flush=True)
        report["steps"][name] = r if not isinstance(r, tuple) else r[1]
        print(f"== {name} done in {time.time() - t0:.1f}s", flush=True)
        save()
        return r

    from bench.lab.gpu_kernels import environment
    report["env"] = environment()
    r = step("compile", step_compile, args.jobs)
    be = r[0] if isinstance(r, tuple) else None
    if be is None:
        return 1
    if not args.no_smoke:
        step("smoke", step_smoke, be)
    if not args.no_pytest:
        step("pytest", step_pytest, out, args.pytest_args)
    if args.sanitizer:
        step("sanitizer", step_sanitizer, out, tuple(args.sanitizer_tools),
             args.sanitizer_timeout)
    if not args.no_bench:
        from bench.lab import gpu_kernels
        wl = args.bench_workloads or list(gpu_kernels.WORKLOADS)
        res = step("bench", gpu_kernels.run, wl, gpu_kernels.HEADS, gpu_kernels.PACKERS,
                   args.bench_iters, str(out / "gpu_kernels.json"), be)
        if isinstance(res, dict) and "rows" in res:
            report["steps"]["bench"] = {"summary": res["summary"]}
            gpu_kernels.print_table(res["rows"])
    if args.host:
        from bench.lab import gpu_kernels
        res = step("host", gpu_kernels.host_overhead, be)
        if isinstance(res, dict) and "profile" in res:
            (out / "host_profile.txt").write_text(res.pop("profile"))
            report["steps"]["host"] = res
    if args.sweep:
        from bench.lab import gpu_kernels
        res = step("sweep", gpu_kernels.sweep, be)
        if isinstance(res, dict):
            (out / "sweep.json").write_text(json.dumps(res, indent=1) + "\n")
            report["steps"]["sweep"] = {"rows": len(res.get("rows", []))}
    report["seconds"] = time.time() - t_all
    save()

    # ---- short table, last
    st = report["steps"]
    print("\n==== gpu_check summary")
    print(f"device: {report['env'].get('device')}  sha: {report['env'].get('git_sha')}")
    if "compile" in st:
        c = st["compile"]
        print(f"compile : {c.get('variants')} variants in {c.get('seconds', 0):.1f}s "
              f"({c.get('arch')})" if "error" not in c else "compile : ERROR")
    if "smoke" in st:
        s = st["smoke"]
        print(f"smoke   : {s.get('cases')} cases, {s.get('failed')} failed, worst err/plain "
              f"{s.get('worst_err_over_plain', 0):.3f}" if "error" not in s else "smoke   : ERROR")
        for f in (s.get("failures") or [])[:5]:
            print("   FAIL", {k: f[k] for k in ("spec", "packer", "dtype", "head_dim", "layout")},
                  f.get("error", "")[:300])
    if "pytest" in st:
        p = st["pytest"]
        print(f"pytest  : rc={p.get('rc')} {p.get('seconds', 0):.0f}s  {' | '.join(p.get('tail', []))}")
    if "sanitizer" in st:
        for tool, r in st["sanitizer"].items():
            print(f"{tool:9s}: rc={r.get('rc')} {'; '.join(r.get('summary', []))}")
    if "host" in st and "run_us" in st["host"]:
        h = st["host"]
        print(f"host    : run() {h['run_us']:.1f} us/call ({h['groups']} groups); bare launches: "
              f"forward packed {h['fwd_launch_us']:.1f} us, CuPy call {h['cupy_launch_us']:.1f} us "
              f"(a {h['fwd_param_bytes']}-byte parameter struct)")
        if "wrapper_run_us" in h:
            print(f"host    : wrapper run(q, (k, v)) {h['wrapper_run_us']:.1f} us/call, with out= "
                  f"{h['wrapper_run_out_us']:.1f} us/call")
    if "bench" in st and "summary" in st["bench"]:
        print("bench   :", json.dumps(st["bench"]["summary"]))
    print(f"total {report['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
