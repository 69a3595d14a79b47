"""Where a decode step of transformers' continuous batching spends its device time, per
attention implementation (one GPU call).

    python bench/lab/engine_kernels.py --out DIR [--impls "paged|pat paged|fi-decode"]

Builds ``bench/engine_e2e.py``'s model and workload (``--model``, ``--workload``,
``--requests``), warms each implementation up, then runs ``--new-tokens`` tokens under
``torch.profiler`` (CPU and CUDA activities) and writes ``DIR/kernels_<impl>.txt``: the run's
wall time and step summary (``StepRecorder``, host time per decode step through pat's seam),
then the kernels by device time and the host operators by self CPU time.  It answered one
question: is the engine's decode step bound by the attention kernel or by the host?
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import engine_e2e as e2e  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default=f"{e2e.PAT_IMPL} {e2e.FI_IMPL}")
    ap.add_argument("--model", default="gqa-small", choices=sorted(e2e.MODELS))
    ap.add_argument("--workload", default="sysprompt", choices=e2e.WORKLOADS)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rows", type=int, default=30, help="rows per table")
    a = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from pat_core.integrations.transformers import register_pat
    args = e2e.parse_args(["--model", a.model, "--workload", a.workload,
                           "--requests", str(a.requests), "--new-tokens", str(a.new_tokens)])
    model, cfg = e2e.build_model(a.model, args.dtype, "cuda", None, args.seed)
    lo, hi = (int(x) for x in args.suffix.split(","))
    prompts, _ = e2e.build_workload(a.workload, a.requests, args.prompt_tokens,
                                    cfg["vocab_size"], args.seed + 1, suffix=(lo, hi),
                                    samples=args.samples, templates=args.templates,
                                    turns=args.turns)
    os.makedirs(a.out, exist_ok=True)
    for impl in a.impls.split():
        seam = (register_pat(impl) if impl == e2e.PAT_IMPL else
                e2e.register_flashinfer_decode(impl) if impl == e2e.FI_IMPL else None)
        e2e.generate(model, impl, prompts, args.warmup_tokens, args)
        torch.cuda.synchronize()
        rec = e2e.StepRecorder(model, seam=seam)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            e2e.generate(model, impl, prompts, a.new_tokens, args)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
        rec.remove()
        summary = rec.summary()
        name = impl.split("|", 1)[1]
        with open(os.path.join(a.out, f"kernels_{name}.txt"), "w") as f:
            print(impl, "wall_s", round(t1 - t0, 3), summary, file=f)
            ka = prof.key_averages()
            print(ka.table(sort_by="device_time_total", row_limit=a.rows), file=f)
            print(ka.table(sort_by="self_cpu_time_total", row_limit=a.rows), file=f)
        print(impl, "wall_s", round(t1 - t0, 3), summary, flush=True)


if __name__ == "__main__":
    main()
