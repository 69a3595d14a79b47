"""What a launch that has no work costs in a CUDA graph, as a kernel node against a skipped
conditional node.

A graph-safe replay runs every launch of its set, with work or not; CUDA 12.4's conditional
nodes could let the device skip the empty ones.  This script answers whether a skipped node is
cheaper than an idle launch, without pat: graphs built node by node (``cuda.bindings``, which
CuPy depends on) from four trivial kernels, each replay timed with CUDA events (median of
``--reps``):

* ``I``: an idle launch of ``--grid`` blocks (each reads one int and exits; it lets the next
  launch start at once and its block 0 waits for the launch before, as a chained pat launch);
* ``W``: a working launch (128 blocks, ~11 us of clock spinning);
* ``C``: a conditional IF node whose body is an ``I`` launch, its condition reset to
  ``--condition`` on every replay (0: the body is skipped);
* ``F``: a final one-block launch that waits for the launch before.

A sequence such as ``IIIWIF`` chains its nodes in order; with ``pdl`` the edges between two
kernel nodes are programmatic (the next launch starts while the one before runs, as pat's
chain; a conditional node takes plain edges).  The per-node cost is a sequence's time less that
of ``F`` (or ``WF``), over the nodes added.

    python bench/lab/conditional_nodes.py --out DIR [--reps 300] [--grid 264]

Writes ``DIR/conditional_nodes.json`` and prints one row per graph.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:     # run as a script: python bench/lab/conditional_nodes.py
    sys.path.insert(0, ROOT)

SRC = r'''
__device__ int g_live;
extern "C" __global__ void idle() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if ((int)blockIdx.x < *(volatile int*)&g_live) g_live = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("griddepcontrol.wait;" ::: "memory");
}
extern "C" __global__ void work() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long t0 = clock64();
  while (clock64() - t0 < 20000) {}
  if (blockIdx.x == 0 && threadIdx.x == 0) asm volatile("griddepcontrol.wait;" ::: "memory");
}
extern "C" __global__ void fin() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
'''

# (sequence, programmatic edges, condition of the C nodes)
CASES = (("F", True, 0), ("IF", True, 0), ("CF", True, 0), ("IIIIIF", True, 0),
         ("IIIIIF", False, 0), ("CCCCCF", False, 0), ("CCCCCF", False, 1), ("WF", True, 0),
         ("WIIIIF", True, 0), ("WCCCCF", True, 0), ("IIIWIF", True, 0), ("IIIWIF", False, 0),
         ("CCCWCF", False, 0), ("CCCWCF", False, 1))


def _ok(res):
    """The value of a ``cuda.bindings`` call that returned ``(error, value)`` or
    ``(error,)``; ``RuntimeError`` naming the error otherwise."""
    if int(res[0]) != 0:
        raise RuntimeError(str(res[0]))
    return res[1] if len(res) > 1 else None


class Graphs:
    """Builds and times the graphs of one process (one CUDA device, CuPy's context)."""

    def __init__(self, grid: int):
        import cupy as cp
        from cuda.bindings import driver, runtime
        self.cp, self.drv, self.rt, self.grid = cp, driver, runtime, int(grid)
        mod = cp.RawModule(code=SRC)
        self.fn = {k: mod.get_function(k) for k in ("idle", "work", "fin")}
        self.stream = cp.cuda.Stream(non_blocking=True)

    def _kernel(self, graph, name: str):
        p = self.drv.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.drv.CUfunction(self.fn[name].kernel.ptr)
        p.gridDimX = {"idle": self.grid, "work": 128, "fin": 1}[name]
        p.gridDimY = p.gridDimZ = p.blockDimY = p.blockDimZ = 1
        p.blockDimX = 128
        p.sharedMemBytes = 0
        p.kernelParams = 0
        p.extra = 0
        return _ok(self.drv.cuGraphAddKernelNode(graph, None, 0, p))

    def _edge(self, graph, a, b, programmatic: bool) -> None:
        rt = self.rt
        e = rt.cudaGraphEdgeData()
        if programmatic:
            e.from_port = rt.cudaGraphKernelNodePortProgrammatic
            e.type = rt.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic
        _ok(rt.cudaGraphAddDependencies(graph, [a], [b], [e], 1))

    def build(self, seq: str, pdl: bool, condition: int):
        """The instantiated graph of ``seq`` (see the module docstring)."""
        rt = self.rt
        g = _ok(rt.cudaGraphCreate(0))
        prev = prev_kernel = None
        for ch in seq:
            if ch == "C":
                h = _ok(rt.cudaGraphConditionalHandleCreate(
                    g, condition, rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault))
                prm = rt.cudaGraphNodeParams()
                prm.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
                prm.conditional.handle = h
                prm.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
                prm.conditional.size = 1
                node = _ok(rt.cudaGraphAddNode(g, None, None, 0, prm))
                self._kernel(prm.conditional.phGraph_out[0], "idle")
                kernel = False
            else:
                node = self._kernel(g, {"I": "idle", "W": "work", "F": "fin"}[ch])
                kernel = True
            if prev is not None:
                self._edge(g, prev, node, pdl and prev_kernel and kernel)
            prev, prev_kernel = node, kernel
        return _ok(rt.cudaGraphInstantiate(g, 0))

    def time(self, exe, reps: int) -> float:
        """Median replay time of ``exe`` (us), CUDA events around each launch."""
        cp, drv = self.cp, self.drv
        s = drv.CUstream(self.stream.ptr)
        for _ in range(30):
            _ok(drv.cuGraphLaunch(exe, s))
        self.stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(reps):
            e0.record(self.stream)
            _ok(drv.cuGraphLaunch(exe, s))
            e1.record(self.stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--grid", type=int, default=264, help="blocks of an idle launch")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.grid < 1:
        ap.error("--reps and --grid must be >= 1")
    import cupy as cp
    from bench.common import git_sha, write_result
    g = Graphs(args.grid)
    rows = []
    with g.stream:
        for seq, pdl, cond in CASES:
            us = g.time(g.build(seq, pdl, cond), args.reps)
            rows.append({"seq": seq, "pdl": pdl, "condition": cond, "us": round(us, 2)})
            print(f"{seq:8s} pdl {int(pdl)} condition {cond}  {us:7.2f} us", flush=True)
    import cuda.bindings
    out = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "git_sha": git_sha(), "cupy": cp.__version__,
           "cuda_bindings": cuda.bindings.__version__,
           "driver": cp.cuda.runtime.driverGetVersion(), "grid": args.grid, "reps": args.reps,
           "rows": rows}
    write_result(os.path.join(args.out, "conditional_nodes.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
