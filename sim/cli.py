"""Command line: ``python -m sim {compare,timeline,sweep,calibration-report,fit,trace}``.

Examples::

    python -m sim compare --tree 1,4,16_128,256,1024 --heads 32:8
    python -m sim compare --tree trace.json --heads 32:8 --gpu a100 --json
    python -m sim timeline --tree 1,4,16_128,256,1024 --heads 32:8 --method pat --out pat.png
    python -m sim sweep --knob prefix --values 128,512,2048 --out prefix_sweep
    python -m sim compare --timing eager          # host launch cost per launch (run() from Python)
    python -m sim fit --measurements bench/results/calibration_h100.json \
        bench/results/compare_h100/results.json --out my_h100.json
    python -m sim calibration-report --measurements bench/results --constants my_h100.json
    python -m sim trace --trace conversation_trace.jsonl --duration-s 600 --out trace

``--tree`` takes a tree spec or a JSON file ``{"block_tables": [[...], ...], "seq_lens": [...],
"page_size": 16}`` (integers only: a float is refused, not truncated).

Bad input ends in one ``error: ...`` line on stderr and exit status 2, never a traceback and
never a silent substitute: a ``--constants`` file must exist and hold every constant (see
:func:`sim.constants.read_constants_file`); ``--out`` of ``sweep`` and ``trace`` is a file
prefix, and one naming a directory is refused.  Limits, checked before anything is built: a
tree spec has at most 64 levels, 65536 nodes per level (so 65536 requests), 2^31 - 1 tokens
per request and 2^24 block-table entries (requests x pages; :mod:`pat_core.workloads`);
``trace --kv-pages`` is at most 2^22 (:data:`sim.trace.MAX_KV_PAGES`).
"""
from __future__ import annotations

import argparse
import json
import sys

# the demo's argument check and error report, one copy for both CLIs
from pat_core.__main__ import INPUT_ERRORS, _positive, report_error
from pat_core.gpus import get_gpu
from pat_core.workloads import MAX_TREE_LEVELS, MAX_TREE_NODES

from .choose import DEFAULT_MARGIN, pick
from .constants import TIMINGS, load_constants
from .args import _heads, _ints, _methods, out_prefix
from .methods import load_batch, make_plan
from .model import simulate

ALL_METHODS = ("pat", "node", "compute", "query", "cascade", "pat-fixed")
SWEEP_DEFAULTS = {
    "batch": [8, 16, 32, 64, 128, 256],
    "prefix": [128, 256, 512, 1024, 2048, 4096],
    "depth": [1, 2, 3, 4, 5],
    "gqa": [1, 2, 4, 8],
}
KNOB_LABELS = {"batch": "batch size", "prefix": "shared prefix tokens",
               "depth": "tree depth (levels)", "gqa": "GQA ratio (query heads per KV head)"}


def _common(p: argparse.ArgumentParser, tree: bool = True) -> None:
    """Options every subcommand shares; ``tree=False``: no ``--tree`` (sweep builds its own
    batches from its knobs)."""
    if tree:
        p.add_argument("--tree", default="1,4,16_128,256,1024",
                       help="tree spec like 1,4,16_128,256,1024 (the default), or a JSON file "
                            "of block tables; a spec has at most 64 levels, 65536 requests and "
                            "2^24 block-table entries (requests x pages)")
    p.add_argument("--heads", type=_heads, default=(32, 8), help="query:KV heads (default 32:8)")
    p.add_argument("--gpu", default="h100", help="a100, h100 or h200 (default h100)")
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--head-dim", type=_positive, default=128)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--constants", default=None,
                   help="constants JSON holding every constant, as 'fit' writes it (default "
                        "sim/data/<gpu>.json)")
    p.add_argument("--seed", type=int, default=0, help="page-id shuffle of tree specs")
    p.add_argument("--timing", default="graph", choices=TIMINGS,
                   help="graph (default): a CUDA-graph replay of the step, in-graph launch gaps "
                        "of a few us; eager: run() from Python, each launch pays the host's cost")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sim", description="PAT decode-attention "
                                 "simulator: bytes, occupancy, timeline, predicted latency.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("compare", help="one row per method for one batch")
    _common(p)
    p.add_argument("--methods", type=_methods, default=list(ALL_METHODS))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--bytes-plot", default=None, help="also write a bytes-per-method PNG")

    p = sub.add_parser("timeline", help="per-SM Gantt chart of one method")
    _common(p)
    p.add_argument("--method", default="pat", choices=list(ALL_METHODS))
    p.add_argument("--out", required=True, help="PNG file")
    p.add_argument("--max-sms", type=_positive, default=None, help="draw only the first SMs")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")

    p = sub.add_parser("sweep", help="predicted time per method against one knob")
    _common(p, tree=False)
    p.add_argument("--knob", required=True, choices=sorted(SWEEP_DEFAULTS))
    p.add_argument("--values", type=_ints, default=None)
    p.add_argument("--batch", type=int, default=64, help="requests (default 64)")
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (default 1024)")
    p.add_argument("--suffix", type=int, default=128, help="private tokens per request")
    p.add_argument("--depth", type=int, default=2, help="tree levels incl. the leaves")
    p.add_argument("--methods", type=_methods, default=list(ALL_METHODS))
    p.add_argument("--out", required=True, help="output file prefix: writes OUT.png and "
                   "OUT.json (a directory is refused: name a file in it)")

    p = sub.add_parser(
        "calibration-report", help="predicted vs measured latency, in and out of sample",
        description="Predicted vs measured latency.  Records of the workloads the constants were "
                    "fitted on (the split recorded in the constants file, or --fit-workloads) "
                    "are in-sample; all others out-of-sample.")
    p.add_argument("--measurements", nargs="+", required=True,
                   help="measurement files or folders (bench/calibrate.py or bench/compare.py "
                        "output)")
    p.add_argument("--gpu", default=None)
    p.add_argument("--constants", default=None,
                   help="constants JSON (default: the packaged sim/data/<gpu>.json)")
    p.add_argument("--fit-workloads", default=None,
                   help="';'-separated fit-set workloads (default: the split the constants "
                        "file records)")
    p.add_argument("--plot", default=None, help="also write a predicted-vs-measured PNG")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "fit", help="fit the model constants on a workload split",
        description="Fit the constants on the fit-set workloads and report the held-out ones. "
                    "Writes only to --out (the packaged constants change only if --out names "
                    "them).  Works from an installed package; needs no checkout.")
    p.add_argument("--measurements", nargs="+", required=True,
                   help="measurement files or folders (bench/calibrate.py or bench/compare.py "
                        "output; a bench/lab/graph_start.py file fixes graph_start_ns)")
    p.add_argument("--gpu", default=None)
    p.add_argument("--out", required=True, help="constants file to write")
    p.add_argument("--validation", default=None,
                   help="';'-separated validation workloads (default: the split recorded in the "
                        "files, else every second workload in order of first appearance)")
    p.add_argument("--max-evals", type=int, default=600)
    p.add_argument("--latency-chain", action="store_true",
                   help="also fit tile_lat_ns, the forward blocks' latency chain (off in the "
                        "packaged constants; see sim.model)")
    p.add_argument("--wg-flops", action="store_true",
                   help="also fit wg_flops, the warpgroup (wgmma) tiles' own tensor-core rate "
                        "(fitted in the packaged H200 constants, off in the H100 ones; see "
                        "sim.model)")
    p.add_argument("--measured", action="append", default=[], metavar="KEY=VALUE",
                   help="replace a device measurement of the files (copy_bandwidth_gbps, "
                        "graph_launch_interval_ns, graph_join_ns), e.g. where a run's own copy "
                        "measurement is an outlier; recorded in the written file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    from .trace import add_parser as add_trace_parser      # python -m sim trace
    add_trace_parser(sub)
    return ap


# ---------------------------------------------------------------------------- compare
def compare(batch, methods, heads, head_dim, gpu, dtype="float16", constants=None,
            timing: str = "graph") -> dict:
    """Simulate ``batch`` with every method; returns the JSON-ready dict the CLI prints."""
    hq, hk = heads
    consts = load_constants(gpu, constants)
    launch_ns, gap_ns = consts.launch_costs(timing)
    rows = []
    for m in methods:
        plan = make_plan(batch, m, hq, hk, head_dim, gpu=gpu, kv_data_type=dtype)
        r = simulate(plan, gpu, consts, timing=timing)
        row = r.summary_row(m)
        row["bytes"] = r.bytes
        row["bytes_level"] = r.bytes_level
        rows.append(row)
    pred = {r["method"]: r["predicted_us"] for r in rows if r["method"] in ("pat", "query")}
    return {"batch": batch.label, "batch_size": batch.batch_size, "gpu": get_gpu(gpu).name,
            "heads": [hq, hk], "head_dim": head_dim, "page_size": batch.page_size,
            "dtype": dtype, "constants_source": consts.source, "timing": timing,
            "launch_ns": launch_ns, "gap_ns": gap_ns, "start_ns": consts.start_cost(timing),
            "rows": rows,
            # sim.choose's rule on these rows: which packer the simulator would run
            "pick": pick(pred, "pat", DEFAULT_MARGIN) if len(pred) == 2 else None}


def timing_line(res: dict) -> str:
    """One line saying which launch costs the predictions include."""
    if res["timing"] == "eager":
        return (f"timing: eager (run() from Python): {res.get('start_ns', 0.0) / 1e3:.1f} us "
                f"once, host launch cost "
                f"{res['launch_ns'] / 1e3:.1f} us per launch, {res['gap_ns'] / 1e3:.2f} us "
                f"between dependent kernels; --timing graph for a CUDA-graph replay")
    return (f"timing: graph (CUDA-graph replay): {res.get('start_ns', 0.0) / 1e3:.2f} us once, "
            f"in-graph launch gap "
            f"{res['launch_ns'] / 1e3:.2f} us, {res['gap_ns'] / 1e3:.2f} us between dependent "
            f"kernels; --timing eager adds the host's launch cost")


def format_compare(res: dict) -> str:
    lines = [f"batch {res['batch']} ({res['batch_size']} requests), heads "
             f"{res['heads'][0]}:{res['heads'][1]}, head_dim {res['head_dim']}, "
             f"page {res['page_size']}, {res['dtype']} on {res['gpu']} "
             f"[constants: {res['constants_source']}]",
             timing_line(res),
             f"{'method':<11} {'CTAs':>6} {'KV MB':>9} {'total MB':>9} {'HBM MB':>8} "
             f"{'L2 MB':>7} {'pred us':>9} "
             f"{'fwd us':>8} {'merge us':>8} {'bubble %':>8} {'waste %':>8}  tiles"]
    for r in res["rows"]:
        tiles = " ".join(f"{k}:{v}" for k, v in r["tiles"].items())
        lines.append(f"{r['method']:<11} {r['ctas']:>6} {r['kv_bytes'] / 1e6:>9.2f} "
                     f"{r['total_bytes'] / 1e6:>9.2f} {r['hbm_bytes'] / 1e6:>8.2f} "
                     f"{r['l2_bytes'] / 1e6:>7.2f} {r['predicted_us']:>9.2f} "
                     f"{r['forward_us']:>8.2f} {r['merge_us']:>8.2f} {r['bubble_pct']:>8.1f} "
                     f"{r['waste_pct']:>8.1f}  {tiles}")
    if res.get("pick"):
        lines.append(f"pick between pat and query (sim.choose, kept on pat unless query is "
                     f"predicted more than {100 * DEFAULT_MARGIN:.0f}% faster): {res['pick']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- sweep
def tree_spec(batch: int, prefix: int, suffix: int, depth: int) -> str:
    """A tree spec: ``depth - 1`` shared levels splitting ``prefix`` tokens evenly (level ``i``
    has ``min(2**i, batch)`` nodes), then ``batch`` leaves of ``suffix`` tokens.  ``depth == 1``
    or ``prefix == 0``: no sharing, each request holds ``prefix + suffix`` tokens."""
    if batch < 1 or suffix < 1 or depth < 1 or prefix < 0:
        raise ValueError("batch, suffix and depth must be >= 1 and prefix >= 0")
    # the spec's own limits, checked here before the loops over the levels
    if depth > MAX_TREE_LEVELS or batch > MAX_TREE_NODES:
        raise ValueError(f"depth {depth}, batch {batch}: the limits are {MAX_TREE_LEVELS} "
                         f"levels and {MAX_TREE_NODES} requests")
    if depth == 1 or prefix == 0:
        return f"{batch}_{prefix + suffix}"
    levels = depth - 1
    per = [prefix // levels + (1 if i < prefix % levels else 0) for i in range(levels)]
    counts = [min(2 ** i, batch) for i in range(levels)]
    keep = [i for i in range(levels) if per[i] > 0]
    counts = [counts[i] for i in keep] + [batch]
    lens = [per[i] for i in keep] + [suffix]
    return f"{','.join(map(str, counts))}_{','.join(map(str, lens))}"


def run_sweep(knob: str, values, methods, batch=64, prefix=1024, suffix=128, depth=2,
              heads=(32, 8), head_dim=128, page_size=16, gpu="h100", dtype="float16",
              constants=None, timing: str = "graph") -> dict:
    """Predicted latency of each method at each knob value (JSON-ready)."""
    consts = load_constants(gpu, constants)
    out = {"knob": knob, "knob_label": KNOB_LABELS[knob], "values": list(values),
           "gpu": get_gpu(gpu).name, "head_dim": head_dim, "page_size": page_size,
           "dtype": dtype, "constants_source": consts.source, "timing": timing,
           "specs": [], "heads": [],
           "methods": {m: [] for m in methods}, "rows": {m: [] for m in methods}}
    for v in values:
        b, p, d, h = batch, prefix, depth, heads
        if knob == "batch":
            b = int(v)
        elif knob == "prefix":
            p = int(v)
        elif knob == "depth":
            d = int(v)
        elif knob == "gqa":
            h = (heads[1] * int(v), heads[1])
        spec = tree_spec(b, p, suffix, d)
        out["specs"].append(spec)
        out["heads"].append(list(h))
        bt = load_batch(spec, page_size)
        for m in methods:
            plan = make_plan(bt, m, h[0], h[1], head_dim, gpu=gpu, kv_data_type=dtype)
            r = simulate(plan, gpu, consts, timing=timing)
            out["methods"][m].append(round(r.latency_us, 3))
            out["rows"][m].append(r.summary_row(m))
    out["title"] = (f"{get_gpu(gpu).name}: sweep over {KNOB_LABELS[knob]} "
                    f"(base: batch {batch}, prefix {prefix}, suffix {suffix}, depth {depth}, "
                    f"heads {heads[0]}:{heads[1]}, {timing} timing)")
    return out


# ---------------------------------------------------------------------------- calibration
def _plots():
    """:mod:`sim.plots`, imported only by the subcommands that draw, with matplotlib's headless
    Agg backend (files only) unless pyplot is already in use (a notebook).  matplotlib is not a
    dependency of the base install: without it, the error says how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a PNG needs matplotlib: pip install matplotlib "
                          "(or the package's [plots] extra)") from None
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from . import plots
    return plots


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except INPUT_ERRORS as exc:
        return report_error(exc)


def _dispatch(args) -> int:
    if args.cmd == "compare":
        batch = load_batch(args.tree, args.page_size, seed=args.seed)
        res = compare(batch, args.methods, args.heads, args.head_dim, args.gpu, args.dtype,
                      args.constants, args.timing)
        if args.bytes_plot:
            _plots().bytes_plot(res["rows"], args.bytes_plot,
                                title=f"bytes (HBM and L2): {res['batch']}")
        print(json.dumps(res, indent=2) if args.json else format_compare(res))
        return 0
    if args.cmd == "timeline":
        gantt = _plots().gantt
        batch = load_batch(args.tree, args.page_size, seed=args.seed)
        plan = make_plan(batch, args.method, args.heads[0], args.heads[1], args.head_dim,
                         gpu=args.gpu, kv_data_type=args.dtype)
        r = simulate(plan, args.gpu, load_constants(args.gpu, args.constants),
                     timing=args.timing)
        gantt(r, args.out, max_sms=args.max_sms,
              title=f"{args.method} | {batch.label} | {r.gpu.name} ({args.timing}): "
                    f"{r.latency_us:.1f} us, "
                    f"bubble {100 * r.bubble:.1f} %")
        row = r.summary_row(args.method)
        row["occupancy"] = [o.as_dict() for o in r.occupancy]
        row["out"] = args.out
        if args.json:
            print(json.dumps(row, indent=2))
        else:
            print(f"{args.method}: {row['predicted_us']:.2f} us predicted, "
                  f"{r.num_blocks} thread blocks, bubble {row['bubble_pct']:.1f} %, "
                  f"waste {row['waste_pct']:.1f} % -> {args.out}")
            for o in r.occupancy:
                print(f"  {o.m}x{o.n}: {o.blocks} blocks, {o.ctas_per_sm} per SM "
                      f"({o.limiter}), {o.waves:.2f} waves")
        return 0
    if args.cmd == "sweep":
        sweep_plot = _plots().sweep_plot
        values = args.values or SWEEP_DEFAULTS[args.knob]
        out_prefix(args.out)                    # before the work, not after it
        res = run_sweep(args.knob, values, args.methods, batch=args.batch, prefix=args.prefix,
                        suffix=args.suffix, depth=args.depth, heads=args.heads,
                        head_dim=args.head_dim, page_size=args.page_size, gpu=args.gpu,
                        dtype=args.dtype, constants=args.constants, timing=args.timing)
        with open(args.out + ".json", "w") as fh:
            json.dump(res, fh, indent=2)
        sweep_plot(res, args.out + ".png")
        width = max(len(str(v)) for v in res["values"]) + 2
        print(f"{res['knob_label']:<24}" + "".join(f"{str(v):>{max(width, 10)}}"
                                                   for v in res["values"]))
        for m, ys in res["methods"].items():
            print(f"{m:<24}" + "".join(f"{y:>{max(width, 10)}.1f}" for y in ys))
        print(f"-> {args.out}.png, {args.out}.json")
        return 0
    if args.cmd == "calibration-report":
        from .calibration import fit_workloads_of, format_report, load_measurements, report
        from .constants import constants_path
        data = load_measurements(args.measurements)
        gpu = args.gpu or data["gpu"]
        cpath = args.constants or constants_path(gpu)
        consts = load_constants(gpu, args.constants)   # a bad --constants fails here first
        fitw = (args.fit_workloads.split(";") if args.fit_workloads is not None
                else fit_workloads_of(cpath))
        rep = report(data, consts, fitw, gpu)
        if args.plot:
            _plots().calibration_plot(
                rep["predicted_us"], rep["measured_us"], rep["labels"], args.plot,
                title=f"{'; '.join(data['device'])} (filled: fit set, open: validation)",
                in_fit=rep["in_fit_set"])
        print(json.dumps(rep, indent=2) if args.json else
              f"measurements: {', '.join(args.measurements)}\n" + format_report(rep))
        return 0
    if args.cmd == "fit":
        from .calibration import (CHAIN_FIT, KERNEL_FIT, TIMING_FIT, WG_FIT, fit_and_save,
                                  format_report)
        val = args.validation.split(";") if args.validation else None
        names = (KERNEL_FIT + (CHAIN_FIT if args.latency_chain else ())
                 + (WG_FIT if args.wg_flops else ()) + TIMING_FIT["eager"] + TIMING_FIT["graph"])
        measured = {}
        for item in args.measured:
            key, sep, value = item.partition("=")
            try:
                measured[key] = float(value)
            except ValueError:
                sep = ""
            if not sep:
                raise ValueError(f"--measured: expected KEY=NUMBER, got {item!r}")
        path, _, info, rep = fit_and_save(args.measurements, args.out, args.gpu, val,
                                          args.max_evals, names=names, measured=measured)
        if args.json:
            print(json.dumps(rep, indent=2))
            return 0
        print(f"fitted {', '.join(info['fitted'])} in {info['evaluations']} evaluations; "
              f"loss {info['loss_before']:.4f} -> {info['loss_after']:.4f}; wrote {path}")
        print(format_report(rep))
        return 0
    if args.cmd == "trace":
        from .trace import run_cli as run_trace
        return run_trace(args)
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
