"""CUDA backend: run a :class:`~pat_core.plan.Plan` with the hand-written kernels in ``cuda_src/``.

The kernels are C++ templates compiled at run time by NVRTC through CuPy (``RawModule`` with
name expressions), one module per variant; see :mod:`pat_core.cuda_compile` for the variant
rules and names.  Inputs may be torch CUDA tensors or CuPy arrays (zero copy: the kernels get
their device pointers and element strides); outputs are returned as the same kind as ``q``.

Execution of one batch, by default on a Hopper or later GPU (``fwd_chain`` "pdl")::

    caller stream ── forward launch (longest CTAs) ─▶ forward launch ─▶ ... ─▶ merge ── out [, lse]

each arrow a programmatic dependent launch: the next launch's blocks are placed as soon as every
block of the one before it is, and each launch's last block waits for the launch before it
before it exits, so the merge (which waits for the last) finds every forward launch finished
(:mod:`pat_core.launch`).  Before sm_90, and with ``fwd_chain`` "fork" (an ablation)::

    caller stream ── fork event ──┬─ (caller stream itself): forward launch of tile group 0 ─┐
                                  ├─ pool stream 0: forward launch of tile group 1 ──────────┤
                                  └─ ...                                  join events ───────┘
    caller stream ── (waits on the joins) ── merge kernel ── out [, lse]

With ``plan.serial`` (or a single group) every launch goes on the caller's stream in order.
On a Hopper or later GPU the merge after forward launches on the caller's stream is a
programmatic dependent launch (``merge_launch`` "pdl"): its blocks start while the forward runs
and wait for it (``griddepcontrol``).  A plan with a finisher phase (:mod:`pat_core.fold`) has
no merge: the picture above twice, the first phase's launches, then the finishers'; where each
phase is one launch, the finishers' launch is a programmatic dependent of the first phase's, so
its blocks start at once and wait only before they fold the first phase's slots in.  With
``finish_launch`` "ordered" (an ablation) a plan whose two phases are one tile group each, of
one tile, is one launch whose blocks pull the first phase's items first, the finishers waiting
on per-request counts.
With ``launch_mode`` "fused" (or "auto" on a small multi-group plan) every forward CTA goes into
one launch of ``pat_fwd_fused_kernel`` on the caller's stream, each block running its CTA's
tile variant, then the merge.  The
pool of streams and events is created once per backend.  Everything is enqueued on the caller's
current stream (``torch.cuda.current_stream()`` for torch inputs, CuPy's current stream for CuPy
inputs) or ordered after it through events; nothing uses the legacy default stream unless that is
the caller's current stream.  The sequence is stream-ordered and allocation-free once the
partial buffers exist, so it can be captured in a CUDA graph (``torch.cuda.graph``) and
replayed for that plan.

Graph-safe mode (:class:`StaticState`, :meth:`CudaBackend.run_static`; the wrapper's
``use_cuda_graph=True``) keeps one graph valid across plans: the plan lives in a fixed device
buffer (:mod:`pat_core.static_plan`) and the launch set is fixed, one pull-mode forward launch
per reachable tile plus the merge, so every launch argument is the same from step to step.
Every kernel takes one parameter struct (:mod:`pat_core.kernel_params`).

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
import weakref

import numpy as np

from . import cuda_compile as cc
from . import kernel_params as kp
from .gpus import detect_gpu_name
from .launch import (FUSED_MAX_BLOCKS_PER_SM, FUSED_MAX_KV_LEN, FWD_CHAIN_MODES, chain_order,
                     default_fwd_chain, finisher_chain, merge_block_per_pair,
                     merge_heads_per_warp, one_tile_split, use_fused_launch)
from .plan import Plan, dtype_name

log = logging.getLogger("pat_core.cuda")

_LOG2E = 1.4426950408889634
_NUM_STREAMS = 16   # >= the graph-safe launch set (12 tiles), so its launches never queue
_UPLOAD_FIELDS = ("cta_req_indptr", "cta_req", "cta_slot", "cta_kv_start", "cta_kv_len",
                  "cta_page_indptr", "cta_pages", "req_slot_indptr")


def smem_carveout():
    """The shared-memory carveout (percent, 0-100) every kernel asks for, from
    ``PAT_SMEM_CARVEOUT``; ``None`` (unset or empty): the driver's default.  Read when a kernel
    is first loaded in the process."""
    text = os.environ.get("PAT_SMEM_CARVEOUT", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 100:
        raise ValueError(f"PAT_SMEM_CARVEOUT must be an integer percentage 0-100, got {text!r}")
    return value


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

    Not thread-safe across concurrent ``run`` calls of one instance (the partial buffers are
    reused); use one backend per thread/stream for concurrent batches.  Compiled kernels are
    shared by every instance of the process.
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
        self._uploads: dict = {}      # id(plan) -> record
        self._pools: dict = {}        # device -> (streams, fork event, join events)
        self._sm_counts: dict = {}    # device -> SM count
        # blocks of one CTA's KV heads adjacent in launch order (see cuda_src/pat_fwd.cuh)
        self.head_minor = True
        # launch through cuLaunchKernel with pre-packed arguments (False: CuPy's generic call)
        self.fast_launch = True
        # "streams": one launch per tile group, groups on pool streams; "fused": every forward
        # CTA in one launch (per-CTA variant index); "auto": fused when the plan has several
        # groups and few blocks (launch latency dominates), else streams.  See _use_fused.
        self.launch_mode = os.environ.get("PAT_LAUNCH_MODE", "auto")
        # merge kernel: "block" (one block per (request, head) pair, its warps splitting the
        # slots), "warp" (one warp per pair) or "auto" (pat_core.launch.merge_block_per_pair)
        self.merge_per_pair = "auto"
        # warp mode: heads of a request per merge warp, 1, 2 or 4 (None: by
        # pat_core.launch.merge_heads_per_warp)
        self.merge_heads_per_warp = None
        self.fused_max_blocks_per_sm = FUSED_MAX_BLOCKS_PER_SM
        # one-tile CTAs of 16-row groups: "off" (the default: in their group's launch),
        # "split" (a launch of their own in the one-tile layout) or "piped" (the piped kernel),
        # both measured slower and kept as ablations, "piped-all" (a test mode)
        # (pat_core.launch.one_tile_split); env PAT_ONE_TILE
        self.one_tile = os.environ.get("PAT_ONE_TILE", "off")
        self.fused_max_kv_len = FUSED_MAX_KV_LEN
        # "kernel" (default): the separate merge kernel; "forward" (measured slower, kept as an
        # ablation): the forward CTA that writes a request's last partial slot merges it (a
        # per-(request, KV head) counter) and the merge launch disappears
        self.merge_mode = os.environ.get("PAT_MERGE_MODE", "kernel")
        # finisher-phase plans (pat_core.fold): "pdl" (default) launches a one-launch finisher
        # phase as a programmatic dependent of a one-launch first phase where the GPU has it
        # (sm_90+), so the finishers' KV walks overlap the first phase; "ordered" (measured
        # slower, an ablation) runs a plan whose two phases are one tile group each, of one
        # tile, as one launch in which the finishers' items are drawn after the first phase's
        # and wait on counters before they fold, else as "pdl"; otherwise, and with "serial",
        # the finishers start once the first phase has finished; env PAT_FINISH_LAUNCH
        self.finish_launch = os.environ.get("PAT_FINISH_LAUNCH", "pdl")
        # the merge kernel after forward launches that all went on the caller's stream: "pdl"
        # (default) launches it as a programmatic dependent of the last of them (sm_90+; its
        # blocks start while the forward runs and wait for it), "serial" once it has finished
        # (bench/NOTES.md, round 15); env PAT_MERGE_LAUNCH
        self.merge_launch = os.environ.get("PAT_MERGE_LAUNCH", "pdl")
        # a plan's forward launches (several tile groups, no finisher phase): "pdl" (default)
        # puts them on the caller's stream, the longest first, each a programmatic dependent of
        # the one before it (sm_90+; chain_exit in cuda_src/pat_common.cuh), "pdl-plan" the same
        # in the plan's group order, "fork" (an ablation) concurrently on pool streams forked
        # from the caller's stream and joined before the merge (pat_core.launch); env
        # PAT_FWD_CHAIN
        self.fwd_chain = default_fwd_chain()
        self._counter_bufs: dict = {}  # device -> int32 counters, zero between runs
        self._counter_gens: dict = {}  # device -> times its counters were replaced
        # graph-safe mode: at most this many blocks per SM in each pull launch (None: as many
        # as can be resident); an ablation knob, env PAT_GRAPH_BLOCKS_PER_SM
        env_cap = os.environ.get("PAT_GRAPH_BLOCKS_PER_SM", "")
        self.graph_blocks_per_sm = int(env_cap) if env_cap.strip() else None
        # graph-safe mode: every launch on the caller's stream in order instead of forked onto
        # pool streams (an ablation knob for the cost of the fork/join, bench/graph_safe_cost.py)
        self.static_serial = False
        # graph-safe mode: every tile of the launch set in one fused pull launch ("on"), one
        # launch per tile ("off"), or by the bucket size ("auto", static_plan.graph_safe_fused);
        # env PAT_GRAPH_FUSED; read when a wrapper makes its graph-safe state
        self.graph_fused = os.environ.get("PAT_GRAPH_FUSED", "auto")
        self._buffers: dict = {}      # device -> (num_floats, o_partial memptr, lse memptr)

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
            carveout = smem_carveout()
            if carveout is not None:
                # the share of the SM's L1/shared memory kept as shared memory, in percent
                fn.preferred_shared_memory_carveout = carveout
            self._modules[key] = mod
            self._functions[key] = fn
            return fn

    def variants_for(self, plan: Plan, dtype: str | None = None) -> list:
        """Forward variants plus the merge variant a Plan needs (for `dtype`, default the plan's)."""
        dtype = dtype_name(dtype or plan.kv_dtype)
        fwd = [cc.FwdVariant.make(v.m, v.n, v.head_dim, dtype, arch=self.arch)
               for v in cc.plan_fwd_variants(plan, self.arch)]
        num_sms = self._num_sms()
        for g, (m, n), b, e in plan.groups():
            if 0 <= plan.finish_from <= g:   # a finisher group: its own kernel, never split
                v = cc.FwdVariant.make(m, n, plan.head_dim, dtype, arch=self.arch, finish=True)
                if v not in fwd:
                    fwd.append(v)
                continue
            s, kind, _ = one_tile_split(plan, b, e, num_sms, self.one_tile)
            if s < e:
                v = (cc.PipedVariant.make(n, plan.head_dim, dtype) if kind == "piped" else
                     cc.FwdVariant.make(m, n, plan.head_dim, dtype, arch=self.arch,
                                        one_tile=True))
                if v not in fwd:
                    fwd.append(v)
        nh = self._merge_layout(plan)[1]
        return fwd + [cc.MergeVariant(plan.head_dim, dtype, cc.MERGE_WARPS, nh)]

    def warmup(self, plan: Plan | None = None, variants=None, jobs: int | None = None) -> list:
        """Compile the variants `plan` needs, or those listed (FwdVariant, PipedVariant,
        MergeVariant or FusedVariant objects, or the keys of the first three), or every
        one-item-per-block variant and the merges when both are None.  Logs one line per
        compile (the key).

        ``jobs > 1`` first compiles the missing variants in that many worker processes, which
        fill CuPy's on-disk kernel cache; this process then loads the cached binaries.  Fused
        variants (one translation unit holding several tiles) always compile in this process.
        Returns the variant keys now ready.
        """
        if variants is None:
            if plan is not None:
                variants = self.variants_for(plan)
            else:   # graph-safe (pull) kernels compile when a graph-safe wrapper needs them
                variants = [v for v in cc.all_fwd_variants(pulls=(False,))
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

    # ------------------------------------------------------------------ plan upload
    def upload(self, plan: Plan) -> None:
        """Copy the Plan's int32 arrays to the current device once (kept per plan and version).

        A plan already on this device at this version is not copied again (the planner hands
        back the same object for an identical batch).  Otherwise the device is synchronised
        first, so no kernel of an earlier step still reads memory that the allocator may hand
        out again, and the copies are complete before this returns, whatever stream the
        kernels later run on.
        """
        cp = self.cp
        dev = cp.cuda.runtime.getDevice()
        old = self._uploads.get(id(plan))
        if old is not None and old["version"] == plan.version and old["device"] == dev:
            return
        _check_plan_tiles(plan)
        cp.cuda.Device(dev).synchronize()
        rec = {"version": plan.version, "device": dev, "prepared": {}, "layouts": {},
               "max_page": int(plan.cta_pages.max()) if plan.cta_pages.size else -1,
               "min_page": int(plan.cta_pages.min()) if plan.cta_pages.size else 0}
        for name in _UPLOAD_FIELDS:
            arr = np.ascontiguousarray(getattr(plan, name), dtype=np.int32)
            rec[name] = cp.asarray(arr) if arr.size else cp.zeros(1, dtype=cp.int32)
        cp.cuda.get_current_stream().synchronize()
        pid = id(plan)
        first = pid not in self._uploads
        self._uploads[pid] = rec
        if first:
            weakref.finalize(plan, self._uploads.pop, pid, None)

    def _device_plan(self, plan: Plan) -> dict:
        rec = self._uploads.get(id(plan))
        dev = self.cp.cuda.runtime.getDevice()
        if rec is None or rec["version"] != plan.version or rec["device"] != dev:
            self.upload(plan)
            rec = self._uploads[id(plan)]
        return rec

    # ------------------------------------------------------------------ buffers, streams
    def _partials(self, num_slots: int, num_qo_heads: int, head_dim: int):
        """fp32 partial buffers (grow-only, per device); returns (o_partial, lse_partial)."""
        cp = self.cp
        dev = cp.cuda.runtime.getDevice()
        need_o = max(1, num_slots * num_qo_heads * head_dim)
        need_l = max(1, num_slots * num_qo_heads)
        cur = self._buffers.get(dev)
        if cur is None or cur[0] < need_o or cur[1] < need_l:
            if cur is not None:
                # an earlier batch may still be reading the old buffers on some stream
                cp.cuda.Device(dev).synchronize()
            grow_o = max(need_o, int(cur[0] * 1.25) if cur else 0)
            grow_l = max(need_l, int(cur[1] * 1.25) if cur else 0)
            gen = (cur[4] + 1) if cur else 0
            cur = (grow_o, grow_l, cp.empty(grow_o, dtype=cp.float32),
                   cp.empty(grow_l, dtype=cp.float32), gen)
            self._buffers[dev] = cur
        return cur[2], cur[3]

    def _buffer_generation(self, dev) -> tuple:
        """Generation of the device's shared buffers (partials, merge counters): prepared
        launches hold their addresses, so they are rebuilt when either grows."""
        cur = self._buffers.get(dev)
        return (cur[4] if cur else -1, self._counter_gens.get(dev, 0))

    def _pool(self):
        cp = self.cp
        dev = cp.cuda.runtime.getDevice()
        pool = self._pools.get(dev)
        if pool is None:
            streams = [cp.cuda.Stream(non_blocking=True) for _ in range(_NUM_STREAMS)]
            fork = cp.cuda.Event(disable_timing=True)
            joins = [cp.cuda.Event(disable_timing=True) for _ in range(_NUM_STREAMS)]
            pool = (streams, fork, joins)
            self._pools[dev] = pool
        return pool

    def _caller_stream(self, q: _Dev) -> int:
        """The caller's current stream handle: torch's current stream on q's device for torch
        inputs, CuPy's current stream otherwise."""
        if q.kind == "torch":
            return _torch_stream_handle(q.device)
        return self.cp.cuda.get_current_stream().ptr

    # ------------------------------------------------------------------ run
    def run(self, plan: Plan, q, k_cache, v_cache, kv_layout: str = "NHD",
            return_lse: bool = False, out=None, lse=None, check=None):
        """Forward + merge for one batch.

        Parameters
        ----------
        plan : the batch's :class:`~pat_core.plan.Plan`.
        q : ``[batch, num_qo_heads, head_dim]`` float16/bfloat16, torch CUDA tensor or CuPy
            array (any strides with a contiguous last dimension and 16-byte aligned rows).
        k_cache, v_cache : ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), q's dtype; strided views
            are fine when head_dim is contiguous.
        out : optional output ``[batch, num_qo_heads, head_dim]`` in q's dtype (written in place).
        lse : optional float32 ``[batch, num_qo_heads]`` (implies return_lse).

        check : optional callable run (before this method's own checks) whenever the inputs
            are validated, i.e. not on calls that reuse cached launch arguments: the wrapper's
            checks against the plan's fixed dtypes, paid once per input set like these.

        Returns ``out`` (same kind as q), and ``lse`` fp32 natural log when ``return_lse``.

        The validated launch arguments are cached per (plan, input pointers, shapes, strides and
        dtypes), so a decode loop that reuses its buffers pays for the checks once.
        """
        qd = _Dev(q, "q")
        kd = _Dev(k_cache, "k_cache")
        vd = _Dev(v_cache, "v_cache")
        want_lse = bool(return_lse or lse is not None)
        rec = self._uploads.get(id(plan))
        sig = (kv_layout, qd.sig(), kd.sig(), vd.sig(), self.launch_mode,
               self.fused_max_blocks_per_sm, self.fused_max_kv_len, self.merge_mode,
               self.merge_per_pair, self.merge_heads_per_warp, self.finish_launch,
               self.one_tile, self.head_minor, self.fast_launch)
        prep = None
        if rec is not None and rec["version"] == plan.version:
            prep = rec["prepared"].get(sig)
            if prep is not None and prep["buf_gen"] != self._buffer_generation(prep["device"]):
                prep = None
        if prep is None:
            if check is not None:
                check()
            prep = self._prepare(plan, qd, kd, vd, kv_layout)
            rec = self._uploads[id(plan)]
            if len(rec["prepared"]) >= 64:     # e.g. one input set per model layer
                rec["prepared"].clear()
            rec["prepared"][sig] = prep
        cp = self.cp
        if cp.cuda.runtime.getDevice() != prep["device"]:
            with cp.cuda.Device(prep["device"]):
                return self._execute(plan, prep, qd, want_lse, out, lse)
        return self._execute(plan, prep, qd, want_lse, out, lse)

    def _prepare(self, plan: Plan, qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str) -> dict:
        """Validate the inputs against the plan and build every launch's argument tuple."""
        cp = self.cp
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        B, Hq, Hk, D = plan.batch_size, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
        _check_rows(qd, "q", 3)
        if qd.shape != (B, Hq, D):
            raise ValueError(f"q has shape {qd.shape}, the plan expects {(B, Hq, D)}")
        if qd.dtype not in cc.DTYPE_CTYPE:
            raise TypeError(f"q: the CUDA kernels take float16 or bfloat16, got {qd.dtype}")
        if not (qd.dtype == kd.dtype == vd.dtype):
            raise TypeError(f"q ({qd.dtype}) and paged_kv_cache ({kd.dtype}, {vd.dtype}) must "
                            "share a dtype")
        num_pages, axes = _check_cache(qd, kd, vd, kv_layout, plan.page_size, Hk, D)
        devs = {t.device for t in (qd, kd, vd) if t.device is not None}
        if len(devs) > 1:
            raise ValueError(f"q and paged_kv_cache live on different devices {sorted(devs)}")
        dev = devs.pop() if devs else cp.cuda.runtime.getDevice()
        with cp.cuda.Device(dev):
            rec = self._device_plan(plan)
            if rec["max_page"] >= num_pages:
                raise ValueError(f"paged_kv_cache holds {num_pages} pages but the plan reads "
                                 f"page {rec['max_page']}")
            if rec["min_page"] < 0:
                raise ValueError(f"the plan reads page {rec['min_page']}: page ids must be >= 0")
            dtype = qd.dtype
            key = (dtype, self.launch_mode, self.fused_max_blocks_per_sm, self.fused_max_kv_len,
                   self.merge_mode, self.merge_per_pair, self.merge_heads_per_warp,
                   self.finish_launch, self.one_tile, self.head_minor, self.fast_launch,
                   self.fwd_chain)
            lay = rec["layouts"].get(key)
            if lay is None or lay["buf_gen"] != self._buffer_generation(dev):
                if len(rec["layouts"]) >= 8:
                    rec["layouts"].clear()
                lay = rec["layouts"][key] = self._launch_set(plan, rec, dtype)
            # the launch set with this input set's addresses and strides (the only fields of
            # the forward parameters that depend on q and the caches)
            fields = _input_fields(qd, kd, vd, axes)
            launches = [ln.with_inputs(fields) for ln in lay["launches"]]
            return {"device": dev, "dtype": dtype, "launches": launches, "merge": lay["merge"],
                    "phase_b": lay["phase_b"], "chain": lay["chain"],
                    "buf_gen": lay["buf_gen"]}

    def _launch_set(self, plan: Plan, rec: dict, dtype: str) -> dict:
        """Every launch of ``plan`` in ``dtype`` under the current settings, on the current
        device, with the forward parameters' input fields (q, caches) left 0: what all input
        sets of one plan share (kernels, grids, parameter templates, work counters).
        Returns ``{"launches", "merge" (None when the forward writes the output), "phase_b"
        (index of the finisher phase's first launch or None), "buf_gen"}``."""
        cp = self.cp
        B, Hq, Hk, D = plan.batch_size, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
        o_part, l_part = self._partials(plan.num_slots, Hq, D)
        base = _fwd_params(None, None, None, None, o_part, l_part, rec,
                           plan.group_size, Hq, Hk, plan.page_size, plan.sm_scale,
                           self.head_minor)
        if self.merge_mode not in ("forward", "kernel"):
            raise ValueError(f"merge_mode must be 'forward' or 'kernel', got "
                             f"{self.merge_mode!r}")
        # a plan with a finisher phase has no merge: its finishers write the output
        fold = plan.finish_from >= 0
        in_fwd = self.merge_mode == "forward" and not fold
        if fold:
            base.merge.req_slot_indptr = _ptr(rec["req_slot_indptr"])
        if in_fwd:   # out / lse pointers and strides are filled in per call
            base.merge.counters = _ptr(self._counters(plan.batch_size * Hk))
            base.merge.req_slot_indptr = _ptr(rec["req_slot_indptr"])
        launches = []
        spans = []   # per forward launch: (longest CTA's KV tokens, tile rows), for the chain
        kv_len = plan.cta_kv_len
        members = [cc.FwdVariant.make(m, n, D, dtype, arch=self.arch)
                   for _, (m, n), b, e in plan.groups()
                   if e > b]
        if self._use_fused(plan, members):
            fv = cc.FusedVariant(D, dtype, tuple(dict.fromkeys(members)))
            pos = {(v.m, v.n): i for i, v in enumerate(fv.members)}
            idx = np.array([pos[(int(m), int(n))] for m, n in plan.tile_configs],
                           dtype=np.int32)[plan.cta_tile]
            cta_variant = cp.asarray(np.ascontiguousarray(idx, dtype=np.int32))
            prm = _copy_params(base)
            prm.cta_variant = _ptr(cta_variant)
            prm.cta_offset, prm.n_ctas = 0, plan.num_ctas
            launches.append(_Launch(self._function(fv), (plan.num_ctas * Hk, 1, 1),
                                    (fv.threads, 1, 1), prm, fv.smem_bytes,
                                    self.fast_launch, keep=cta_variant))
            spans.append((int(kv_len.max()), 0))
            members = []
        num_sms = self._num_sms()
        if fold and self._finish_ordered(plan, num_sms):
            # both phases in one ordered launch of the finisher kernel: blocks pull items in
            # order, the first phase's first; finishers wait on the per-(request, KV head)
            # counts of the slots written (cuda_src/pat_fwd.cuh)
            (_, (m, n), b, _), (_, _, _, e) = [x for x in plan.groups() if x[3] > x[2]]
            v = cc.FwdVariant.make(m, n, D, dtype, pull=True, arch=self.arch, finish=True)
            # items drawn, blocks finished: zero between runs (the last block resets them)
            ctr = cp.zeros(2, dtype=cp.int32)
            prm = _copy_params(base)
            prm.cta_offset, prm.n_ctas, prm.finish_cta = b, e - b, plan.finish_cta
            prm.work_counter = _ptr(ctr)
            prm.merge.counters = _ptr(self._counters(plan.batch_size * Hk))
            grid = min((e - b) * Hk, self._blocks_per_sm(v) * num_sms)
            launches.append(_Launch(self._function(v), (grid, 1, 1), (v.threads, 1, 1), prm,
                                    v.smem_bytes, self.fast_launch, keep=ctr))
            spans.append((int(kv_len[b:e].max()), m))
            members = []
        phase_b = None   # first launch of the finisher phase
        for g, (m, n), b, e in (plan.groups() if members else ()):
            if e <= b:
                continue
            finish = fold and g >= plan.finish_from
            if finish and phase_b is None:
                phase_b = len(launches)
            # the group's one-tile tail may get a launch of its own (launch.one_tile_split;
            # not a finisher group: those layouts have no finisher path)
            s, kind, grid = (e, None, 0) if finish else \
                one_tile_split(plan, b, e, num_sms, self.one_tile)
            if s > b:
                v = cc.FwdVariant.make(m, n, D, dtype, arch=self.arch, finish=finish)
                prm = _copy_params(base)
                prm.cta_offset, prm.n_ctas = b, s - b
                launches.append(_Launch(self._function(v), ((s - b) * Hk, 1, 1),
                                        (v.threads, 1, 1), prm, v.smem_bytes,
                                        self.fast_launch))
                spans.append((int(kv_len[b:s].max()), m))
            if s < e:
                prm = _copy_params(base)
                prm.cta_offset, prm.n_ctas = s, e - s
                ctr = None
                if kind == "piped":
                    v = cc.PipedVariant.make(n, D, dtype)
                    # two int32 work counters of this launch, zero between runs (the
                    # kernel's last block resets them)
                    ctr = cp.zeros(2, dtype=cp.int32)
                    prm.work_counter = _ptr(ctr)
                else:
                    v = cc.FwdVariant.make(m, n, D, dtype, arch=self.arch, one_tile=True)
                launches.append(_Launch(self._function(v), (grid, 1, 1), (v.threads, 1, 1),
                                        prm, v.smem_bytes, self.fast_launch, keep=ctr))
                spans.append((int(kv_len[s:e].max()), m))
        if phase_b is None:
            chain = not plan.serial and self._chain_mode(launches)
            if chain:
                launches = self._chain(launches, spans, self.fwd_chain == "pdl")
        else:
            # a finisher phase behind a chained first phase (launch.finisher_chain): the first
            # phase's launches chained as above, the finisher launches after them in plan order
            chain = (self.finish_launch != "serial" and not self._finish_ordered(plan, num_sms)
                     and finisher_chain(plan, plan.gpu, self.fwd_chain)
                     and self._pdl_ok(launches))
            if chain:
                first = launches[:phase_b]
                if len(first) > 1:
                    first = self._chain(first, spans[:phase_b], self.fwd_chain == "pdl")
                launches = first + launches[phase_b:]
        B = plan.batch_size
        per_block, nh = self._merge_layout(plan)
        mv = cc.MergeVariant(D, dtype, cc.MERGE_WARPS, nh)
        mp = kp.MergeParams(o_partial=_ptr(o_part), lse_partial=_ptr(l_part),
                            req_slot_indptr=_ptr(rec["req_slot_indptr"]), batch=B,
                            num_qo_heads=Hq, block_per_pair=int(per_block))
        units = B * Hq // nh
        grid = B * Hq if per_block else (units + mv.warps - 1) // mv.warps
        merge = _Launch(self._function(mv), (grid, 1, 1), (mv.threads, 1, 1), mp, 0,
                        self.fast_launch)
        return {"launches": launches, "merge": None if in_fwd or fold else merge,
                "phase_b": phase_b, "chain": chain,
                "buf_gen": self._buffer_generation(cp.cuda.runtime.getDevice())}

    def _chain_mode(self, launches) -> bool:
        """Whether ``launches`` (a plan's forward launches, no finisher phase) go as one chain
        of programmatic dependent launches on the caller's stream (``fwd_chain`` "pdl" or
        "pdl-plan"): two or more of them, on an sm_90 or later device, all on the fast path."""
        if self.fwd_chain not in FWD_CHAIN_MODES:
            raise ValueError(f"fwd_chain must be one of {FWD_CHAIN_MODES}, got "
                             f"{self.fwd_chain!r}")
        return self.fwd_chain != "fork" and len(launches) > 1 and self._pdl_ok(launches)

    def _chain(self, launches, spans, longest_first: bool) -> list:
        """``launches`` as a chain: each gets a zeroed block counter (its ``chain`` field; the
        kernel's last block waits for the launch before it, see ``chain_exit`` in
        cuda_src/pat_common.cuh), in order of their longest CTA, longest first (ties: larger
        tiles first; :func:`pat_core.launch.chain_order`) with ``longest_first``, else in the
        given order."""
        if longest_first:
            launches = [launches[i] for i in chain_order(spans)]
        ctr = self.cp.zeros(len(launches), dtype=self.cp.int32)
        for i, ln in enumerate(launches):
            ln.params.chain = _ptr(ctr) + 4 * i
            ln.keep = (ln.keep, ctr)
        return launches

    def _merge_layout(self, plan: Plan) -> tuple:
        """``(block_per_pair, heads_per_warp)`` of the merge launch for ``plan``: the
        ``merge_per_pair`` and ``merge_heads_per_warp`` settings, or the launch policy's
        choice (:mod:`pat_core.launch`) where they are automatic."""
        if self.merge_per_pair not in ("auto", "block", "warp"):
            raise ValueError(f"merge_per_pair must be 'auto', 'block' or 'warp', got "
                             f"{self.merge_per_pair!r}")
        per_block = (merge_block_per_pair(plan, self._num_sms())
                     if self.merge_per_pair == "auto" else self.merge_per_pair == "block")
        if per_block:
            return True, 1
        nh = self.merge_heads_per_warp or merge_heads_per_warp(plan, self._num_sms())
        if nh not in cc.MERGE_HEADS or plan.num_qo_heads % nh:
            raise ValueError(f"merge_heads_per_warp must be one of {cc.MERGE_HEADS} and divide "
                             f"num_qo_heads={plan.num_qo_heads}, got {nh!r}")
        return False, int(nh)

    def _counters(self, n: int):
        """int32 counters of the in-kernel merge, ``n`` at least; zero between runs (the CTA
        that completes a request resets its counter), grow-only per device."""
        cp = self.cp
        dev = cp.cuda.runtime.getDevice()
        cur = self._counter_bufs.get(dev)
        if cur is None or cur.size < n:
            if cur is not None:
                cp.cuda.Device(dev).synchronize()   # a run in flight may still count in it
                # launches prepared with the old address must be rebuilt (_buffer_generation)
                self._counter_gens[dev] = self._counter_gens.get(dev, 0) + 1
            cur = cp.zeros(max(n, int(cur.size * 1.25) if cur is not None else 0), dtype=cp.int32)
            self._counter_bufs[dev] = cur
        return cur

    def _use_fused(self, plan: Plan, members) -> bool:
        """Whether to run every forward CTA in one launch: :func:`pat_core.launch.use_fused_launch`
        under ``launch_mode``, ``fused_max_blocks_per_sm`` and ``fused_max_kv_len``."""
        if not members:
            return False
        return use_fused_launch(plan, self._num_sms(), self.launch_mode,
                                self.fused_max_blocks_per_sm, self.fused_max_kv_len)

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

    def _execute(self, plan, prep, qd, want_lse, out, lse):
        B = plan.batch_size
        out, lse, out_args = self._outputs(qd, B, plan.num_qo_heads, plan.head_dim,
                                           prep["dtype"], want_lse, out, lse)
        launches = prep["launches"]
        if B == 0 or not launches:
            return (out, lse) if want_lse else out

        merge = prep["merge"]
        if merge is None:   # merged by the forward CTAs: they get the output
            for ln in launches:
                _set_out(ln.params.merge, out_args)
        if merge is not None:
            _set_out(merge.params, out_args)
        caller = self._caller_stream(qd)
        k = prep["phase_b"]
        if k is None:
            self._enqueue(launches, merge, caller, plan.serial, prep["chain"])
        elif prep["chain"]:
            # the first phase chained, each finisher launch a dependent of the launch before it;
            # a finisher folds after its pdl_wait, when the whole chain before it has finished
            self._enqueue(launches, None, caller, False, chain=True)
        elif self._finish_pdl(launches, k):
            # the finishers start while the first phase runs; they wait for it (pdl_wait in
            # cuda_src/pat_fwd.cuh) only before they fold its slots in
            launches[0](caller)
            launches[1](caller, dependent=True)
        else:   # the finishers start once every other forward launch has finished
            self._enqueue(launches[:k], None, caller, plan.serial)
            self._enqueue(launches[k:], None, caller, plan.serial)
        return (out, lse) if want_lse else out

    def _finish_ordered(self, plan: Plan, num_sms: int) -> bool:
        """Whether a finisher-phase plan runs as one ordered launch (``finish_launch``
        "ordered"): its first phase and its finishers each one tile group, of the same tile, and
        the first phase not split by the one-tile rule."""
        if self.finish_launch not in FINISH_LAUNCH_MODES:
            raise ValueError(f"finish_launch must be one of {FINISH_LAUNCH_MODES}, got "
                             f"{self.finish_launch!r}")
        if self.finish_launch != "ordered" or plan.finish_from < 0:
            return False
        live = [(g, mn, b, e) for g, mn, b, e in plan.groups() if e > b]
        if len(live) != 2 or live[0][0] >= plan.finish_from or live[1][0] < plan.finish_from:
            return False
        (_, mn_a, b, e), (_, mn_b, _, _) = live
        return mn_a == mn_b and one_tile_split(plan, b, e, num_sms, self.one_tile)[0] == e

    def _finish_pdl(self, launches, k: int) -> bool:
        """Whether the finisher phase starting at ``launches[k]`` goes as a programmatic
        dependent launch (``finish_launch`` "pdl", or "ordered" where the phases could not share
        a launch): one launch per phase, both through the driver, on an sm_90 or later
        device.  ``finish_launch`` was checked by :meth:`_finish_ordered` when the launches
        were prepared."""
        return (self.finish_launch != "serial" and k == 1 and len(launches) == 2
                and self._pdl_ok(launches))

    def _pdl_ok(self, launches) -> bool:
        """Programmatic dependent launch is possible after ``launches``: an sm_90 or later
        device, a driver with ``cuLaunchKernelEx``, every launch on the fast path."""
        return (int(self.arch[3:]) >= 90 and all(ln.fast for ln in launches)
                and _launch_ex() is not None)

    def _outputs(self, qd: _Dev, rows: int, Hq: int, D: int, dtype: str, want_lse: bool, out,
                 lse, note: str = ""):
        """Allocate or check ``out`` ``[rows, Hq, D]`` in ``dtype`` and (with ``want_lse``)
        ``lse`` float32 ``[rows, Hq]``; returns ``(out, lse, out_args)``, out_args being the
        pointers and element strides the merge writes through (0 for a missing lse)."""
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
        return out, lse, (o_ptr, l_ptr, o_sb, o_sh, l_sb, l_sh)

    def _enqueue(self, launches, merge, caller: int, serial: bool, chain: bool = False) -> None:
        """Forward launches (concurrent on pool streams forked from the caller's stream unless
        ``serial`` or ``chain``), then the merge (if any) on the caller's stream once they have
        joined.  ``chain`` (launches prepared by :meth:`_chain`): on the caller's stream, each
        after the first a programmatic dependent of the one before it."""
        rt = self.cp.cuda.runtime
        on_caller = serial or chain or len(launches) <= 1
        if chain:
            launches[0](caller)
            for ln in launches[1:]:
                ln(caller, dependent=True)
        elif on_caller:
            for ln in launches:
                ln(caller)
        else:
            # launch 0 on the caller's stream, the others on pool streams forked from it
            streams, fork, joins = self._pool()
            used = min(len(streams), len(launches) - 1)
            rt.eventRecord(fork.ptr, caller)
            for si in range(used):
                rt.streamWaitEvent(streams[si].ptr, fork.ptr, 0)
            launches[0](caller)
            for i, ln in enumerate(launches[1:]):
                ln(streams[i % len(streams)].ptr)
            for si in range(used):
                rt.eventRecord(joins[si].ptr, streams[si].ptr)
                rt.streamWaitEvent(caller, joins[si].ptr, 0)
        if merge is not None:
            # right after a forward launch on the same stream, the merge may go as its
            # programmatic dependent (pdl_wait in cuda_src/pat_merge.cuh); a forward launch
            # that waited on the launch before it finished after it, so the wait covers both
            merge(caller, dependent=_mode(self.merge_launch, "merge_launch") and on_caller
                  and len(launches) > 0 and self._pdl_ok(launches + [merge]))

    # ------------------------------------------------------------------ graph-safe mode
    def static_state(self, layout, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, dtype: str, sm_scale: float,
                     fused: bool = False) -> "StaticState":
        """Device buffers and kernels of graph-safe mode for one fixed launch set (``layout``,
        a :class:`~pat_core.static_plan.StaticLayout`) and problem shape; compiles the launch
        set's kernels now (never during a capture).  ``fused``: every tile of the launch set in
        one pull launch (``pat_fwd_fused_pull_kernel``) instead of one launch per tile."""
        return StaticState(self, layout, num_qo_heads, num_kv_heads, head_dim, page_size,
                           dtype, sm_scale, fused)

    def run_static(self, state: "StaticState", q, k_cache, v_cache, kv_layout: str = "NHD",
                   return_lse: bool = False, out=None, lse=None):
        """Graph-safe run: the fixed launch set of ``state`` over whatever plan was last written
        into it (:meth:`StaticState.write`).  ``q``, ``out`` and ``lse`` may have more rows than
        the live batch (a captured graph's static buffers); rows past it are neither read nor
        written.  Every launch argument depends only on ``state`` and the buffers passed here,
        so the sequence can be captured once and replayed for later plans."""
        qd = _Dev(q, "q")
        kd = _Dev(k_cache, "k_cache")
        vd = _Dev(v_cache, "v_cache")
        want_lse = bool(return_lse or lse is not None)
        if state.batch is None:
            raise RuntimeError("graph-safe mode: write a plan (plan()) before run()")
        sig = (kv_layout, qd.sig(), kd.sig(), vd.sig(), self.fwd_chain)
        prep = state.prepared.get(sig)
        if prep is None:
            prep = state.prepare(qd, kd, vd, kv_layout)
            state.prepared.clear()      # one input set at a time: a graph holds its own copy
            state.prepared[sig] = prep
        out, lse, out_args = self._outputs(qd, qd.shape[0], state.num_qo_heads, state.head_dim,
                                           qd.dtype, want_lse, out, lse, note=" (q's rows)")
        cp = self.cp
        with cp.cuda.Device(state.device):
            _set_out(prep["merge"].params, out_args)
            self._enqueue(prep["launches"], prep["merge"], self._caller_stream(qd),
                          self.static_serial, prep["chain"] and not self.static_serial)
        return (out, lse) if want_lse else out


class StaticState:
    """Graph-safe mode's fixed device state (see :mod:`pat_core.static_plan`).

    Holds one int32 buffer with every Plan array at a fixed offset, fixed fp32 partial buffers,
    a work counter per launch, and the launch set: one pull-mode forward kernel per tile in
    ``layout.tiles`` (grid = SMs x resident blocks, capped by the item limit), or with ``fused``
    one pull kernel for all of them (each block runs the tile of the item it draws, in the
    largest tile's block), and a merge over a fixed grid.  :meth:`write` puts a new plan into
    the buffer with an asynchronous copy on a stream; nothing else changes between plans.
    """

    _MERGE_BLOCKS_PER_SM = 12      # the merge kernel's launch bounds: 48 warps of 4-warp blocks

    def __init__(self, backend: CudaBackend, layout, num_qo_heads, num_kv_heads, head_dim,
                 page_size, dtype, sm_scale, fused: bool = False):
        cp = backend.cp
        self.backend, self.cp = backend, cp
        self.layout = layout
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size = int(head_dim), int(page_size)
        self.dtype = dtype_name(dtype)
        self.sm_scale = float(sm_scale)
        if self.dtype not in cc.DTYPE_CTYPE:
            raise ValueError(f"graph-safe mode: the CUDA kernels take float16 or bfloat16, got "
                             f"{self.dtype}")
        for m, n in layout.tiles:
            if not cc.fwd_variant_supported(m, n, self.head_dim):
                raise ValueError(f"graph-safe mode: no CUDA kernel for tile ({m}, {n}) at "
                                 f"head_dim {self.head_dim}")
        self.device = cp.cuda.runtime.getDevice()
        lim = layout.limits
        V = layout.num_variants
        self.buf = cp.zeros(layout.total, dtype=cp.int32)
        self.counters = cp.zeros(V, dtype=cp.int32)     # zeroed again by every merge
        self.o_part = cp.empty(lim.max_partials * self.num_qo_heads * self.head_dim,
                               dtype=cp.float32)
        self.l_part = cp.empty(lim.max_partials * self.num_qo_heads, dtype=cp.float32)
        self._pinned = cp.cuda.alloc_pinned_memory(layout.total * 4)
        self.staging = np.frombuffer(self._pinned, dtype=np.int32, count=layout.total)
        self.copied = cp.cuda.Event(disable_timing=True)
        self.copied.record()
        self.variants = [cc.FwdVariant.make(m, n, self.head_dim, self.dtype, pull=True,
                                            arch=backend.arch)
                         for m, n in layout.tiles]
        self.merge_variant = cc.MergeVariant(self.head_dim, self.dtype)
        self.fused = bool(fused)
        if self.fused:
            # one kernel holds every tile (warmup compiles it in this process)
            self.launch_variants = [cc.FusedVariant(self.head_dim, self.dtype,
                                                    tuple(self.variants), pull=True)]
            backend.warmup(variants=self.launch_variants + [self.merge_variant], jobs=1)
        else:
            self.launch_variants = list(self.variants)
            backend.warmup(variants=self.variants + [self.merge_variant],
                           jobs=min(len(self.variants), os.cpu_count() or 1))
        props = cp.cuda.runtime.getDeviceProperties(self.device)
        self.num_sms = int(props["multiProcessorCount"])
        self.grids = [self._grid(v) for v in self.launch_variants]
        self.prepared: dict = {}
        self.batch = None           # live batch of the last plan written
        self.plan = None
        self.max_rows = None        # q rows and KV pages of the inputs the launches were built
        self.num_pages = None       # for (a later plan must fit them: a graph keeps them)

    def _grid(self, v) -> int:
        """Blocks of a pull launch: every block that can be resident at once, at most one per
        item the limits allow."""
        per_sm = self.backend._blocks_per_sm(v)
        cap = self.backend.graph_blocks_per_sm
        if cap:
            per_sm = min(per_sm, int(cap))
        items = self.layout.limits.max_ctas * self.num_kv_heads
        return max(1, min(items, per_sm * self.num_sms))

    def check_plan(self, plan: Plan) -> None:
        """``ValueError`` unless ``plan`` fits this state: its shape and the inputs the
        launches were built for.  (The layout's limits are checked by
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
        if self.max_rows is not None and plan.batch_size > self.max_rows:
            raise ValueError(f"graph-safe mode: the plan has {plan.batch_size} requests but the "
                             f"q buffer the launches were built for has {self.max_rows} rows")
        if self.num_pages is not None and plan.cta_pages.size \
                and int(plan.cta_pages.max()) >= self.num_pages:
            raise ValueError(f"graph-safe mode: the plan reads page {int(plan.cta_pages.max())}"
                             f" but the KV cache the launches were built for holds "
                             f"{self.num_pages} pages")
        if plan.cta_pages.size and int(plan.cta_pages.min()) < 0:
            raise ValueError(f"the plan reads page {int(plan.cta_pages.min())}: page ids must "
                             "be >= 0")

    def write(self, plan: Plan, stream_ptr: int) -> None:
        """Put ``plan`` into the device buffer: pack into pinned memory, then one asynchronous
        host-to-device copy on ``stream_ptr``, ordered after the work already on that stream
        (a replay of the previous step reads the old contents until then)."""
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
        self.plan = plan

    def prepare(self, qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str) -> dict:
        """Check the inputs and build the fixed launches for them."""
        Hq, Hk, D = self.num_qo_heads, self.num_kv_heads, self.head_dim
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        _check_rows(qd, "q", 3)
        if qd.shape[1:] != (Hq, D) or qd.shape[0] < self.batch:
            raise ValueError(f"q has shape {qd.shape}; graph-safe mode needs [rows, {Hq}, {D}] "
                             f"with rows >= the plan's batch {self.batch}")
        if not (qd.dtype == kd.dtype == vd.dtype == self.dtype):
            raise TypeError(f"q ({qd.dtype}) and paged_kv_cache ({kd.dtype}, {vd.dtype}) must be "
                            f"{self.dtype}, the plan's dtype")
        num_pages, axes = _check_cache(qd, kd, vd, kv_layout, self.page_size, Hk, D)
        devs = {t.device for t in (qd, kd, vd) if t.device is not None}
        if devs and devs != {self.device}:
            raise ValueError(f"graph-safe mode: inputs on device(s) {sorted(devs)}, the state "
                             f"lives on device {self.device}")
        old = (self.max_rows, self.num_pages)
        self.max_rows, self.num_pages = int(qd.shape[0]), int(num_pages)
        try:
            if self.plan is not None:
                self.check_plan(self.plan)     # the plan already written must fit these inputs
        except ValueError:
            self.max_rows, self.num_pages = old
            raise
        lay = self.layout
        base_ptr = int(self.buf.data.ptr)
        arrays = {name: base_ptr + 4 * lay.offset[name] for name in lay.offset}
        group = Hq // Hk
        base = _fwd_params(qd, kd, vd, axes, self.o_part, self.l_part, arrays, group, Hq, Hk,
                           self.page_size, self.sm_scale, True)
        ctr = int(self.counters.data.ptr)
        launches = []
        be = self.backend
        with self.cp.cuda.Device(self.device):
            for i, v in enumerate(self.launch_variants):
                prm = _copy_params(base)
                # the fused kernel reads the whole live table (one {first, count} per tile)
                prm.live = arrays["live"] + 8 * i
                prm.work_counter = ctr + 4 * i
                launches.append(_Launch(be._function(v), (self.grids[i], 1, 1), (v.threads, 1, 1),
                                        prm, v.smem_bytes, be.fast_launch))
            mv = self.merge_variant
            pairs = lay.limits.max_batch_size * Hq
            grid = max(1, min((pairs + mv.warps - 1) // mv.warps,
                              self.num_sms * self._MERGE_BLOCKS_PER_SM))
            mp = kp.MergeParams(o_partial=_ptr(self.o_part), lse_partial=_ptr(self.l_part),
                                req_slot_indptr=arrays["req_slot_indptr"],
                                live_batch=arrays["live_batch"], reset=ctr,
                                reset_n=lay.num_variants, batch=0, num_qo_heads=Hq)
            merge = _Launch(be._function(mv), (grid, 1, 1), (mv.threads, 1, 1), mp, 0,
                            be.fast_launch)
            # several tile launches: chained in the layout's tile order (the plan, and so which
            # launch is longest, changes between replays)
            chain = not be.static_serial and be._chain_mode(launches)
            if chain:
                launches = be._chain(launches, None, False)
        return {"launches": launches, "merge": merge, "chain": chain}


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


FINISH_LAUNCH_MODES = ("ordered", "pdl", "serial")   # CudaBackend.finish_launch


def _mode(value, name: str) -> bool:
    """A ``"pdl"`` / ``"serial"`` backend setting as a bool (True: programmatic dependent
    launch); ``ValueError`` naming the setting otherwise."""
    if value not in ("pdl", "serial"):
        raise ValueError(f"{name} must be 'pdl' or 'serial', got {value!r}")
    return value == "pdl"


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
            log.warning("no cuLaunchKernelEx in the CUDA driver: finisher phases run serially")
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
                head_minor):
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
        num_kv_heads=Hk, head_minor=1 if head_minor else 0, group=group, num_qo_heads=Hq,
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
    if isinstance(v, (cc.FwdVariant, cc.PipedVariant, cc.MergeVariant, cc.FusedVariant)):
        return v
    if isinstance(v, str):
        for cand in cc.all_fwd_variants() + cc.all_piped_variants() + cc.all_merge_variants():
            if cand.key == v:
                return cand
        raise ValueError(f"variants: unknown kernel variant {v!r}")
    raise TypeError(f"variants: expected FwdVariant, PipedVariant, MergeVariant, FusedVariant "
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
    v = {"fwd": cc.FwdVariant, "piped": cc.PipedVariant, "merge": cc.MergeVariant}[kind](*args)
    mod, name = _raw_module(cupy, v)
    mod.get_function(name)
    return v.key


def _compile_in_workers(variants, jobs: int) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    def fields_of(v):
        if isinstance(v, cc.FwdVariant):
            return "fwd", (v.head_dim, v.dtype, v.m, v.n, v.warps, v.stages, v.rows_per_warp,
                           v.pull, v.finish)
        if isinstance(v, cc.PipedVariant):
            return "piped", (v.head_dim, v.dtype, v.n, v.warps, v.items)
        return "merge", (v.head_dim, v.dtype, v.warps, v.heads)
    fields = [fields_of(v) for v in variants]
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(fields)), mp_context=ctx) as ex:
        for key in ex.map(_compile_one, fields):
            log.debug("compiled %s in a worker", key)


__all__ = ["CudaBackend", "StaticState", "is_available"]
