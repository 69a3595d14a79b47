"""CUDA backend: run a :class:`~pat_core.plan.Plan` with the hand-written kernels in ``cuda_src/``.

The kernels are C++ templates compiled at run time by NVRTC through CuPy (``RawModule`` with
name expressions), one module per variant; see :mod:`pat_core.cuda_compile` for the variant
rules and names.  Inputs may be torch CUDA tensors or CuPy arrays (zero copy: the kernels get
their device pointers and element strides); outputs are returned as the same kind as ``q``.

One execution path serves plain calls and CUDA graphs.  A plan is written into a device state
(:class:`StaticState`: every Plan array at a fixed offset of one int32 buffer, by one
asynchronous copy from pinned memory on the caller's stream) and runs as::

    caller stream ── pull launch (tile a) ─▶ pull launch (tile b) ─▶ ... ─▶ merge ── out [, lse]

one pull-mode forward launch per tile variant over a fixed grid of resident blocks, each block
taking item b first and drawing further items (CTA x KV head, longest CTAs first within a tile)
from a work counter until the live count in device memory is reached; each arrow a programmatic
dependent launch on Hopper and later (the next launch's blocks are placed as soon as every block
of the one before is, and each launch's last block waits for the launch before it, so the merge
finds every forward launch finished).  A request whose KV one work item holds (one partial
slot) gets its output from that item; the merge combines the others' partials and resets the
work counters.

* **Graph-safe** (:meth:`CudaBackend.run_static`, the wrapper's ``use_cuda_graph=True``): the
  state's limits and launch set are fixed once (:mod:`pat_core.static_plan`), every launch
  runs on every call and the merge reads the live batch from device memory, so one captured
  graph serves every later plan.
* **Plain** (:meth:`CudaBackend.run`): one state per problem shape, grown when a plan does not
  fit; a call launches only the tiles the plan uses (in the launch set's order, tallest tiles
  first) and skips the merge when no request has more than one slot and no block drew a second
  item.

Everything is enqueued on the caller's current stream (``torch.cuda.current_stream()`` for
torch inputs, CuPy's current stream for CuPy inputs); the sequence is allocation-free once the
state exists, so it can also be captured per plan (a plain plan's graph is valid until the next
``plan()`` rewrites the state it reads).  Every kernel takes one parameter struct
(:mod:`pat_core.kernel_params`).

Example::

    import torch, pat_core
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,16_128,256,1024", page_size=16)
    w = pat_core.PrefixAttentionWrapper(backend="cuda", packer="pat")
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, kv_data_type="float16")
    k = torch.randn(b.num_pages, 16, 8, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(b.batch_size, 32, 128, device="cuda", dtype=torch.float16)
    out, lse = w.run(q, (k, v), return_lse=True)      # [16, 32, 128] fp16, [16, 32] fp32
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

from . import cuda_compile as cc
from . import kernel_params as kp
from .gpus import detect_gpu_name
from .inputs import byte_extent, refuse_overlap
from .launch import launch_grid, merge_block_per_pair, merge_heads_per_warp, merge_needed
from .plan import Plan, dtype_name

log = logging.getLogger("pat_core.cuda")

_LOG2E = 1.4426950408889634

def _import_cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy built for another CUDA
        raise RuntimeError(
            "the CUDA backend needs CuPy (pip install cupy-cuda12x or cupy-cuda13x matching your "
            f"CUDA driver); importing it failed: {e}") from e
    return cupy


def is_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# ---------------------------------------------------------------------------------- tensors
class _Dev:
    """What the launcher needs from a device array: pointer, shape, element strides, dtype."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "device")

    def __init__(self, obj, name: str):
        self.obj = obj
        mod = type(obj).__module__
        if mod.startswith("torch"):
            if not obj.is_cuda:
                raise TypeError(f"{name} must be a CUDA tensor for backend='cuda', got a tensor "
                                f"on {obj.device}")
            self.kind = "torch"
            self.ptr = obj.data_ptr()
            self.shape = tuple(obj.shape)
            self.strides = obj.stride()
            dt = obj.dtype
            name_ = _TORCH_DTYPES.get(dt)
            if name_ is None:
                name_ = _TORCH_DTYPES.setdefault(dt, _safe_dtype_name(dt))
            self.dtype = name_
            self.device = obj.get_device()
        elif mod.startswith("cupy"):
            self.kind = "cupy"
            self.ptr = int(obj.data.ptr)
            self.shape = tuple(int(s) for s in obj.shape)
            item = obj.dtype.itemsize
            self.strides = tuple(int(s) // item for s in obj.strides)
            self.dtype = _np_dtype_name(obj.dtype)
            self.device = int(obj.device.id)
        elif hasattr(obj, "__cuda_array_interface__"):
            cai = obj.__cuda_array_interface__
            self.kind = "cai"
            self.ptr = int(cai["data"][0])
            self.shape = tuple(int(s) for s in cai["shape"])
            dt = np.dtype(cai["typestr"])
            if cai.get("strides") is None:
                st, acc = [], 1
                for s in reversed(self.shape):
                    st.append(acc)
                    acc *= s
                self.strides = tuple(reversed(st))
            else:
                self.strides = tuple(int(s) // dt.itemsize for s in cai["strides"])
            self.dtype = _np_dtype_name(dt)
            self.device = None
        else:
            raise TypeError(f"{name} must be a torch CUDA tensor or a CuPy array, got "
                            f"{type(obj).__name__}")

    def ndim(self):
        return len(self.shape)

    def sig(self) -> tuple:
        return (self.kind, self.ptr, self.shape, self.strides, self.dtype, self.device)


_TORCH_DTYPES: dict = {}   # torch dtype -> canonical name (filled on first sight)
_TORCH_ALLOC: dict = {}    # canonical name -> torch dtype, for the arrays run() allocates


def _data_ptr(a) -> int:
    """Device address of a torch tensor or CuPy array that run() allocated."""
    ptr = getattr(a, "data_ptr", None)
    return int(ptr()) if ptr is not None else int(a.data.ptr)


def _safe_dtype_name(dt) -> str:
    try:
        return dtype_name(dt)
    except TypeError:
        return str(dt).replace("torch.", "")


def _np_dtype_name(dt) -> str:
    s = str(dt)
    if s in ("bfloat16", "|V2") or "bfloat16" in s:
        return "bfloat16"
    return dtype_name(np.dtype(dt).name)


def _check_rows(t: _Dev, name: str, ndim: int):
    if t.ndim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {t.shape}")
    if t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got element "
                         f"strides {t.strides}")


def _check_cache(qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str, page_size: int, Hk: int,
                 D: int) -> tuple:
    """Check the paged KV cache against the plan's page size, KV heads and head_dim, and the
    16-byte alignment and 32-bit offsets of q and both caches.  Returns ``(num_pages, (page,
    token, head) axes)``."""
    _check_rows(kd, "k_cache", 4)
    _check_rows(vd, "v_cache", 4)
    if kd.shape != vd.shape:
        raise ValueError(f"paged_kv_cache: k_cache {kd.shape} and v_cache {vd.shape} differ")
    if kv_layout == "NHD":
        num_pages, ps, hk, d = kd.shape
        axes = (0, 1, 2)
    else:
        num_pages, hk, ps, d = kd.shape
        axes = (0, 2, 1)
    if ps != page_size or hk != Hk or d != D:
        raise ValueError(f"paged_kv_cache has page_size {ps}, {hk} KV heads of dim {d}; the "
                         f"plan expects {page_size}, {Hk}, {D} (kv_layout={kv_layout!r})")
    _check_aligned(qd, "q", (0, 1))
    _check_aligned(kd, "k_cache", (0, 1, 2))
    _check_aligned(vd, "v_cache", (0, 1, 2))
    _check_offsets_32bit(qd, "q", outer=0, inner=(1, 2))
    _check_offsets_32bit(kd, "k_cache", outer=axes[0], inner=(axes[1], axes[2], 3))
    _check_offsets_32bit(vd, "v_cache", outer=axes[0], inner=(axes[1], axes[2], 3))
    return int(num_pages), axes


_INT32_MAX = 2**31 - 1


def _check_offsets_32bit(t: _Dev, name: str, outer: int, inner: tuple):
    """The forward kernel's gather forms an address as (outer index) x (outer stride), one
    32x32 -> 64-bit multiply, plus a 32-bit offset inside the outer slice (a page of the cache, a
    row of q): both must fit in int32.  True of any cache a GPU can hold in the usual layouts
    (a page of 16 tokens x 8 heads x 128 is 16,384 elements); a strided view that breaks it is
    rejected here rather than read out of bounds."""
    inner_span = sum((t.shape[a] - 1) * abs(t.strides[a]) for a in inner)
    if abs(t.strides[outer]) > _INT32_MAX or inner_span > _INT32_MAX:
        raise ValueError(f"{name}: element strides {t.strides} (shape {t.shape}) are too large: "
                         f"the kernels need the stride of axis {outer} and the span of one slice "
                         f"along it within 2**31 - 1 elements")


def _check_aligned(t: _Dev, name: str, axes):
    """cp.async moves 16-byte chunks: row starts must be 16-byte aligned (8 fp16/bf16)."""
    if t.ptr % 16 != 0 or any(t.strides[a] % 8 != 0 for a in axes if t.shape[a] > 1):
        raise ValueError(f"{name}: the kernels need 16-byte aligned rows (data pointer and the "
                         f"strides of the non-head_dim axes multiples of 8 elements); got "
                         f"pointer {t.ptr:#x}, element strides {t.strides}")


# ---------------------------------------------------------------------------------- backend
class CudaBackend:
    """Launcher of the forward and merge kernels for one process (all devices).

    One execution path: a plan lives in a :class:`StaticState` (its arrays at fixed offsets of
    one device buffer, fixed partial buffers, one work counter per tile) and runs as pull-mode
    forward launches, one per tile variant, over fixed grids whose blocks draw work items until
    the live count in device memory, chained on the caller's stream, then the merge.  A
    graph-safe wrapper fixes the state's limits and launch set once; a plain one
    (:meth:`upload`, :meth:`run`) keeps one state per problem shape, grown when a plan does not
    fit, and launches only the tiles the written plan uses.

    Not thread-safe across concurrent ``plan``/``run`` calls of one instance (the state is
    reused); use one backend per thread.  Compiled kernels are shared by every instance of
    the process.
    """

    _lock = threading.Lock()
    _functions: dict = {}    # (device, variant key) -> CuPy Function (process-wide)
    _modules: dict = {}      # keeps the modules alive

    def __init__(self):
        cp = _import_cupy()
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:
            raise RuntimeError(f"the CUDA backend found no usable CUDA device: {e}") from e
        if n < 1:
            raise RuntimeError("the CUDA backend found no CUDA device")
        self.cp = cp
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"]
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.gpu_name = detect_gpu_name(self.device_name)
        self.arch = f"sm_{props['major']}{props['minor']}"
        self.max_smem_optin = int(props.get("sharedMemPerBlockOptin", 0) or 0)
        self._sm_counts: dict = {}    # device -> SM count
        self._states: dict = {}       # (device, shape key) -> StaticState of plain plans
        # launch through cuLaunchKernel with pre-packed arguments (False: CuPy's generic call)
        self.fast_launch = True
        # graph-safe mode: every tile of the launch set in one fused pull launch ("on"), one
        # launch per tile ("off"), or by the bucket size ("auto", static_plan.graph_safe_fused);
        # read when a wrapper makes its graph-safe state
        self.graph_fused = "auto"

    # ------------------------------------------------------------------ compile
    def _function(self, variant):
        dev = self.cp.cuda.runtime.getDevice()
        key = (dev, variant.key)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(key)
            if fn is not None:
                return fn
            log.info("compile %s", variant.key)
            mod, name = _raw_module(self.cp, variant)
            fn = mod.get_function(name)
            smem = variant.smem_bytes
            # opt in near the 48 KB default too: the limit counts static shared memory as well
            # (the graph-safe kernels have a few bytes), so 48 KB of dynamic alone is too much
            if smem > cc.SMEM_OPT_IN_BYTES:
                if self.max_smem_optin and smem > self.max_smem_optin:
                    raise ValueError(f"{variant.key} needs {smem} bytes of shared memory; this "
                                     f"device allows {self.max_smem_optin}")
                fn.max_dynamic_shared_size_bytes = smem
            self._modules[key] = mod
            self._functions[key] = fn
            return fn

    def variants_for(self, plan: Plan, dtype: str | None = None) -> list:
        """Forward (pull) variants plus the merge variant a Plan needs (for ``dtype``,
        default the plan's)."""
        dtype = dtype_name(dtype or plan.kv_dtype)
        fwd = [cc.FwdVariant.make(v.m, v.n, v.head_dim, dtype, arch=self.arch)
               for v in cc.plan_fwd_variants(plan, self.arch)]
        nh = self._merge_layout(plan)[1]
        return fwd + [cc.MergeVariant(plan.head_dim, dtype, cc.MERGE_WARPS, nh)]

    def warmup(self, plan: Plan | None = None, variants=None, jobs: int | None = None) -> list:
        """Compile the variants ``plan`` needs, or those listed (FwdVariant, MergeVariant or
        FusedVariant objects, or the keys of the first two), or every forward variant and the
        merges when both are None.  Logs one line per compile (the key).

        ``jobs > 1`` first compiles the missing variants in that many worker processes, which
        fill CuPy's on-disk kernel cache; this process then loads the cached binaries.  Fused
        variants (one translation unit holding several tiles) always compile in this process.
        Returns the variant keys now ready.
        """
        if variants is None:
            if plan is not None:
                variants = self.variants_for(plan)
            else:
                variants = [v for v in cc.all_fwd_variants()
                            if v == cc.FwdVariant.make(v.m, v.n, v.head_dim, v.dtype,
                                                       arch=self.arch)]
                variants += cc.all_merge_variants()
        variants = [_variant_from(v) for v in variants]
        dev = self.cp.cuda.runtime.getDevice()
        todo = [v for v in variants if (dev, v.key) not in self._functions
                and not isinstance(v, cc.FusedVariant)]
        if jobs and jobs > 1 and len(todo) > 1:
            try:
                _compile_in_workers(todo, jobs)
            except Exception as e:  # fall back to compiling here
                log.warning("parallel compile failed (%s); compiling serially", e)
        for v in variants:
            self._function(v)
        return [v.key for v in variants]

    # ------------------------------------------------------------------ plain plans
    def state_for(self, plan: Plan) -> "StaticState":
        """The device state that holds ``plan`` on the current device: the one of its problem
        shape (heads, head_dim, page size, dtype, ``sm_scale``) when the plan fits its limits
        and tiles, else a new one sized for it (limits 1.25x the plan's, tiles the union of the
        old state's and the plan's), which replaces the old one once the device is idle."""
        from .static_plan import StaticLayout, StaticLimits, order_tiles
        _check_plan_tiles(plan)
        dev = self.cp.cuda.runtime.getDevice()
        shape = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                 dtype_name(plan.kv_dtype), float(plan.sm_scale))
        key = (dev, shape)
        st = self._states.get(key)
        tiles = {(int(m), int(n)) for m, n in plan.tile_configs.tolist()}
        need = (plan.batch_size, max(1, int(plan.cta_pages.shape[0]) - plan.num_ctas),
                max(1, plan.num_ctas), max(1, plan.num_slots))
        if st is not None:
            lim = st.layout.limits
            have = (lim.max_batch_size, lim.max_num_pages, lim.max_ctas, lim.max_partials)
            if tiles <= set(st.layout.tiles) and all(n <= h for n, h in zip(need, have)):
                return st
            tiles |= set(st.layout.tiles)
            need = tuple(max(n, h) for n, h in zip(need, have))
            # kernels of the old state's last run may still read its buffers
            self.cp.cuda.Device(dev).synchronize()
        grow = [max(1, (n * 5 + 3) // 4) for n in need]
        layout = StaticLayout(StaticLimits(*grow), order_tiles(tiles))
        st = StaticState(self, layout, *shape, fixed=False)
        self._states[key] = st
        return st

    def upload(self, plan: Plan, stream_ptr: int | None = None) -> None:
        """Write ``plan`` into its device state (:meth:`state_for`): one asynchronous copy from
        pinned memory on ``stream_ptr`` (default: CuPy's current stream), ordered after the
        work already on that stream.  Never waits for the device, except when a state grows."""
        st = self.state_for(plan)
        if stream_ptr is None:
            stream_ptr = self.cp.cuda.get_current_stream().ptr
        st.write(plan, stream_ptr)

    # ------------------------------------------------------------------ run
    def run(self, plan: Plan, q, k_cache, v_cache, kv_layout: str = "NHD",
            return_lse: bool = False, out=None, lse=None, check=None):
        """Forward + merge for one batch.

        Parameters
        ----------
        plan : the batch's :class:`~pat_core.plan.Plan` (written into its device state here,
            on the caller's stream, unless :meth:`upload` already did).
        q : ``[batch, num_qo_heads, head_dim]`` float16/bfloat16, torch CUDA tensor or CuPy
            array (any strides with a contiguous last dimension and 16-byte aligned rows).
        k_cache, v_cache : ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), q's dtype; strided views
            are fine when head_dim is contiguous.
        out : optional output ``[batch, num_qo_heads, head_dim]`` in q's dtype (written in place).
        lse : optional float32 ``[batch, num_qo_heads]`` (implies return_lse).
        check : optional callable run (before this method's own checks) whenever the inputs
            are validated, i.e. not on calls that reuse cached launch arguments.

        Returns ``out`` (same kind as q), and ``lse`` fp32 natural log when ``return_lse``.

        The validated launch arguments are cached per input set (pointers, shapes, strides and
        dtypes; up to 64, e.g. one per model layer), so a decode loop pays for the checks once.
        """
        qd = _Dev(q, "q")
        dev = qd.device if qd.device is not None else self.cp.cuda.runtime.getDevice()
        with self.cp.cuda.Device(dev):
            # the usual call: the plan was written by upload() (the wrapper's plan())
            st = next((s for s in self._states.values() if s.plan is plan
                       and s.plan_version == plan.version and s.device == dev), None)
            if st is None:
                st = self.state_for(plan)
                st.write(plan, self._caller_stream(qd))
            return self._run_state(st, qd, k_cache, v_cache, kv_layout, return_lse, out, lse,
                                   check)

    def _merge_layout(self, plan: Plan) -> tuple:
        """``(block_per_pair, heads_per_warp)`` of the merge launch for ``plan``
        (:func:`pat_core.launch.merge_block_per_pair`,
        :func:`~pat_core.launch.merge_heads_per_warp`)."""
        n = self._num_sms()
        if merge_block_per_pair(plan, n):
            return True, 1
        return False, int(merge_heads_per_warp(plan, n))

    def _blocks_per_sm(self, v) -> int:
        """Blocks of kernel variant ``v`` an SM holds at once (the driver's occupancy query;
        the recorded resources where CuPy has no such query; at least 1)."""
        fn = self._function(v)
        per_sm = 0
        occ = getattr(self.cp.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", None)
        if occ is not None:
            try:
                per_sm = int(occ(getattr(fn, "kernel", fn).ptr, v.threads, v.smem_bytes))
            except Exception as e:     # older CuPy: fall back to the recorded resources
                log.debug("occupancy query failed (%s)", e)
        if per_sm < 1 and isinstance(v, cc.FusedVariant):
            per_sm = 1
        elif per_sm < 1:
            from .gpus import get_gpu
            from .tiles import check_tile
            chk = check_tile(v.m, v.n, v.head_dim, v.dtype, get_gpu(self.gpu_name))
            per_sm = max(1, chk.ctas_per_sm)
        return per_sm

    def _num_sms(self) -> int:
        """SMs of the current device (its properties read once: the query takes ~1 ms)."""
        rt = self.cp.cuda.runtime
        dev = rt.getDevice()
        n = self._sm_counts.get(dev)
        if n is None:
            n = self._sm_counts[dev] = int(rt.getDeviceProperties(dev)["multiProcessorCount"])
        return n

    def _caller_stream(self, q: _Dev) -> int:
        """The caller's current stream handle: torch's current stream on q's device for torch
        inputs, CuPy's current stream otherwise."""
        if q.kind == "torch":
            return _torch_stream_handle(q.device)
        return self.cp.cuda.get_current_stream().ptr

    def _alloc_like(self, qd: _Dev, shape, dtype: str):
        """A new C-contiguous ``shape`` array of ``dtype`` on q's device, of q's kind."""
        if qd.kind == "torch":
            import torch
            if not _TORCH_ALLOC:
                _TORCH_ALLOC.update(float16=torch.float16, bfloat16=torch.bfloat16,
                                    float32=torch.float32)
            return torch.empty(shape, dtype=_TORCH_ALLOC[dtype], device=qd.device)
        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16 arrays: pass out= or use torch tensors")
        return self.cp.empty(shape, dtype=dtype)

    def _pdl_ok(self, launches) -> bool:
        """Programmatic dependent launch is possible after ``launches``: an sm_90 or later
        device, a driver with ``cuLaunchKernelEx``, every launch on the fast path."""
        return (int(self.arch[3:]) >= 90 and all(ln.fast for ln in launches)
                and _launch_ex() is not None)

    def _outputs(self, qd: _Dev, rows: int, Hq: int, D: int, dtype: str, want_lse: bool, out,
                 lse, inputs: dict, note: str = ""):
        """Allocate or check ``out`` ``[rows, Hq, D]`` in ``dtype`` and (with ``want_lse``)
        ``lse`` float32 ``[rows, Hq]``; a caller's buffer must not overlap the other or the
        ``inputs`` (``{name: _Dev}``).  Returns ``(out, lse, out_args)``, out_args being the
        pointers and element strides the merge writes through (0 for a missing lse)."""
        given = {}
        if out is None:
            # allocated here, so its layout is known: no checks (this is every call of a user
            # who lets run() allocate, and the host's time per call is what eager steps pay)
            if qd.kind == "torch" and qd.shape == (rows, Hq, D) and qd.dtype == dtype:
                import torch       # q's twin, C-contiguous (half the time of torch.empty)
                out = torch.empty_like(qd.obj, memory_format=torch.contiguous_format)
            else:
                out = self._alloc_like(qd, (rows, Hq, D), dtype)
            o_ptr, o_sb, o_sh = _data_ptr(out), Hq * D, D
        else:
            od = _Dev(out, "out")
            if od.shape != (rows, Hq, D) or od.dtype != dtype or (D > 1 and od.strides[-1] != 1):
                raise ValueError(f"out must be [{rows}, {Hq}, {D}] {dtype}{note} with a "
                                 f"contiguous last dimension, got {od.shape} {od.dtype} strides "
                                 f"{od.strides}")
            o_ptr, o_sb, o_sh = od.ptr, od.strides[0], od.strides[1]
            given["out"] = _extent(od)
        l_ptr = l_sb = l_sh = 0
        if want_lse:
            if lse is None:
                lse = self._alloc_like(qd, (rows, Hq), "float32")
                l_ptr, l_sb, l_sh = _data_ptr(lse), Hq, 1
            else:
                ld = _Dev(lse, "lse")
                if ld.shape != (rows, Hq) or ld.dtype != "float32":
                    raise ValueError(f"lse must be float32 [{rows}, {Hq}], got {ld.shape} "
                                     f"{ld.dtype}")
                l_ptr, l_sb, l_sh = ld.ptr, ld.strides[0], ld.strides[1]
                given["lse"] = _extent(ld)
        if given:
            refuse_overlap(given, {n: _extent(t) for n, t in inputs.items()})
        return out, lse, (o_ptr, l_ptr, o_sb, o_sh, l_sb, l_sh)

    def _enqueue(self, launches, merge, caller: int) -> None:
        """Forward ``launches`` on the caller's stream, each after the first a programmatic
        dependent of the one before it where the GPU has that (their blocks are placed as soon
        as the previous launch's all are; the chained last block of each waits for the launch
        before it), then the merge (if any), a dependent of the last of them."""
        pdl = self._pdl_ok(launches + ([merge] if merge is not None else []))
        for i, ln in enumerate(launches):
            ln(caller, dependent=pdl and i > 0)
        if merge is not None:
            merge(caller, dependent=pdl and len(launches) > 0)

    # ------------------------------------------------------------------ graph-safe mode
    def static_state(self, layout, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, dtype: str, sm_scale: float,
                     fused: bool = False) -> "StaticState":
        """Device buffers and kernels of graph-safe mode for one fixed launch set (``layout``,
        a :class:`~pat_core.static_plan.StaticLayout`) and problem shape; compiles the launch
        set's kernels now (never during a capture).  ``fused``: every tile of the launch set in
        one pull launch (``pat_fwd_fused_pull_kernel``) instead of one launch per tile."""
        return StaticState(self, layout, num_qo_heads, num_kv_heads, head_dim, page_size,
                           dtype, sm_scale, fused=fused, fixed=True)

    def run_static(self, state: "StaticState", q, k_cache, v_cache, kv_layout: str = "NHD",
                   return_lse: bool = False, out=None, lse=None):
        """Graph-safe run: the fixed launch set of ``state`` over whatever plan was last written
        into it (:meth:`StaticState.write`).  ``q``, ``out`` and ``lse`` may have more rows than
        the live batch (a captured graph's static buffers); rows past it are neither read nor
        written.  Every launch argument depends only on ``state`` and the buffers passed here,
        so the sequence can be captured once and replayed for later plans."""
        qd = _Dev(q, "q")
        with self.cp.cuda.Device(state.device):
            return self._run_state(state, qd, k_cache, v_cache, kv_layout, return_lse, out,
                                   lse, None)

    def _run_state(self, st: "StaticState", qd: _Dev, k_cache, v_cache, kv_layout, return_lse,
                   out, lse, check):
        """The one launch path: the forward launches and merge of ``st`` (current device)."""
        kd = _Dev(k_cache, "k_cache")
        vd = _Dev(v_cache, "v_cache")
        want_lse = bool(return_lse or lse is not None)
        if st.batch is None:
            raise RuntimeError("write a plan (plan()) before run()")
        sig = (kv_layout, qd.sig(), kd.sig(), vd.sig())
        prep = st.prepared.get(sig)
        if prep is None:
            if check is not None:
                check()
            prep = st.prepare(qd, kd, vd, kv_layout)
            if len(st.prepared) >= (1 if st.fixed else 64):   # e.g. one per model layer
                st.prepared.clear()
            st.prepared[sig] = prep
        # the plan now in the state must fit these inputs (checked per plan, not per call)
        if prep["checked"] is not st.plan:
            st.check_inputs(st.plan, prep["rows"], prep["num_pages"])
            prep["checked"] = st.plan
        rows = prep["rows"] if st.fixed else st.batch
        out, lse, out_args = self._outputs(qd, rows, st.num_qo_heads, st.head_dim, st.dtype,
                                           want_lse, out, lse,
                                           {"q": qd, "k_cache": kd, "v_cache": vd},
                                           note=" (q's rows)" if st.fixed else "")
        if st.fixed:
            launches, merge = prep["launches"], prep["merge"]
        else:
            launches, merge = st.live_launches(prep)
        for ln in launches:
            _set_out(ln.params.merge, out_args)
        if merge is not None:
            _set_out(merge.params, out_args)
        self._enqueue(launches, merge, self._caller_stream(qd))
        return (out, lse) if want_lse else out


class StaticState:
    """The device state one plan at a time runs from (see :mod:`pat_core.static_plan`).

    Holds one int32 buffer with every Plan array at a fixed offset, fixed fp32 partial buffers,
    a work counter per launch, and the launch set: one pull-mode forward kernel per tile in
    ``layout.tiles`` (grid = SMs x resident blocks, capped by the item limit), or with ``fused``
    one pull kernel for all of them (each block runs the tile of the item it draws, in the
    largest tile's block), and a merge.  :meth:`write` puts a new plan into the buffer with an
    asynchronous copy on a stream; nothing else changes between plans.

    ``fixed`` (graph-safe mode): every launch of the set runs on every call, over fixed grids,
    with a merge over a fixed grid, so one captured graph serves every later plan.  Otherwise
    (plain plans, :meth:`CudaBackend.state_for`) a call launches only the tiles the written
    plan uses, in the launch set's order, and a merge laid out for the plan, which it skips
    when every request has one partial slot (its forward item wrote the output) and no block
    drew a second item (no work counter to reset).
    """

    _MERGE_BLOCKS_PER_SM = 12      # the merge kernel's launch bounds: 48 warps of 4-warp blocks

    def __init__(self, backend: CudaBackend, layout, num_qo_heads, num_kv_heads, head_dim,
                 page_size, dtype, sm_scale, fused: bool = False, fixed: bool = True):
        cp = backend.cp
        self.backend, self.cp = backend, cp
        self.layout = layout
        self.fixed = bool(fixed)
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size = int(head_dim), int(page_size)
        self.dtype = dtype_name(dtype)
        self.sm_scale = float(sm_scale)
        if self.dtype not in cc.DTYPE_CTYPE:
            raise ValueError(f"the CUDA kernels take float16 or bfloat16, got {self.dtype}")
        for m, n in layout.tiles:
            if not cc.fwd_variant_supported(m, n, self.head_dim):
                raise ValueError(f"no CUDA kernel for tile ({m}, {n}) at head_dim "
                                 f"{self.head_dim}")
        self.device = cp.cuda.runtime.getDevice()
        lim = layout.limits
        V = layout.num_variants
        self.buf = cp.zeros(layout.total, dtype=cp.int32)
        self.counters = cp.zeros(V, dtype=cp.int32)     # zeroed again by every merge
        self.chain = cp.zeros(V, dtype=cp.int32)        # chained launches' block counts
        self.o_part = cp.empty(lim.max_partials * self.num_qo_heads * self.head_dim,
                               dtype=cp.float32)
        self.l_part = cp.empty(lim.max_partials * self.num_qo_heads, dtype=cp.float32)
        self._pinned = cp.cuda.alloc_pinned_memory(layout.total * 4)
        self.staging = np.frombuffer(self._pinned, dtype=np.int32, count=layout.total)
        self.copied = cp.cuda.Event(disable_timing=True)
        self.copied.record()
        self.variants = [cc.FwdVariant.make(m, n, self.head_dim, self.dtype, arch=backend.arch)
                         for m, n in layout.tiles]
        self.merge_variant = cc.MergeVariant(self.head_dim, self.dtype)
        self.fused = bool(fused) and self.fixed
        if self.fused:
            # one kernel holds every tile (warmup compiles it in this process)
            self.launch_variants = [cc.FusedVariant(self.head_dim, self.dtype,
                                                    tuple(self.variants))]
            backend.warmup(variants=self.launch_variants + [self.merge_variant], jobs=1)
        else:
            self.launch_variants = list(self.variants)
            backend.warmup(variants=self.variants + [self.merge_variant],
                           jobs=min(len(self.variants), os.cpu_count() or 1))
        props = cp.cuda.runtime.getDeviceProperties(self.device)
        self.num_sms = int(props["multiProcessorCount"])
        self.per_sm = [backend._blocks_per_sm(v) for v in self.launch_variants]
        # every block that can be resident at once, at most one per item the limits allow
        self.grids = [launch_grid(lim.max_ctas * self.num_kv_heads, b, self.num_sms)
                      for b in self.per_sm]
        self.prepared: dict = {}
        self.batch = None           # live batch of the last plan written
        self.plan = None
        self.plan_version = None
        self.live = None            # [V, 2] first CTA and count per variant of that plan
        self.order = ()             # plain plans: variants with CTAs, in launch-set order
        self.plan_grids = {}        # plain plans: variant -> blocks of its launch
        self.needs_merge = True
        self.merge_key = (False, 1)
        self.max_rows = None        # graph-safe: q rows and KV pages of the inputs the
        self.num_pages = None       # launches were built for (a later plan must fit them)

    def check_plan(self, plan: Plan) -> None:
        """``ValueError`` unless ``plan`` fits this state: its shape and, in graph-safe mode,
        the inputs the launches were built for.  (The layout's limits are checked by
        :meth:`~pat_core.static_plan.StaticLayout.pack`, which every written plan goes through.)"""
        want = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype)
        have = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                dtype_name(plan.kv_dtype))
        names = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "kv_data_type")
        for nm, w, h in zip(names, want, have):
            if w != h:
                raise ValueError(f"graph-safe mode: {nm}={h!r} differs from {w!r} of the first "
                                 "plan (the launches are fixed; create another wrapper)")
        if abs(plan.sm_scale - self.sm_scale) > 1e-12 * abs(self.sm_scale):
            raise ValueError(f"graph-safe mode: sm_scale={plan.sm_scale} differs from "
                             f"{self.sm_scale} of the first plan")
        if self.fixed and self.max_rows is not None:
            self.check_inputs(plan, self.max_rows, self.num_pages)
        if plan.cta_pages.size and int(plan.cta_pages.min()) < 0:
            raise ValueError(f"the plan reads page {int(plan.cta_pages.min())}: page ids must "
                             "be >= 0")

    def check_inputs(self, plan: Plan, rows: int, num_pages: int) -> None:
        """``ValueError`` unless ``plan`` fits inputs of ``rows`` q rows and ``num_pages`` KV
        pages (graph-safe: at least the batch's rows; plain: exactly)."""
        if plan.batch_size > rows or (not self.fixed and plan.batch_size != rows):
            what = "the q buffer the launches were built for has" if self.fixed else "q has"
            raise ValueError(f"the plan has {plan.batch_size} requests but {what} {rows} rows")
        if plan.cta_pages.size and int(plan.cta_pages.max()) >= num_pages:
            raise ValueError(f"the KV cache (paged_kv_cache) holds {num_pages} pages but the "
                             f"plan reads page {int(plan.cta_pages.max())}")

    def write(self, plan: Plan, stream_ptr: int) -> None:
        """Put ``plan`` into the device buffer: pack into pinned memory, then one asynchronous
        host-to-device copy on ``stream_ptr``, ordered after the work already on that stream
        (a run of the previous plan reads the old contents until then)."""
        self.check_plan(plan)
        packed = self.layout.pack(plan)
        cp = self.cp
        with cp.cuda.Device(self.device):
            self.copied.synchronize()      # the previous copy has read the staging memory
            self.staging[:packed.shape[0]] = packed
            cp.cuda.runtime.memcpyAsync(int(self.buf.data.ptr), self.staging.ctypes.data,
                                        packed.shape[0] * 4, cp.cuda.runtime.memcpyHostToDevice,
                                        stream_ptr)
            self.copied.record(_external_stream(cp, stream_ptr, self.device))
        self.batch = plan.batch_size
        self.plan, self.plan_version = plan, plan.version
        off = self.layout.offset["live"]
        self.live = packed[off:off + 2 * self.layout.num_variants].reshape(-1, 2).copy()
        if not self.fixed:
            self._plain_schedule(plan)

    def _plain_schedule(self, plan: Plan) -> None:
        """Plain plans: which launches run (the tiles with CTAs, in the launch set's order,
        tallest tiles first, as graph-safe mode launches them), whether the merge runs and its
        layout."""
        Hk = self.num_kv_heads
        used = [v for v in range(self.layout.num_variants) if self.live[v, 1] > 0]
        self.order = tuple(used)
        # each launch's grid: its resident blocks, at most one per live item (a plain call
        # need not keep the grid fixed, and blocks that find no item still cost a placement);
        # the same rules as the simulator's (pat_core.launch)
        self.plan_grids = {v: launch_grid(int(self.live[v, 1]) * Hk, self.per_sm[v],
                                          self.num_sms) for v in used}
        vidx = {t: i for i, t in enumerate(self.layout.tiles)}
        per_sm_of_tile = [self.per_sm[vidx[(int(m), int(n))]] for m, n in plan.tile_configs]
        self.needs_merge = merge_needed(plan, per_sm_of_tile, self.num_sms)
        self.merge_key = self.backend._merge_layout(plan)

    def prepare(self, qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str) -> dict:
        """Check the inputs and build the launches for them."""
        Hq, Hk, D = self.num_qo_heads, self.num_kv_heads, self.head_dim
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        _check_rows(qd, "q", 3)
        if qd.shape[1:] != (Hq, D):
            raise ValueError(f"q has shape {qd.shape}; the plan needs [batch, {Hq}, {D}]")
        if qd.dtype not in cc.DTYPE_CTYPE:
            raise TypeError(f"q: the CUDA kernels take float16 or bfloat16, got {qd.dtype}")
        if not (qd.dtype == kd.dtype == vd.dtype == self.dtype):
            raise TypeError(f"q ({qd.dtype}) and paged_kv_cache ({kd.dtype}, {vd.dtype}) must be "
                            f"{self.dtype}, the plan's dtype")
        num_pages, axes = _check_cache(qd, kd, vd, kv_layout, self.page_size, Hk, D)
        devs = {t.device for t in (qd, kd, vd) if t.device is not None}
        if devs and devs != {self.device}:
            raise ValueError(f"q and paged_kv_cache live on device(s) {sorted(devs)}, the plan's "
                             f"state on device {self.device}")
        rows = int(qd.shape[0])
        if self.plan is not None:
            self.check_inputs(self.plan, rows, int(num_pages))
        if self.fixed:
            # a captured graph keeps these inputs: later plans must fit them
            self.max_rows, self.num_pages = rows, int(num_pages)
        lay = self.layout
        base_ptr = int(self.buf.data.ptr)
        arrays = {name: base_ptr + 4 * lay.offset[name] for name in lay.offset}
        group = Hq // Hk
        base = _fwd_params(qd, kd, vd, axes, self.o_part, self.l_part, arrays, group, Hq, Hk,
                           self.page_size, self.sm_scale)
        # single-slot requests: the forward item writes the output (out set per call)
        base.merge.req_slot_indptr = arrays["req_slot_indptr"]
        ctr, chain = int(self.counters.data.ptr), int(self.chain.data.ptr)
        launches = []
        be = self.backend
        with self.cp.cuda.Device(self.device):
            for i, v in enumerate(self.launch_variants):
                prm = _copy_params(base)
                # the fused kernel reads the whole live table (one {first, count} per tile)
                prm.live = arrays["live"] + 8 * i
                prm.work_counter = ctr + 4 * i
                prm.chain = chain + 4 * i
                launches.append(_Launch(be._function(v), (self.grids[i], 1, 1),
                                        (v.threads, 1, 1), prm, v.smem_bytes, be.fast_launch))
            prep = {"launches": launches, "merges": {}, "rows": rows,
                    "num_pages": int(num_pages), "checked": self.plan, "arrays": arrays}
            if self.fixed:
                mv = self.merge_variant
                pairs = lay.limits.max_batch_size * Hq
                grid = max(1, min((pairs + mv.warps - 1) // mv.warps,
                                  self.num_sms * self._MERGE_BLOCKS_PER_SM))
                prep["merge"] = self._merge_launch(arrays, mv, grid, False)
        return prep

    def _merge_launch(self, arrays, mv, grid: int, per_block: bool) -> "_Launch":
        be = self.backend
        mp = kp.MergeParams(o_partial=_ptr(self.o_part), lse_partial=_ptr(self.l_part),
                            req_slot_indptr=arrays["req_slot_indptr"],
                            live_batch=arrays["live_batch"], reset=int(self.counters.data.ptr),
                            reset_n=self.layout.num_variants, batch=0,
                            num_qo_heads=self.num_qo_heads, block_per_pair=int(per_block),
                            direct_single=1)
        return _Launch(be._function(mv), (grid, 1, 1), (mv.threads, 1, 1), mp, 0,
                       be.fast_launch)

    def live_launches(self, prep: dict) -> tuple:
        """Plain plans: the written plan's forward launches (in :attr:`order`) and its merge
        (``None`` when it needs none)."""
        launches = [prep["launches"][v] for v in self.order]
        for v, ln in zip(self.order, launches):
            ln.set_grid(self.plan_grids[v])
        if not self.needs_merge:
            return launches, None
        per_block, nh = self.merge_key
        mv = cc.MergeVariant(self.head_dim, self.dtype, cc.MERGE_WARPS, nh)
        pairs = self.batch * self.num_qo_heads
        grid = pairs if per_block else (pairs // nh + mv.warps - 1) // mv.warps
        key = (per_block, nh, grid)
        merge = prep["merges"].get(key)
        if merge is None:
            if len(prep["merges"]) >= 16:
                prep["merges"].clear()
            merge = prep["merges"][key] = self._merge_launch(prep["arrays"], mv, max(1, grid),
                                                             per_block)
        return launches, merge


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


def _fwd_params(qd, kd, vd, axes, o_part, l_part, arrays, group, Hq, Hk, page_size, sm_scale):
    """The forward parameters every launch of a step shares (CTA range and variant left 0).
    ``arrays`` maps each Plan array name to its device address (int) or CuPy array."""
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
        page_size=page_size, scale_log2=float(sm_scale * _LOG2E))
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
    """CuPy object for a stream someone else owns (torch's), across CuPy versions."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(_StreamHandle(handle))
        except Exception:
            pass
    return cp.cuda.ExternalStream(handle, device)


class _StreamHandle:
    """Minimal CUDA stream protocol object (``__cuda_stream__``) for Stream.from_external."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _extent(t: _Dev) -> tuple:
    """Byte range of a device array (:func:`pat_core.inputs.byte_extent`)."""
    return byte_extent(t.ptr, t.shape, t.strides, _ITEMSIZE.get(t.dtype, 8))


def _check_plan_tiles(plan: Plan) -> None:
    """Every launch group's tile has a kernel and every CTA's rows fit its tile's m."""
    for _, (m, n), b, e in plan.groups():
        if e > b and not cc.fwd_variant_supported(m, n, plan.head_dim):
            raise ValueError(f"plan: no CUDA kernel for tile (m={m}, n={n}) at head_dim "
                             f"{plan.head_dim}")
    if plan.num_ctas:
        rows = plan.cta_rows()
        m = plan.tile_configs[plan.cta_tile][:, 0]
        if np.any(rows > m):
            c = int(np.argmax(rows > m))
            raise ValueError(f"plan: CTA {c} has {int(rows[c])} query rows but its tile has "
                             f"m={int(m[c])}")


def _variant_from(v):
    if isinstance(v, (cc.FwdVariant, cc.MergeVariant, cc.FusedVariant)):
        return v
    if isinstance(v, str):
        for cand in cc.all_fwd_variants() + cc.all_merge_variants():
            if cand.key == v:
                return cand
        raise ValueError(f"variants: unknown kernel variant {v!r}")
    raise TypeError(f"variants: expected FwdVariant, MergeVariant, FusedVariant "
                    f"or key, got {type(v).__name__}")


def _sm90a_cubin_path(variant, opts) -> str:
    """Where the sm_90a cubin of ``variant`` built with ``opts`` is kept: CuPy's kernel cache
    folder (``CUPY_CACHE_DIR``), named by the variant, the options and the source hash (part of
    the options), so worker processes and later runs reuse it."""
    import hashlib
    root = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                             "kernel_cache")
    tag = hashlib.sha1("\0".join(opts).encode()).hexdigest()[:16]
    return os.path.join(root, f"pat_sm90a_{variant.key}_{tag}.cubin")


def _raw_module(cp, variant):
    """``(RawModule, function name)`` of one variant.

    Every variant but the warpgroup ones goes through CuPy's RawModule (NVRTC for the device's
    own architecture, CuPy's on-disk cache).  The warpgroup (wgmma) variants need the sm_90a
    target, which RawModule cannot be asked for (it adds ``-arch`` for the device itself):
    they are compiled here with NVRTC for sm_90a, the cubin kept next to CuPy's cache
    (:func:`_sm90a_cubin_path`) and the module loaded from it.
    """
    if not getattr(variant, "warpgroup", False):
        mod = cp.RawModule(code=cc.module_source(variant), options=cc.nvrtc_options(),
                           name_expressions=[variant.name_expression])
        return mod, variant.name_expression
    from cupy_backends.cuda.libs import nvrtc
    opts = cc.nvrtc_options() + ("-arch=sm_90a", "--device-as-default-execution-space")
    cuda_path = cp.cuda.get_cuda_path()
    if cuda_path and os.path.isdir(os.path.join(cuda_path, "include")):
        opts += (f"-I{os.path.join(cuda_path, 'include')}",)
    path = _sm90a_cubin_path(variant, opts)
    if os.path.exists(path) and os.path.exists(path + ".name"):
        with open(path + ".name") as fh:
            return cp.RawModule(path=path), fh.read()
    prog = nvrtc.createProgram(cc.module_source(variant), variant.key + ".cu", (), ())
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {variant.key} (sm_90a):\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        name = nvrtc.getLoweredName(prog, variant.name_expression)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # write then rename: a concurrent reader never sees half a file
    for dst, data in ((path, cubin), (path + ".name", name.encode())):
        tmp = f"{dst}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, dst)
    return cp.RawModule(path=path), name


def _compile_one(fields) -> str:
    """Worker-process body: compile one variant into CuPy's on-disk cache."""
    kind, args = fields
    import cupy
    v = {"fwd": cc.FwdVariant, "merge": cc.MergeVariant}[kind](*args)
    mod, name = _raw_module(cupy, v)
    mod.get_function(name)
    return v.key


def _compile_in_workers(variants, jobs: int) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    def fields_of(v):
        if isinstance(v, cc.FwdVariant):
            return "fwd", (v.head_dim, v.dtype, v.m, v.n, v.warps, v.stages, v.rows_per_warp)
        return "merge", (v.head_dim, v.dtype, v.warps, v.heads)
    fields = [fields_of(v) for v in variants]
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(fields)), mp_context=ctx) as ex:
        for key in ex.map(_compile_one, fields):
            log.debug("compiled %s in a worker", key)


__all__ = ["CudaBackend", "StaticState", "is_available"]
