"""Kernel launches of the CUDA backend: one parameter struct per launch, programmatic
dependent launches on Hopper, and the caller's stream.

Every kernel takes one parameter struct (:mod:`pat_core.kernel_params`).  :class:`_Launch`
keeps it in ctypes storage and launches it through the driver (``cuLaunchKernelEx`` with the
programmatic-stream-serialization attribute when the launch is a dependent of the one before
it); the stream is the caller's current one (torch's or CuPy's).
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from . import kernel_params as kp

log = logging.getLogger("pat_core.cuda")

_LOG2E = 1.4426950408889634


class _Launch:
    """One kernel launch whose single argument is a parameter struct (:mod:`.kernel_params`).

    Fast path: the struct lives in ctypes storage and goes to ``cuLaunchKernel`` through CuPy's
    driver binding (a few microseconds); CuPy's generic ``Function.__call__`` converts its
    arguments on each call (~10 us per launch measured on an H200 host), which dominated small
    batches; it gets the struct as a NumPy record.  Fields of ``params`` may be changed between
    calls (the output pointers change per call).
    """

    __slots__ = ("fn", "grid", "block", "params", "smem", "fast", "ptrs", "fptr", "launch",
                 "keep", "cfg")

    def __init__(self, fn, grid, block, params, smem, fast=True, keep=None):
        self.fn, self.grid, self.block, self.smem = fn, grid, block, int(smem)
        self.keep = keep   # device arrays the parameters point to (kept alive with the launch)
        self.params = params
        self.cfg = None    # cuLaunchKernelEx's config, built on the first dependent launch
        # RawModule.get_function hands back a RawKernel; its loaded driver function (``.kernel``,
        # a cupy.cuda.function.Function) carries the CUfunction handle cuLaunchKernel needs
        func = getattr(fn, "kernel", fn)
        self.fast = bool(fast) and hasattr(func, "ptr")
        if fast and not self.fast:
            log.warning("no CUfunction handle on %s: using CuPy's generic launch", type(fn))
        if self.fast:
            from cupy.cuda import driver
            self.launch = driver.launchKernel
            self.ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            self.fptr = int(func.ptr)

    def set_grid(self, blocks: int) -> None:
        """Launch ``blocks`` blocks from now on (a 1-D grid)."""
        if self.grid[0] != blocks:
            self.grid = (int(blocks), 1, 1)
            if self.cfg is not None:
                self.cfg.gridDimX = int(blocks)

    def with_inputs(self, fields) -> "_Launch":
        """A copy of this launch whose parameter struct (a FwdParams) carries ``fields``
        (:func:`_input_fields`); the kernel, grid and kept device arrays are shared."""
        ln = _Launch.__new__(_Launch)
        ln.fn, ln.grid, ln.block, ln.smem, ln.keep = self.fn, self.grid, self.block, self.smem, \
            self.keep
        ln.params = _copy_params(self.params)
        _set_inputs(ln.params, fields)
        ln.fast, ln.cfg = self.fast, None
        if self.fast:
            ln.launch, ln.fptr = self.launch, self.fptr
            ln.ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(ln.params))
        return ln

    def __call__(self, stream_ptr: int, dependent: bool = False) -> None:
        """Enqueue on ``stream_ptr``; ``dependent``: as a programmatic dependent of the launch
        before it on that stream (``cuLaunchKernelEx``; fast path only), which lets this
        launch's blocks start before that one has finished."""
        g, b = self.grid, self.block
        if dependent:
            if not self.fast:
                raise RuntimeError("a programmatic dependent launch needs the fast launch path")
            cfg = self.cfg
            if cfg is None:
                cfg = self.cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], self.smem, 0,
                                               ctypes.pointer(_PDL_ATTR), 1)
            cfg.hStream = stream_ptr
            err = _launch_ex()(ctypes.byref(cfg), self.fptr, ctypes.addressof(self.ptrs), None)
            if err:
                raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
        elif self.fast:
            self.launch(self.fptr, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream_ptr,
                        ctypes.addressof(self.ptrs), 0)
        else:
            import cupy
            rec = np.frombuffer(bytes(self.params), dtype=np.dtype(type(self.params)))[0]
            self.fn(self.grid, self.block, (rec,), shared_mem=self.smem,
                    stream=_external_stream(cupy, stream_ptr, cupy.cuda.runtime.getDevice()))


# cuLaunchKernelEx and its structs (cuda.h, CUDA 12+), for programmatic dependent launch, which
# CuPy's driver binding does not expose.
class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# the attribute's value: programmaticStreamSerializationAllowed = 1 (an int at the union's start)
_PDL_ATTR = _LaunchAttr(_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"",
                        (1).to_bytes(4, "little") + bytes(60))
_LAUNCH_EX = []   # [cuLaunchKernelEx or None], looked up once


def _launch_ex():
    """The driver's ``cuLaunchKernelEx`` (ctypes), or None where the driver has none."""
    if not _LAUNCH_EX:
        fn = None
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p]
        except (OSError, AttributeError):
            log.warning("no cuLaunchKernelEx in the CUDA driver: launches run serially")
        _LAUNCH_EX.append(fn)
    return _LAUNCH_EX[0]


def _ptr(a) -> int:
    """Device address of a CuPy array (0 for None)."""
    return 0 if a is None else int(a.data.ptr)


def _copy_params(p):
    """A separate copy of a ctypes parameter struct."""
    return type(p).from_buffer_copy(p)


def _set_out(p, out_args) -> None:
    """Output pointer and strides of a MergeParams or MergeArgs struct."""
    p.out, p.lse_out, p.out_sb, p.out_sh, p.lse_sb, p.lse_sh = out_args


def _fwd_params(qd, kd, vd, axes, o_part, l_part, arrays, group, Hq, Hk, page_size, sm_scale,
                k_scale: float = 1.0, v_scale: float = 1.0):
    """The forward parameters every launch of a step shares (CTA range and variant left 0).
    ``arrays`` maps each Plan array name to its device address (int) or CuPy array.
    ``k_scale``/``v_scale``: an fp8 cache's scales; k_scale is folded into the softmax scale
    here, on the host (one float), v_scale is read by the fp8 variants only."""
    def addr(name):
        v = arrays[name]
        return v if isinstance(v, int) else _ptr(v)

    prm = kp.FwdParams(
        o_partial=_ptr(o_part),
        lse_partial=_ptr(l_part), cta_req_indptr=addr("cta_req_indptr"),
        cta_req=addr("cta_req"), cta_slot=addr("cta_slot"), cta_kv_start=addr("cta_kv_start"),
        cta_kv_len=addr("cta_kv_len"), cta_page_indptr=addr("cta_page_indptr"),
        cta_pages=addr("cta_pages"),
        num_kv_heads=Hk, head_minor=1, group=group, num_qo_heads=Hq,
        page_size=page_size, scale_log2=float(sm_scale * k_scale * _LOG2E),
        v_scale=float(v_scale))
    if qd is not None:
        _set_inputs(prm, _input_fields(qd, kd, vd, axes))
    return prm


def _input_fields(qd, kd, vd, axes) -> tuple:
    """The forward parameters' input fields, in :data:`_INPUT_FIELDS` order: q and cache
    addresses and their element strides (``axes``: the caches' (page, token, head) axes)."""
    ax_page, ax_tok, ax_head = axes
    return (qd.ptr, kd.ptr, vd.ptr, qd.strides[0], qd.strides[1], kd.strides[ax_page],
            kd.strides[ax_tok], kd.strides[ax_head], vd.strides[ax_page], vd.strides[ax_tok],
            vd.strides[ax_head])


_INPUT_FIELDS = ("q", "k_cache", "v_cache", "q_sb", "q_sh", "k_sp", "k_st", "k_sh", "v_sp",
                 "v_st", "v_sh")


def _set_inputs(p, fields) -> None:
    """Write :func:`_input_fields` into a FwdParams struct."""
    (p.q, p.k_cache, p.v_cache, p.q_sb, p.q_sh, p.k_sp, p.k_st, p.k_sh, p.v_sp, p.v_st,
     p.v_sh) = fields


_RAW_STREAM = []   # [torch._C._cuda_getCurrentRawStream or None], looked up once


def _torch_stream_handle(device: int) -> int:
    """Handle of torch's current stream on ``device`` (called once per run: kept cheap)."""
    if not _RAW_STREAM:
        import torch
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    raw = _RAW_STREAM[0]
    if raw is not None:
        return int(raw(device))
    import torch
    return int(torch.cuda.current_stream(device).cuda_stream)


# ---------------------------------------------------------------------------------- helpers
def _external_stream(cp, handle: int, device: int):
    """CuPy object for a stream someone else owns (torch's), across CuPy versions; made once
    per handle and device (the object only names the stream; making one costs ~10 us)."""
    key = (handle, device)
    st = _EXTERNAL.get(key)
    if st is not None:
        return st
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    st = None
    if from_external is not None:
        try:
            st = from_external(_StreamHandle(handle))
        except Exception:
            pass
    if st is None:
        st = cp.cuda.ExternalStream(handle, device)
    if len(_EXTERNAL) >= 64:
        _EXTERNAL.clear()
    _EXTERNAL[key] = st
    return st


_EXTERNAL: dict = {}   # (stream handle, device) -> CuPy stream object


class _StreamHandle:
    """Minimal CUDA stream protocol object (``__cuda_stream__``) for Stream.from_external."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)
