"""``python -m pat_core demo``: plan batches with every packer, run them, check them, print tables.

On a machine without a GPU the forward pass is the tile-faithful CPU executor; with a CUDA
device and CuPy (``--backend cuda``) it is the real kernels.  The simulator's view of the same
batch is ``python -m sim compare`` (the simulator imports pat_core, never the reverse).

Timing: everything that is compiled on first use (the Numba planner and executor, or the CUDA
kernels) is compiled and run once before anything is timed, and that one-off cost is printed on
its own line.  ``plan ms`` is then the best of three fresh plans (no plan cache), ``run ms`` one
run of the already planned batch.

Size limit: the demo holds a random KV cache, the queries and a float64 reference in host
memory, so a batch whose estimated footprint (:func:`demo_bytes`) is past
:data:`MAX_DEMO_BYTES` (1 GiB) is refused before anything is allocated, as is a tree spec past
the limits of :mod:`pat_core.workloads` (65536 requests, 2^24 block-table entries).

The installed command ``pat-demo`` is ``python -m pat_core demo``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

# The README's batch, then one whose shape makes the packers decide differently: a one-page
# root under three 64-token branches of four requests each (12 rows per branch at GQA group 4,
# not a power of two).  In the first, every prefix-aware packer finds the same CTAs.
DEFAULT_TREES = ("1,4,16_128,256,1024", "1,3,12_16,64,128")
PLAN_REPEATS = 3
WARM_TREE = "1,2_20,20"        # the small batch that compiles the CPU path before timing
MAX_DEMO_BYTES = 2**30          # host memory one batch's inputs and reference may take


def _parse_heads(s: str):
    try:
        a, b = s.split(":")
        hq, hk = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads must look like 32:8, got {s!r}") from None
    if hq < 1 or hk < 1 or hq % hk:
        raise argparse.ArgumentTypeError(f"--heads {s}: both >= 1 and the first a multiple of "
                                         f"the second")
    return hq, hk


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _tree(s: str) -> str:
    from .workloads import parse_tree_spec
    try:
        parse_tree_spec(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


class _Inputs:
    """One batch with its random inputs (NumPy, host) and its float64 reference."""

    def __init__(self, spec: str, args):
        from .reference import dense_attention, lowp_attention, relative_error
        from .workloads import build_tree_batch, random_kv_cache
        hq, hk = args.heads
        self.spec = spec
        self.batch = build_tree_batch(spec, args.page_size, seed=args.seed)
        dtype = {"float16": np.float16, "float32": np.float32}[args.dtype]
        self.k, self.v = random_kv_cache(self.batch.num_pages, args.page_size, hk,
                                         args.head_dim, dtype=dtype, seed=args.seed)
        rng = np.random.default_rng(args.seed + 1)
        self.q = rng.standard_normal((self.batch.batch_size, hq, args.head_dim)).astype(dtype)
        t0 = time.perf_counter()
        self.ref = dense_attention(self.q, (self.k, self.v), self.batch.block_tables,
                                   self.batch.seq_lens, args.page_size)
        self.t_ref = time.perf_counter() - t0
        if args.dtype == "float16":
            base = relative_error(lowp_attention(self.q, (self.k, self.v),
                                                 self.batch.block_tables, self.batch.seq_lens,
                                                 args.page_size), self.ref)
            self.tol = 2 * base
            self.tol_note = f"fp16: rel err <= 2 x plain fp16 ({base:.2e})"
        else:
            self.tol = 1e-5
            self.tol_note = "fp32: rel err <= 1e-5"


class _Runner:
    """Runs a plan on the chosen backend; ``run`` returns (host output, seconds)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.cp = None
        if backend == "cuda":
            from . import cuda_backend
            self.cp = cuda_backend._import_cupy()
        self._dev = {}

    def device_inputs(self, inp: _Inputs):
        if self.cp is None:
            return inp.q, (inp.k, inp.v)
        key = id(inp)
        if key not in self._dev:
            cp = self.cp
            self._dev[key] = (cp.asarray(inp.q), (cp.asarray(inp.k), cp.asarray(inp.v)))
        return self._dev[key]

    def run(self, w, inp: _Inputs):
        q, kv = self.device_inputs(inp)
        if self.cp is not None:
            self.cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = w.run(q, kv)
        if self.cp is not None:
            self.cp.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
            return self.cp.asnumpy(out), dt
        return out, time.perf_counter() - t0


def _packers():
    from . import PACKERS
    return ("query",) + tuple(p for p in PACKERS if p != "query")


def _warm_up(args, runner: _Runner, inputs) -> float:
    """Compile what is compiled on first use, before any timing: the Numba planner and CPU
    executor (on a small batch: compilation depends on argument types, not sizes), or the
    CUDA kernels every packer's plan of every batch launches.  Returns the seconds spent."""
    from . import PrefixAttentionWrapper
    hq, hk = args.heads
    t0 = time.perf_counter()
    if args.backend == "cpu":
        small = _Inputs(WARM_TREE, args)
        work = [small]
    else:
        work = inputs
    for inp in work:
        for packer in _packers():
            w = PrefixAttentionWrapper(backend=args.backend, packer=packer, gpu=args.gpu)
            plan = w.plan(inp.batch.block_tables, inp.batch.seq_lens, hq, hk, args.head_dim,
                          args.page_size, kv_data_type=args.dtype)
            if w._gpu_backend is not None:
                w._gpu_backend.warmup(plan)
            runner.run(w, inp)
    return time.perf_counter() - t0


def _plan_ms(packer: str, gpu: str, inp: _Inputs, args) -> float:
    """Best of PLAN_REPEATS plans, each by a fresh Planner (its cache never answers)."""
    from . import Planner
    hq, hk = args.heads
    best = float("inf")
    for _ in range(PLAN_REPEATS):
        planner = Planner(packer, gpu)
        t0 = time.perf_counter()
        planner.plan(inp.batch.block_tables, inp.batch.seq_lens, hq, hk, args.head_dim,
                     args.page_size, kv_data_type=args.dtype)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _one_batch(inp: _Inputs, args, runner: _Runner) -> bool:
    from . import PrefixAttentionWrapper
    from .reference import relative_error
    hq, hk = args.heads
    b = inp.batch
    print(f"\nbatch {inp.spec}: {b.batch_size} requests, {int(b.seq_lens.sum())} tokens listed, "
          f"{b.num_pages} pages of {args.page_size}; heads {hq}:{hk}, head_dim {args.head_dim}, "
          f"{args.dtype}; backend {args.backend}")
    header = (f"{'packer':<8} {'CTAs':>5} {'groups':>6} {'slots':>6} {'KV MB':>8} "
              f"{'total MB':>8} {'vs query':>8} {'plan ms':>8} {'run ms':>8} {'rel err':>9}"
              f"  ok  tiles")
    print(header)
    print("-" * len(header))
    failed = False
    query_total = None
    packings = {}
    plan = None
    for packer in _packers():
        w = PrefixAttentionWrapper(backend=args.backend, packer=packer, gpu=args.gpu)
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, args.head_dim, args.page_size,
                      kv_data_type=args.dtype)
        t_plan = _plan_ms(packer, w.planner.gpu, inp, args)
        out, t_run = runner.run(w, inp)
        err = relative_error(out, inp.ref)
        ok = bool(err <= inp.tol)
        failed |= not ok
        st = plan.stats()
        if query_total is None:
            query_total = st["total_bytes"]
        tiles = " ".join(f"{k}:{v}" for k, v in st["tiles"].items())
        packings.setdefault((st["num_ctas"], st["num_slots"], st["kv_bytes"], tiles),
                            []).append(packer)
        print(f"{packer:<8} {st['num_ctas']:>5} {plan.num_groups:>6} {st['num_slots']:>6} "
              f"{st['kv_bytes'] / 1e6:>8.2f} {st['total_bytes'] / 1e6:>8.2f} "
              f"{st['total_bytes'] / query_total:>8.3f} {t_plan:>8.2f} {t_run * 1e3:>8.1f} "
              f"{err:>9.2e}  {'yes' if ok else 'NO '} {tiles}")
    same = [names for names in packings.values() if len(names) > 1]
    if same:
        note = (" (cascade packs as node does; it differs in its groups, one per tree level and "
                "tile)" if any("cascade" in n and "node" in n for n in same) else "")
        print("same CTAs and tiles: " + "; ".join(", ".join(n) for n in same) + note)
    else:
        print("every packer chose different CTAs or tiles")
    forest = plan.extra.get("forest") if plan is not None else None
    if forest is not None:
        kvb = 2 * args.head_dim * hk * (2 if args.dtype == "float16" else 4)
        print(f"unique KV (each shared token once): {forest.unique_tokens() * kvb / 1e6:.2f} MB;"
              f" dense reference {inp.t_ref:.2f} s; tolerance {inp.tol_note}")
    return failed


def demo(args) -> int:
    from .gpus import get_gpu
    if args.gpu is not None:
        get_gpu(args.gpu)                       # unknown names fail before any work
    if args.backend == "cuda" and args.dtype == "float32":
        raise ValueError("--dtype float32 runs on --backend cpu only (the CUDA kernels take "
                         "float16 or bfloat16)")
    runner = _Runner(args.backend)              # --backend cuda without CuPy/GPU fails here
    trees = args.tree or list(DEFAULT_TREES)
    for spec in trees + [WARM_TREE]:
        check_demo_size(spec, args)             # before any allocation
    inputs = [_Inputs(spec, args) for spec in trees]
    t_warm = _warm_up(args, runner, inputs)
    what = ("Numba JIT of planner and CPU executor, or loading its on-disk cache"
            if args.backend == "cpu" else "CUDA kernel compile (or cache load) and first launch")
    print(f"first-call cost before timing: {t_warm:.2f} s ({what}); the tables below are warm")
    failed = False
    for inp in inputs:
        failed |= _one_batch(inp, args, runner)
    return 1 if failed else 0


def demo_bytes(spec: str, args) -> int:
    """Estimated host bytes of one demo batch: the K and V caches (every page the tree may
    need, see :func:`pat_core.workloads.tree_size`), the queries, and the float64 reference
    and low-precision outputs."""
    from .workloads import check_tree_size
    size = check_tree_size(spec, args.page_size)
    hq, hk = args.heads
    item = 2 if args.dtype == "float16" else 4
    kv = 2 * size["pages"] * args.page_size * hk * args.head_dim * item
    rows = size["requests"] * hq * args.head_dim
    return kv + rows * (item + 8 + 8)


def check_demo_size(spec: str, args) -> None:
    """``ValueError`` with the estimate and the limit when a batch is past
    :data:`MAX_DEMO_BYTES`."""
    need = demo_bytes(spec, args)
    if need > MAX_DEMO_BYTES:
        raise ValueError(f"--tree {spec}: needs about {need / 2**20:.0f} MiB of host memory "
                         f"(KV cache, queries, reference) at heads {args.heads[0]}:"
                         f"{args.heads[1]}, head_dim {args.head_dim}, page size "
                         f"{args.page_size}; the demo's limit is {MAX_DEMO_BYTES // 2**20} MiB")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pat_core",
                                 description="pat: prefix-aware decode attention")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="plan tree batches with every packer, run, check, report",
                       description="Plan tree batches with every packer, run them, check them "
                       "against float64 dense attention, and print CTAs, bytes, timings and "
                       "error per packer.")
    d.add_argument("--tree", type=_tree, action="append", default=None,
                   help="tree spec: node counts per level _ tokens per level node; repeat for "
                        f"several batches (default: {' and '.join(DEFAULT_TREES)}); at most "
                        f"65536 requests, 2^24 block-table entries and about "
                        f"{MAX_DEMO_BYTES // 2**20} MiB of KV cache, queries and reference")
    d.add_argument("--heads", type=_parse_heads, default=(32, 8), help="num_qo:num_kv")
    d.add_argument("--head-dim", type=_positive, default=128)
    d.add_argument("--page-size", type=_positive, default=16)
    d.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    d.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--gpu", default=None, help="GPU model to plan for (h100, h200, a100)")
    d.add_argument("--seed", type=int, default=0)
    return ap


# What bad input raises (argument values, files, sizes): reported as one ``error:`` line with
# exit status 2, argparse's convention.  Anything else is a bug and keeps its traceback.
INPUT_ERRORS = (ValueError, TypeError, OSError, OverflowError, ImportError)


def report_error(exc: BaseException) -> int:
    """Print ``exc`` as one ``error: ...`` line on stderr; returns the exit status 2."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror}"     # not "[Errno 21] Is a directory: 'x'"
    else:
        text = str(exc) or type(exc).__name__
    print("error: " + " ".join(text.split()), file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo(args)
    except INPUT_ERRORS + (RuntimeError,) as exc:   # RuntimeError: no GPU for --backend cuda
        return report_error(exc)
    return 2


def demo_main(argv=None) -> int:
    """Entry point of the installed ``pat-demo`` command: ``python -m pat_core demo``."""
    return main(["demo"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
