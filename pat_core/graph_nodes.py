"""Kernel nodes of a captured CUDA graph, switched on and off (CUDA driver API through ctypes).

Graph-safe mode enqueues one forward launch per tile the planner can reach, so a graph captured
around ``run()`` holds all of them; on a small step most have no work, and each still costs the
replay ~1-2 us (bench/NOTES.md).  ``cuGraphNodeSetEnabled`` turns a node of an instantiated
graph into an empty node until it is enabled again, without re-instantiating; the change applies
from the next launch of the graph.  :meth:`pat_core.PrefixAttentionWrapper.bind_graph` uses
this module to find its own launches in a graph and switch off those whose tile has no CTA in
the current plan.

A node is recognised as one of ours when its function is the launch's ``CUfunction`` *and* its
argument (the launch's parameter struct, which holds this wrapper's own buffer addresses) is
byte-for-byte the struct the launch was enqueued with, so launches of another wrapper in the
same graph are never touched.

Nothing here is loaded until first used (``libcuda.so.1``), so the module imports on machines
without a GPU.
"""
from __future__ import annotations

import ctypes

CU_GRAPH_NODE_TYPE_KERNEL = 0
_lib = None


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (the v1 layout is its prefix)."""

    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


def _driver():
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"graph binding needs the CUDA driver (libcuda.so.1): {e}") from e
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


def kernel_nodes(graph: int) -> list:
    """``[(node, function, params)]`` for every kernel node of the CUDA graph ``graph`` (a
    ``CUgraph`` / ``cudaGraph_t`` handle as an int): the node handle, its ``CUfunction`` and
    the node's first kernel argument's address (``None`` when it has none)."""
    lib = _driver()
    g = ctypes.c_void_p(int(graph))
    n = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(g, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * max(1, n.value))()
    _check(lib.cuGraphGetNodes(g, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    get = getattr(lib, "cuGraphKernelNodeGetParams_v2", None) or lib.cuGraphKernelNodeGetParams
    out = []
    for i in range(n.value):
        node = ctypes.c_void_p(nodes[i])
        kind = ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        p = _KernelNodeParams()
        _check(get(node, ctypes.byref(p)), "cuGraphKernelNodeGetParams")
        arg0 = p.kernelParams[0] if p.kernelParams else None
        out.append((int(node.value), int(p.func or 0), arg0))
    return out


def node_arg_bytes(arg0, size: int) -> bytes:
    """The first ``size`` bytes of a node's first kernel argument (host copy the graph keeps)."""
    return b"" if not arg0 else ctypes.string_at(arg0, size)


def set_enabled(graph_exec: int, node: int, enabled: bool) -> None:
    """Enable or disable kernel node ``node`` in the instantiated graph ``graph_exec`` (from the
    next launch of that graph on)."""
    _check(_driver().cuGraphNodeSetEnabled(ctypes.c_void_p(int(graph_exec)),
                                           ctypes.c_void_p(int(node)),
                                           ctypes.c_uint(1 if enabled else 0)),
           "cuGraphNodeSetEnabled")


__all__ = ["kernel_nodes", "node_arg_bytes", "set_enabled"]
