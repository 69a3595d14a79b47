"""Per-block timelines of a decode step on the GPU, next to the simulator's, block by block.

The kernels are built with ``-DPAT_BLOCK_CLOCK=CAP`` (``cuda_src/pat_common.cuh``): every block
of a forward or merge launch records, in a device array of its module, its SM and the
``%globaltimer`` time at which it started, was ready to work (a merge block: after waiting for
the forward launch) and ended, plus its SM's cycle counter at start and end.  The step runs as a
CUDA-graph replay after a clean L2 flush, as ``bench/calibrate.py`` times it; ``--reps`` replays
are recorded and the one whose forward span is the median is kept.

For each case (``SPEC@HEADS@METHOD[@PAGE]``, e.g. ``1,4,16_128,256,1024@32:8@query``; page size
``--page-size`` unless given) the JSON under ``--out`` holds every measured block ``(kind, group,
cta, head, sm, start, ready, end, cycles)`` and the simulator's block ``(kind, cta, head, sm,
start, end)`` for the same ``(cta, head)`` (packaged constants, graph timing); times in ns from
the first forward block's start.  The table printed last gives,
per case: the replay's CUDA-event time, the forward span (first forward block start to last
forward block end), the merge span, the median and 90th-percentile forward block duration, the
most forward blocks running at once, and the same from the simulator.

    python3 bench/lab/block_timeline.py --out OUT 1,4,16_128,256,1024@32:8@pat \\
        1,4,16_128,256,1024@32:8@query

Blocks past ``CAP`` (``--cap``, 32768 per launch) are not recorded; the graph-safe fused kernel
records nothing.  A forward launch's block ``b`` runs work item ``b`` first (a CTA's KV heads
adjacent, the tile's CTAs in plan order: :func:`pat_core.launch.forward_launches`) and draws
further items when the launch has more items than blocks: only a launch whose blocks each ran
one item maps block to ``(cta, head)``; the blocks of the others are listed as unmapped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:     # run as a script: python bench/lab/block_timeline.py
    sys.path.insert(0, ROOT)

REC = 6     # words per block record: start, ready, end, start cycle, end cycle, SM


def parse_case(text: str, page_size: int = 16) -> tuple:
    """``"SPEC@HQ:HK@METHOD[@PAGE]"`` -> ``(spec, hq, hk, method, page_size)``; ``ValueError``
    naming the case."""
    from sim.methods import METHODS
    parts = text.split("@")
    if len(parts) not in (3, 4):
        raise ValueError(f"case {text!r}: write SPEC@HQ:HK@METHOD or SPEC@HQ:HK@METHOD@PAGE")
    spec, heads, method = parts[:3]
    if len(parts) == 4:
        if not parts[3].isdigit() or int(parts[3]) < 1:
            raise ValueError(f"case {text!r}: page size must be a positive integer")
        page_size = int(parts[3])
    try:
        hq, hk = (int(x) for x in heads.split(":"))
    except ValueError:
        raise ValueError(f"case {text!r}: heads must be HQ:HK, got {heads!r}") from None
    if method not in METHODS:
        raise ValueError(f"case {text!r}: method must be one of {sorted(METHODS)}")
    return spec, hq, hk, method, page_size


def clock_defines(cap: int) -> tuple:
    """The build defines that compile the per-block clock records in (``CudaBackend(defines=)``)."""
    return (f"PAT_BLOCK_CLOCK={cap}",)


def clock_arrays(cap: int) -> dict:
    """``{variant key: uint64 CuPy array [2, cap, REC]}``: the clock array of every loaded
    module."""
    import cupy as cp
    from pat_core.cuda_backend import CudaBackend
    dev = cp.cuda.runtime.getDevice()
    out = {}
    for (d, key, defines), mod in list(CudaBackend._modules.items()):
        if d != dev or not any(x.startswith("PAT_BLOCK_CLOCK=") for x in defines):
            continue
        mem = mod.get_global("pat_block_clock")
        out[key] = cp.ndarray((2, cap, REC), dtype=cp.uint64, memptr=mem)
    return out


def case_inputs(torch, spec: str, hq: int, hk: int, head_dim: int, page_size: int) -> tuple:
    """``(batch, q, k, v)``: the tree batch of ``spec`` (seed 0) and its float16 CUDA tensors
    (paged K and V ``[num_pages, page_size, hk, head_dim]``, q ``[batch, hq, head_dim]``) from a
    generator seeded 0, in that order."""
    from pat_core.workloads import build_tree_batch
    batch = build_tree_batch(spec, page_size=page_size, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((batch.num_pages, page_size, hk, head_dim), generator=g, device="cuda",
                    dtype=torch.float16)
    v = torch.randn(k.shape, generator=g, device="cuda", dtype=torch.float16)
    q = torch.randn((batch.batch_size, hq, head_dim), generator=g, device="cuda",
                    dtype=torch.float16)
    return batch, q, k, v


def recorded_replays(torch, graph, arrays: dict, flush, reps: int, read) -> list:
    """``reps`` replays of ``graph``, each after zeroing the clock ``arrays`` and flushing the
    L2: what ``read()`` returned after each."""
    out = []
    for _ in range(reps):
        for a in arrays.values():
            a.fill(0)
        flush()
        graph.replay()
        torch.cuda.synchronize()
        out.append(read())
    return out


def launch_map(plan, arch: str) -> dict:
    """``{(variant key, clock slot): (tile index, the tile's CTAs, "forward")}`` for the plan's
    forward launches (one per tile, :func:`pat_core.launch.forward_launches`).  The merge is
    told by its key alone."""
    from pat_core import cuda_compile as cc
    from pat_core.launch import forward_launches
    out = {}
    for k, (m, n), ctas in forward_launches(plan):
        key = cc.FwdVariant.make(m, n, plan.head_dim, plan.kv_dtype, arch=arch).key
        out[(key, 0)] = (k, ctas, "forward")
    return out


def read_blocks(arrays: dict, plan, arch: str, hk: int) -> tuple:
    """Measured blocks as rows ``(kind, group, cta, head, sm, start, ready, end, cycles)`` and a
    list of what could not be mapped."""
    lm = launch_map(plan, arch)
    rows, unmapped = [], []
    for key, arr in arrays.items():
        a = arr.get()
        for slot in (0, 1):
            live = np.nonzero(a[slot, :, 0])[0]
            if live.size == 0:
                continue
            if key.startswith("pat_merge"):
                where = (-1, None, "merge")
            else:
                where = lm.get((key, slot))
                if where is None:
                    unmapped.append(f"{key} slot {slot}: {live.size} blocks (not a launch)")
                    continue
                if live.size < where[1].shape[0] * hk:
                    unmapped.append(f"{key} slot {slot}: {live.size} blocks for "
                                    f"{where[1].shape[0] * hk} items (blocks drew several)")
                    continue
            g, ctas, kind = where
            for bi in live:
                r = a[slot, bi]
                cta, head = (int(bi), -1) if kind == "merge" else (int(ctas[int(bi) // hk]),
                                                                    int(bi) % hk)
                rows.append((kind, g, cta, head, int(r[5]), int(r[0]), int(r[1]), int(r[2]),
                             int(r[4]) - int(r[3])))
    return rows, unmapped


def summarize(blocks: list) -> dict:
    """Spans and durations of a list of block dicts (``kind``, ``start``, ``end``; ns)."""
    fwd = [b for b in blocks if b["kind"] == "forward"]
    mrg = [b for b in blocks if b["kind"] == "merge"]
    out = {"forward_blocks": len(fwd), "merge_blocks": len(mrg)}
    if fwd:
        t0 = min(b["start"] for b in fwd)
        dur = sorted(b["end"] - b["start"] for b in fwd)
        ev = sorted([(b["start"], 1) for b in fwd] + [(b["end"], -1) for b in fwd],
                    key=lambda x: (x[0], x[1]))
        run = peak = 0
        for _, s in ev:
            run += s
            peak = max(peak, run)
        out.update(forward_span_us=(max(b["end"] for b in fwd) - t0) / 1e3,
                   block_med_us=statistics.median(dur) / 1e3,
                   block_p90_us=dur[min(len(dur) - 1, int(0.9 * len(dur)))] / 1e3,
                   peak_blocks=peak)
    if mrg:
        # a merge block may become resident before the forward ends (a programmatic dependent
        # launch) and wait: its span starts when the first one is ready
        m0 = min(b.get("ready", b["start"]) for b in mrg)
        out["merge_span_us"] = (max(b["end"] for b in mrg) - m0) / 1e3
        out["step_span_us"] = (max(b["end"] for b in fwd + mrg)
                               - min(b["start"] for b in fwd + mrg)) / 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="SPEC@HQ:HK@METHOD[@PAGE]")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--reps", type=int, default=9, help="replays recorded per case")
    ap.add_argument("--cap", type=int, default=32768, help="blocks recorded per launch")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        cases = [parse_case(c, args.page_size) for c in args.cases]
    except ValueError as e:
        ap.error(str(e))
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.cap < 1:
        ap.error(f"--cap must be >= 1, got {args.cap}")
    import torch
    import pat_core
    from bench.common import capture_graph, git_sha, l2_flusher, time_events
    from bench.compare import reference_fp64, rel_err
    from pat_core.gpus import detect_gpu_name
    from sim import simulate
    from sim.constants import load_constants
    from sim.methods import method_options

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    from pat_core.cuda_backend import CudaBackend
    clocked = CudaBackend(defines=clock_defines(args.cap))
    props = torch.cuda.get_device_properties(0)
    gpu = detect_gpu_name(props.name)
    arch = f"sm_{props.major}{props.minor}"
    consts = load_constants(gpu)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    flush = l2_flusher(2 * l2)
    d = args.head_dim
    table, results = [], []
    for text, (spec, hq, hk, method, ps) in zip(args.cases, cases):
        batch, q, k, v = case_inputs(torch, spec, hq, hk, d, ps)
        packer, kw = method_options(method, d)
        w = pat_core.PrefixAttentionWrapper(backend="cuda", packer=packer, gpu=gpu)
        w._gpu_backend = clocked            # every kernel compiled with the clock records
        plan = w.plan(batch.block_tables, batch.seq_lens, hq, hk, d, ps, kv_data_type="float16",
                      **kw)
        out = w.run(q, (k, v))
        ref = reference_fp64(torch, q, k, v, batch.block_tables, batch.seq_lens, ps)
        err = rel_err(torch, out, ref)
        del ref
        if not err < 2e-2:
            print(f"{text}: wrong result (relative error {err:.3g}); not recorded",
                  file=sys.stderr)
            return 1
        graph = capture_graph(lambda: w.run(q, (k, v)))
        event_us = statistics.median(t * 1e3 for t in time_events(graph.replay, 20, flush=flush))
        arrays = clock_arrays(args.cap)

        def read():
            rows, unmapped = read_blocks(arrays, plan, arch, hk)
            return ([dict(zip(("kind", "group", "cta", "head", "sm", "start", "ready", "end",
                               "cycles"), r)) for r in rows], unmapped)
        reps = recorded_replays(torch, graph, arrays, flush, args.reps, read)
        spans = [summarize(b).get("forward_span_us", 0.0) for b, _ in reps]
        blocks, unmapped = reps[int(np.argsort(spans)[len(spans) // 2])]
        fwd = [b for b in blocks if b["kind"] == "forward"]
        t0 = min(b["start"] for b in fwd) if fwd else 0
        for b in blocks:
            for f in ("start", "ready", "end"):
                b[f] -= t0
        ticks = np.unique(np.diff(np.unique([b["start"] for b in blocks])))
        # the simulator's blocks, keyed as the measured ones
        res = simulate(plan, gpu, consts, timing="graph")
        tl = res.timeline
        fwd_mask = tl.blocks_of("forward")
        s0 = float(np.nanmin(tl.block_start[fwd_mask])) if fwd_mask.any() else 0.0
        sim_blocks = []
        for i in range(tl.num_blocks):
            ln = tl.launches[int(tl.block_launch[i])]
            sim_blocks.append({"kind": ln.kind, "cta": int(tl.block_cta[i]),
                               "head": int(tl.block_head[i]), "sm": int(tl.block_sm[i]),
                               "start": float(tl.block_start[i]) - s0,
                               "end": float(tl.block_end[i]) - s0})
        ms, ss = summarize(blocks), summarize(sim_blocks)
        row = {"case": text, "spec": spec, "heads": [hq, hk], "method": method, "page_size": ps,
               "tiles": plan.stats()["tiles"], "event_us": round(event_us, 2),
               "predicted_us": round(res.latency_us, 2), "measured": ms, "simulated": ss,
               "unmapped": unmapped, "rel_err": err,
               "timer_tick_ns": int(ticks[0]) if ticks.size else None}
        table.append(row)
        results.append(dict(row, blocks=blocks, sim_blocks=sim_blocks,
                            forward_spans_us=spans))
        fname = text.replace(",", "-").replace(":", "-").replace("@", "_") + ".json"
        meta = {"device": props.name, "gpu": gpu, "git_sha": git_sha(),
                "torch": torch.__version__, "constants": consts.source, "reps": args.reps}
        with open(os.path.join(args.out, fname), "w") as fh:
            json.dump(dict(results[-1], **meta), fh)
        del graph, w
        torch.cuda.empty_cache()

    with open(os.path.join(args.out, "block_timeline_summary.json"), "w") as fh:
        json.dump({"device": props.name, "git_sha": git_sha(), "rows": table}, fh, indent=1)
    hdr = ("case", "event", "pred", "fwd m/s", "merge m/s", "blk med m/s", "blk p90 m/s",
           "peak m/s")
    print(" | ".join(hdr))
    f = lambda a, b, key: (f"{a.get(key, float('nan')):.1f}/{b.get(key, float('nan')):.1f}")
    for r in table:
        m, s = r["measured"], r["simulated"]
        print(" | ".join((r["case"], f"{r['event_us']:.1f}", f"{r['predicted_us']:.1f}",
                          f(m, s, "forward_span_us"), f(m, s, "merge_span_us"),
                          f(m, s, "block_med_us"), f(m, s, "block_p90_us"),
                          f"{m.get('peak_blocks', 0)}/{s.get('peak_blocks', 0)}")))
        for u in r["unmapped"]:
            print(f"   unmapped: {u}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
