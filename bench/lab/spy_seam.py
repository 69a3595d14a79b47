"""Where the transformers seam's host time goes inside the engine, from a sampling profile.

A tracing profiler (cProfile, timers around calls) costs the calls it times more than they
cost, so inside an engine the small calls of pat's path looked 3-5x their tight-loop time.  A
sampling profiler does not slow the sampled code: run the engine under py-spy, without pausing
it, keeping every stack, then summarise the stacks here:

    py-spy record --nonblocking --threads --rate 2000 --format raw -o pat.txt -- \\
        python bench/engine_e2e.py --model gqa-small --workload sysprompt --requests 64 \\
        --new-tokens 128 --warmup-tokens 4 --profile-tokens 0 --repeats 1 \\
        --impls "paged|pat" --reference "paged|pat" --check-tokens 1 --out pat.json
    python bench/lab/spy_seam.py pat.txt fi.txt --rate 2000 --steps 127 --layers 16 --out S.json

Each file is py-spy's raw format (one ``frame;frame;... count`` line per distinct stack).
Counted: stacks under the seam's ``__call__`` (``PatPagedAttention`` in
``pat_core/integrations/transformers.py``, which FlashInfer's runner in ``engine_e2e.py``
subclasses), without one-time work (a compile, an import, a first wrapper, the prefill's
fallback), split by the part of the seam they are in; and the engine's generation thread as a
whole, by its step's top-level calls.  ``--steps`` (decode steps in the run) and ``--layers``
turn samples into microseconds per step and per layer call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SEAM = "pat_core/integrations/transformers.py"
# one-time work inside the seam: not a decode step's cost
ONE_TIME = ("_compile_for_args", "importlib", "_run_fallback", "NVRTC", "compile (", "warmup",
            "PrefixAttentionWrapper.__init__", "_function (")
# the seam's parts, by the first frame below __call__ that names one (in this order)
PARTS = (("plan: read_index to pages", "read_index_to_csr"),
         ("plan: the kernel's plan", ".plan_step"),
         ("plan: metadata to the host", "._new_step"),
         ("query rows copy", "._query_rows"),
         ("kernel run()", ".run ("),
         ("engine check (graph capture)", "is_current_stream_capturing"))
FRAME = re.compile(r"(?P<fn>.*) \((?P<path>.*?):(?P<line>\d+)\)$")


def short(frame: str) -> str:
    m = FRAME.match(frame)
    return f"{m['fn']} ({os.path.basename(m['path'])}:{m['line']})" if m else frame


def seam_part(below: list, here: str) -> str:
    """The seam part of a stack: ``below`` the frames under __call__, ``here`` __call__'s own
    frame (its line: the cache writes and views run in __call__ itself)."""
    for name, needle in PARTS:
        if any(needle in f for f in below):
            return name
    return "__call__'s own lines (the cache writes, views, glue)"


def summarise(path: str) -> dict:
    seam, engine = collections.Counter(), collections.Counter()
    run_leaves, own_lines = collections.Counter(), collections.Counter()
    gen = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(n)
            frames = stack.split(";")
            if "_run_generation_loop" in frames[0]:
                gen += n
                top = next((short(frames[i + 1]) for i, fr in enumerate(frames[:-1])
                            if fr.startswith("ContinuousBatchProcessor._generation_step")),
                           "outside a step (batch preparation, scheduling)")
                engine[top] += n
            at = next((i for i, fr in enumerate(frames) if "__call__ (" in fr and SEAM in fr),
                      None)
            if at is None or any(t in fr for fr in frames for t in ONE_TIME):
                continue
            below = frames[at + 1:]
            part = seam_part(below, frames[at])
            seam[part] += n
            if part == "kernel run()":
                run_leaves[short(frames[-1])] += n
            elif part.startswith("__call__"):
                own_lines[short(frames[at])] += n
    return {"generation_thread_samples": gen, "seam_samples": sum(seam.values()),
            "seam_parts": dict(seam.most_common()),
            "run_leaves": dict(run_leaves.most_common(15)),
            "own_lines": dict(own_lines.most_common(10)),
            "engine_step_parts": dict(engine.most_common(8))}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", help="py-spy raw profiles, one per implementation")
    ap.add_argument("--rate", type=float, required=True, help="py-spy's samples per second")
    ap.add_argument("--steps", type=int, required=True, help="decode steps of each run")
    ap.add_argument("--layers", type=int, required=True, help="attention layers of the model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    us = 1e6 / args.rate
    res = {"rate_hz": args.rate, "steps": args.steps, "layers": args.layers, "runs": {}}
    for path in args.files:
        s = summarise(path)
        s["seam_us_per_step"] = s["seam_samples"] * us / args.steps
        s["parts_us_per_step"] = {k: v * us / args.steps for k, v in s["seam_parts"].items()}
        s["run_us_per_layer_call"] = (s["seam_parts"].get("kernel run()", 0) * us
                                      / (args.steps * args.layers))
        res["runs"][os.path.basename(path)] = s
    names = list(res["runs"])
    parts = sorted({p for r in res["runs"].values() for p in r["parts_us_per_step"]},
                   key=lambda p: -max(r["parts_us_per_step"].get(p, 0)
                                      for r in res["runs"].values()))
    print(f"{'us per decode step':44s}" + "".join(f"{n[:18]:>20s}" for n in names))
    for p in ["(seam total)"] + parts:
        vals = [r["seam_us_per_step"] if p == "(seam total)" else
                r["parts_us_per_step"].get(p, 0.0) for r in res["runs"].values()]
        print(f"{p[:44]:44s}" + "".join(f"{v:20.0f}" for v in vals))
    print(f"{'run() per layer call, us':44s}" + "".join(
        f"{r['run_us_per_layer_call']:20.1f}" for r in res["runs"].values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
