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

import dataclasses
import logging
import threading
from dataclasses import dataclass

import numpy as np
from numba import njit

from . import cuda_compile as cc
from .cuda_launch import _external_stream, _launch_ex, _set_out, _torch_stream_handle
from .cuda_modules import _compile_in_workers, _raw_module, _variant_from
from .cuda_state import StaticState
from .cuda_views import _Dev, _data_ptr, _extent, _itemsize
from .gpus import detect_gpu_name
from .inputs import refuse_overlap, refuse_self_overlap
from .launch import merge_block_per_pair, merge_heads_per_warp
from .plan import Plan, dtype_name

log = logging.getLogger("pat_core.cuda")

_TORCH_ALLOC: dict = {}    # canonical name -> torch dtype, for the arrays run() allocates


@dataclass(frozen=True)
class LaunchOptions:
    """How a :class:`CudaBackend` launches; one value, part of the key under which a state
    keeps the launches it prepared (changing an option prepares them again).

    ``fast``: launch through the driver with the pre-packed parameter struct (``False``: CuPy's
    generic call, a few microseconds more per launch; for comparisons).
    ``graph_fused``: graph-safe launch sets as one fused pull launch: ``"on"``, ``"off"``, or
    ``"auto"`` (by the bucket size, :func:`pat_core.static_plan.graph_safe_fused`); read when a
    wrapper makes its graph-safe state."""
    fast: bool = True
    graph_fused: str = "auto"

    def __post_init__(self):
        from .static_plan import GRAPH_FUSED_MODES
        if not isinstance(self.fast, (bool, np.bool_)):
            raise TypeError(f"fast must be a bool, got {self.fast!r}")
        if self.graph_fused not in GRAPH_FUSED_MODES:
            raise ValueError(f"graph_fused must be one of {GRAPH_FUSED_MODES}, got "
                             f"{self.graph_fused!r}")


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
    _functions: dict = {}    # (device, variant key, defines) -> CuPy Function (process-wide)
    _modules: dict = {}      # keeps the modules alive

    def __init__(self, defines: tuple = (), cache_dir: str | None = None):
        """``defines``: ``"NAME=VALUE"`` strings overriding the kernels' tuning constants
        (``cuda_src/pat_traits.cuh``) in every module this backend compiles; for experiments
        (the library's wrappers pass none).  ``cache_dir``: where compiled sm_90a kernels are
        kept (default :data:`pat_core.cuda_modules.DEFAULT_CACHE_DIR`; the other kernels go to
        CuPy's own cache)."""
        self.defines = tuple(defines)
        self.cache_dir = cache_dir
        cc.nvrtc_options(defines=self.defines)         # checks them
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
        self._sm90 = int(props["major"]) >= 9
        self.max_smem_optin = int(props.get("sharedMemPerBlockOptin", 0) or 0)
        self._sm_counts: dict = {}    # device -> SM count
        self._states: dict = {}       # (device, shape key) -> StaticState of plain plans
        self._last_state = None       # the state the last run() used (the next one's guess)
        self._retired: list = []      # [(StaticState, [events])]: replaced, maybe still read
        self.options = LaunchOptions()

    @property
    def options(self) -> LaunchOptions:
        """How this backend launches (:class:`LaunchOptions`); setting it makes the next run()
        of every input set prepare its launches again."""
        return self._options

    @options.setter
    def options(self, value: LaunchOptions) -> None:
        if not isinstance(value, LaunchOptions):
            raise TypeError(f"options must be a LaunchOptions, got {type(value).__name__}")
        self._options = value
        # the options' part of a prepared input set's key, as a plain tuple (hashing the
        # dataclass on every call costs more than the lookup it keys)
        self._options_key = dataclasses.astuple(value)

    @property
    def fast_launch(self) -> bool:
        """:attr:`LaunchOptions.fast` of :attr:`options`; setting it replaces ``options``."""
        return self.options.fast

    @fast_launch.setter
    def fast_launch(self, value: bool) -> None:
        self.options = dataclasses.replace(self.options, fast=bool(value))

    @property
    def graph_fused(self) -> str:
        """:attr:`LaunchOptions.graph_fused` of :attr:`options`; setting it replaces
        ``options``."""
        return self.options.graph_fused

    @graph_fused.setter
    def graph_fused(self, value: str) -> None:
        self.options = dataclasses.replace(self.options, graph_fused=value)

    # ------------------------------------------------------------------ compile
    def _function(self, variant):
        dev = self.cp.cuda.runtime.getDevice()
        key = (dev, variant.key, self.defines)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(key)
            if fn is not None:
                return fn
            log.info("compile %s", variant.key)
            mod, name = _raw_module(self.cp, variant, self.defines, self.cache_dir)
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
        dtype = dtype_name(dtype or plan.io_dtype)
        fwd = [cc.FwdVariant.make(v.m, v.n, v.head_dim, dtype, arch=self.arch,
                                  kv_dtype=v.kv_dtype or None, causal=v.causal)
               for v in cc.plan_fwd_variants(plan, self.arch)]
        nh = self._merge_layout(plan)[1]
        return fwd + [cc.MergeVariant(plan.head_dim, dtype, cc.MERGE_WARPS, nh)]

    def warmup(self, plan: Plan | None = None, variants=None, jobs: int | None = None) -> list:
        """Compile the variants ``plan`` needs, or those listed (FwdVariant, MergeVariant or
        FusedVariant objects, or the keys of the first two), or every forward variant and the
        merges when both are None.  Logs one line per compile (the key).

        ``jobs > 1`` first compiles the missing variants in that many worker processes, which
        fill the on-disk kernel caches; this process then loads the cached binaries.  Fused
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
        todo = [v for v in variants if (dev, v.key, self.defines) not in self._functions
                and not isinstance(v, cc.FusedVariant)]
        if jobs and jobs > 1 and len(todo) > 1:
            try:
                _compile_in_workers(todo, jobs, self.defines, self.cache_dir)
            except Exception as e:  # fall back to compiling here
                log.warning("parallel compile failed (%s); compiling serially", e)
        for v in variants:
            self._function(v)
        return [v.key for v in variants]

    def warmup_configuration(self, tiles, head_dim: int, dtype: str, kv_dtype: str,
                             jobs: int | None = None) -> list:
        """:meth:`warmup` of the one-token forward variants of ``tiles`` (``(m, n)`` pairs)
        at ``head_dim`` for ``dtype`` queries over a ``kv_dtype`` cache, and of the merges
        for ``dtype``; returns their keys."""
        dtype, kv_dtype = dtype_name(dtype), dtype_name(kv_dtype)
        kv = kv_dtype if kv_dtype != dtype else None
        fwd = [cc.FwdVariant.make(int(m), int(n), head_dim, dtype, arch=self.arch, kv_dtype=kv)
               for m, n in tiles if cc.fwd_variant_supported(int(m), int(n), head_dim, kv)]
        if self.max_smem_optin:           # a GPU with less shared memory than the H100's
            fwd = [v for v in fwd if v.smem_bytes <= self.max_smem_optin]
        merges = [cc.MergeVariant(head_dim, dtype, cc.MERGE_WARPS, nh) for nh in cc.MERGE_HEADS]
        return self.warmup(variants=fwd + merges, jobs=jobs)

    def warmup_host(self, plans) -> None:
        """Run the host code that puts a plan on the device (its checks, and the pack into a
        host buffer of the layout :meth:`state_for` would size) on each of ``plans``, so its
        compiled parts are loaded; no device work."""
        for plan in plans:
            _check_plan_tiles(plan)
            layout = _grown_layout(*_plan_needs(plan))
            layout.check(plan)
            layout.pack_checked(plan, out=np.empty(layout.total, dtype=np.int32))

    # ------------------------------------------------------------------ plain plans
    def state_for(self, plan: Plan) -> "StaticState":
        """The device state that holds ``plan`` on the current device: the one of its problem
        shape (heads, head_dim, page size, dtype, ``sm_scale``) when the plan fits its limits
        and tiles, else a new one sized for it (limits 1.25x the plan's, tiles the union of the
        old state's and the plan's), which replaces the old one once the device is idle.  A
        multi-token plan needs a state with ``max_num_qo_tokens`` (the causal limits and the
        multi-token kernels); once made, it serves the one-token plans too."""
        _check_plan_tiles(plan)
        if self._retired:
            self._reap()
        dev = self.cp.cuda.runtime.getDevice()
        shape = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                 plan.io_dtype, float(plan.sm_scale))
        kv_dtype = dtype_name(plan.kv_dtype)
        key = (dev, shape, kv_dtype)
        st = self._states.get(key)
        tiles, need, multi = _plan_needs(plan)
        if st is not None:
            lim = st.layout.limits
            have = (lim.max_batch_size, lim.max_num_pages, lim.max_ctas, lim.max_partials,
                    lim.max_tokens)
            if tiles <= st.layout.tile_set and all(n <= h for n, h in zip(need, have)) \
                    and (lim.multi_token or not multi):
                return st
            tiles |= st.layout.tile_set
            need = tuple(max(n, h) for n, h in zip(need, have))
            multi = multi or lim.multi_token
            # kernels of the old state's last run may still read its buffers: kept until
            # they have finished (never waited for here)
            self._retire(st)
        st = StaticState(self, _grown_layout(tiles, need, multi), *shape, fixed=False,
                         kv_dtype=kv_dtype)
        self._states[key] = st
        return st

    def _retire(self, st: "StaticState") -> None:
        """Replace ``st`` without waiting for the device: an event on each stream its copies
        and launches went to, and the state (its device and pinned buffers) kept until every
        event has completed (:meth:`_reap`, polled by later plans).  CuPy streams are kept
        alive by the state, torch's pooled streams are never destroyed; a state used on more
        than :attr:`StaticState.MAX_STREAMS` streams (a caller making a new stream per step),
        or one whose event cannot be recorded, synchronises the device instead."""
        if self._last_state is st:
            self._last_state = None
        cp = self.cp
        events = None
        if not st.streams_overflow:
            with cp.cuda.Device(st.device):
                try:
                    events = []
                    for s in st.streams:
                        ev = cp.cuda.Event(disable_timing=True)
                        ev.record(_external_stream(cp, s, st.device))
                        events.append(ev)
                except Exception as e:      # CUDA errors differ across CuPy versions
                    log.debug("retiring a state: %s; synchronising the device", e)
                    events = None
        if events is None:
            cp.cuda.Device(st.device).synchronize()
        elif events:
            self._retired.append((st, events))

    def _reap(self) -> None:
        """Drop the retired states whose work has finished (a query, never a wait)."""
        self._retired = [(st, evs) for st, evs in self._retired
                         if not all(ev.done for ev in evs)]

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
            return_lse: bool = False, out=None, lse=None, check=None,
            scales: tuple = (1.0, 1.0)):
        """Forward + merge for one batch.

        Parameters
        ----------
        plan : the batch's :class:`~pat_core.plan.Plan` (written into its device state here,
            on the caller's stream, unless :meth:`upload` already did).
        q : ``[batch, num_qo_heads, head_dim]`` float16/bfloat16 (``[qo_indptr[-1], ...]``
            for a multi-token plan; out and lse likewise), torch CUDA tensor or CuPy
            array (any strides with a contiguous last dimension and 16-byte aligned rows).
        k_cache, v_cache : ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), q's dtype; strided views
            are fine when head_dim is contiguous.
        out : optional output ``[batch, num_qo_heads, head_dim]`` in q's dtype (written in place).
        lse : optional float32 ``[batch, num_qo_heads]`` (implies return_lse).
        check : optional callable run (before this method's own checks) whenever the inputs
            are validated, i.e. not on calls that reuse cached launch arguments.
        scales : ``(k_scale, v_scale)`` of an fp8 cache (``float8_e4m3fn`` torch tensors or
            CuPy ``uint8`` arrays of its bytes), host floats (``(1, 1)`` otherwise): k_scale is
            folded into the softmax scale, v_scale multiplies the output.

        Returns ``out`` (same kind as q), and ``lse`` fp32 natural log when ``return_lse``.

        The validated launch arguments are cached per input set (pointers, shapes, strides and
        dtypes; up to 64, e.g. one per model layer), so a decode loop pays for the checks once.
        """
        qd = _Dev(q, "q")
        current = self.cp.cuda.runtime.getDevice()
        dev = qd.device if qd.device is not None else current
        # the usual call: the plan was written by upload() (the wrapper's plan()), into the
        # state the last call used, on the current device
        st = self._last_state
        if st is not None and st.plan is plan and st.plan_version == plan.version \
                and st.device == dev == current:
            return self._run_state(st, qd, k_cache, v_cache, kv_layout, return_lse, out, lse,
                                   check, scales)
        with self.cp.cuda.Device(dev):
            st = next((s for s in self._states.values() if s.plan is plan
                       and s.plan_version == plan.version and s.device == dev), None)
            if st is None:
                st = self.state_for(plan)
                st.write(plan, self._caller_stream(qd))
            self._last_state = st
            return self._run_state(st, qd, k_cache, v_cache, kv_layout, return_lse, out, lse,
                                   check, scales)

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
            chk = check_tile(v.m, v.n, v.head_dim, v.kv_dtype or v.dtype,
                             get_gpu(self.gpu_name))
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
        return (self._sm90 and all(ln.fast for ln in launches) and _launch_ex() is not None)

    def _outputs(self, qd: _Dev, rows: int, Hq: int, D: int, dtype: str, want_lse: bool, out,
                 lse, inputs: dict, note: str = "", checked: dict | None = None):
        """Allocate or check ``out`` ``[rows, Hq, D]`` in ``dtype`` and (with ``want_lse``)
        ``lse`` float32 ``[rows, Hq]``; a caller's buffer must not overlap the other or the
        ``inputs`` (``{name: _Dev or its (lo, hi) byte range}``, or a callable returning it,
        called only when a caller's buffer is checked).  Returns ``(out, lse,
        out_args)``, out_args being the pointers and element strides the merge writes through
        (0 for a missing lse).  ``checked``: a dict in which the last caller buffers that
        passed the checks are noted (a prepared input set's: its inputs are fixed but for q's
        rows), so the same buffers again are not checked again."""
        od = None if out is None else _Dev(out, "out")
        if checked is None or od is None or lse is not None or want_lse:
            return self._new_outputs(qd, rows, Hq, D, dtype, want_lse, out, od, lse, inputs,
                                     note)
        key = (od.sig(), rows, qd.shape[0])
        hit = checked.get("out_ok")
        if hit is not None and hit[0] == key:
            return out, None, hit[1]
        res = self._new_outputs(qd, rows, Hq, D, dtype, want_lse, out, od, lse, inputs, note)
        checked["out_ok"] = (key, res[2])
        return res

    def _new_outputs(self, qd: _Dev, rows: int, Hq: int, D: int, dtype: str, want_lse: bool,
                     out, od, lse, inputs, note: str):
        """:meth:`_outputs` without its cache: ``od`` is ``out`` read as a :class:`_Dev`
        (``None`` with ``out``)."""
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
            if od.shape != (rows, Hq, D) or od.dtype != dtype or (D > 1 and od.strides[-1] != 1):
                raise ValueError(f"out must be [{rows}, {Hq}, {D}] {dtype}{note} with a "
                                 f"contiguous last dimension, got {od.shape} {od.dtype} strides "
                                 f"{od.strides}")
            o_ptr, o_sb, o_sh = od.ptr, od.strides[0], od.strides[1]
            if od.strides == (Hq * D, D, 1):     # C-contiguous: no element twice, one span
                given["out"] = (o_ptr, o_ptr + rows * Hq * D * _itemsize(od))
            else:
                refuse_self_overlap("out", od.shape, od.strides)
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
                refuse_self_overlap("lse", ld.shape, ld.strides)
                l_ptr, l_sb, l_sh = ld.ptr, ld.strides[0], ld.strides[1]
                given["lse"] = _extent(ld)
        if given:
            if callable(inputs):
                inputs = inputs()
            refuse_overlap(given, {n: t if isinstance(t, tuple) else _extent(t)
                                   for n, t in inputs.items()})
        return out, lse, (o_ptr, l_ptr, o_sb, o_sh, l_sb, l_sh)

    def _enqueue(self, launches, merge, caller: int, pdl: bool | None = None) -> None:
        """Forward ``launches`` on the caller's stream, each after the first a programmatic
        dependent of the one before it where the GPU has that (their blocks are placed as soon
        as the previous launch's all are; the chained last block of each waits for the launch
        before it), then the merge (if any), a dependent of the last of them.  ``pdl``:
        :meth:`_pdl_ok` of them, when the caller knows it."""
        if pdl is None:
            pdl = self._pdl_ok(launches + ([merge] if merge is not None else []))
        for i, ln in enumerate(launches):
            ln(caller, dependent=pdl and i > 0)
        if merge is not None:
            merge(caller, dependent=pdl and len(launches) > 0)

    # ------------------------------------------------------------------ graph-safe mode
    def static_state(self, layout, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, dtype: str, sm_scale: float,
                     fused: bool = False, kv_dtype: str | None = None) -> "StaticState":
        """Device buffers and kernels of graph-safe mode for one fixed launch set (``layout``,
        a :class:`~pat_core.static_plan.StaticLayout`) and problem shape; compiles the launch
        set's kernels now (never during a capture).  ``fused``: every tile of the launch set in
        one pull launch (``pat_fwd_fused_pull_kernel``) instead of one launch per tile.
        ``dtype``: q's and the output's; ``kv_dtype``: the cache's when it differs (fp8)."""
        return StaticState(self, layout, num_qo_heads, num_kv_heads, head_dim, page_size,
                           dtype, sm_scale, fused=fused, fixed=True, kv_dtype=kv_dtype)

    def run_static(self, state: "StaticState", q, k_cache, v_cache, kv_layout: str = "NHD",
                   return_lse: bool = False, out=None, lse=None, scales: tuple = (1.0, 1.0)):
        """Graph-safe run: the fixed launch set of ``state`` over whatever plan was last written
        into it (:meth:`StaticState.write`).  ``q``, ``out`` and ``lse`` may have more rows than
        the live batch (a captured graph's static buffers); rows past it are neither read nor
        written.  Every launch argument depends only on ``state`` and the buffers passed here,
        so the sequence can be captured once and replayed for later plans (``scales``, an fp8
        cache's, are launch arguments too: a captured graph keeps those it was captured
        with)."""
        qd = _Dev(q, "q")
        with self.cp.cuda.Device(state.device):
            return self._run_state(state, qd, k_cache, v_cache, kv_layout, return_lse, out,
                                   lse, None, scales)

    def _run_state(self, st: "StaticState", qd: _Dev, k_cache, v_cache, kv_layout, return_lse,
                   out, lse, check, scales=(1.0, 1.0)):
        """The one launch path: the forward launches and merge of ``st`` (current device)."""
        kd = _Dev(k_cache, "k_cache")
        vd = _Dev(v_cache, "v_cache")
        want_lse = bool(return_lse or lse is not None)
        if st.batch is None:
            raise RuntimeError("write a plan (plan()) before run()")
        scales = (float(scales[0]), float(scales[1]))
        # plain states: the launches do not depend on q's row count (an engine's query
        # buffer keeps its address while its batch changes), so a new batch size is checked,
        # not prepared again for every layer; graph-safe launches keep the rows they were
        # built for
        sig = (kv_layout, qd.sig() if st.fixed else qd.sig_any_rows(), kd.sig(), vd.sig(),
               self._options_key, scales)
        prep = st.prepared.get(sig)
        if prep is None:
            if check is not None:
                check()
            prep = st.prepare(qd, kd, vd, kv_layout, scales)
            # one set per model layer (graph-safe too: an engine captures each layer once
            # per graph); more than the deepest models' layers, so none is prepared twice
            if len(st.prepared) >= 256:
                st.prepared.clear()
            st.prepared[sig] = prep
            # the caches' byte ranges, for the overlap check of a caller's out/lse
            prep["cache_extents"] = {"k_cache": _extent(kd), "v_cache": _extent(vd)}
        # the plan now in the state must fit these inputs (checked per plan and batch size,
        # not per call)
        r = prep["rows"] if st.fixed else qd.shape[0]
        if prep["checked"] is not st.plan or prep["checked_version"] != st.plan_version \
                or prep["rows"] != r:
            st.check_inputs(st.plan, r, prep["num_pages"])     # noted only once it passed
            prep["rows"], prep["checked"] = r, st.plan
            prep["checked_version"] = st.plan_version
        rows = prep["rows"] if st.fixed else st.batch
        out, lse, out_args = self._outputs(qd, rows, st.num_qo_heads, st.head_dim, st.dtype,
                                           want_lse, out, lse,
                                           lambda: {"q": qd, **prep["cache_extents"]},
                                           note=" (q's rows)" if st.fixed else "",
                                           checked=prep)
        # the launches of the written plan for these inputs, made once per plan (an engine
        # calls once per layer and step: every call is a layer's first of its plan, and the
        # host's time per call is on the decode step's critical path)
        live = prep.get("live")
        if live is None or live[0] is not st.plan or live[1] != st.plan_version:
            launches, merge = ((prep["launches"], prep["merge"]) if st.fixed
                               else st.live_launches(prep))
            pdl = self._pdl_ok(launches + ([merge] if merge is not None else []))
            live = prep["live"] = (st.plan, st.plan_version, launches, merge, pdl)
            prep["out_args"] = None
        _, _, launches, merge, pdl = live
        if prep["out_args"] != out_args:
            for ln in launches:
                _set_out(ln.params.merge, out_args)
            if merge is not None:
                _set_out(merge.params, out_args)
            prep["out_args"] = out_args
        caller = self._caller_stream(qd)
        if caller not in st.streams:
            st.note_stream(caller)
        self._enqueue(launches, merge, caller, pdl)
        return (out, lse) if want_lse else out


def _plan_needs(plan: Plan) -> tuple:
    """``(tiles, need, multi)`` of a plain device state that holds ``plan``: its tile set, the
    limits ``(requests, page entries less CTAs, CTAs, partial rows, query tokens)`` and
    whether it needs the multi-token kernels."""
    tiles = set(map(tuple, plan.tile_configs.tolist()))
    need = (plan.batch_size, max(1, int(plan.cta_pages.shape[0]) - plan.num_ctas),
            max(1, plan.num_ctas), max(1, plan.num_partial_rows), plan.num_qo_tokens)
    return tiles, need, plan.multi_token


def _grown_layout(tiles, need, multi: bool):
    """The layout of a plain device state for ``need`` (:func:`_plan_needs`), each limit a
    quarter larger, so the next steps' growth does not make a new state every time."""
    from .static_plan import StaticLayout, StaticLimits, order_tiles
    grow = [max(1, (n * 5 + 3) // 4) for n in need]
    grow[4] = max(grow[4], grow[0])
    limits = StaticLimits(*grow[:4], max_num_qo_tokens=grow[4] if multi else None)
    return StaticLayout(limits, order_tiles(tiles))


def _check_plan_tiles(plan: Plan) -> None:
    """Every launch group's tile has a kernel and every CTA's rows fit its tile's m."""
    kv = plan.kv_dtype if plan.kv_dtype in cc.KV_CTYPE else None
    configs = plan.tile_configs.tolist()
    ptr = plan.group_indptr.tolist()
    for g, t in enumerate(plan.group_tile.tolist()):
        m, n = configs[t]
        if ptr[g + 1] > ptr[g] and not cc.fwd_variant_supported(m, n, plan.head_dim, kv):
            raise ValueError(f"plan: no CUDA kernel for tile (m={m}, n={n}) at head_dim "
                             f"{plan.head_dim}")
    if plan.num_ctas:
        # one compiled pass over the CTAs (a multi-token plan's token view: a request's query
        # tokens are rows)
        ptr = plan.token_view().cta_req_indptr if plan.multi_token else plan.cta_req_indptr
        c = _row_overflow_nb(ptr, plan.cta_tile, plan.tile_configs, plan.group_size)
        if c >= 0:
            rows = int(ptr[c + 1] - ptr[c]) * plan.group_size
            raise ValueError(f"plan: CTA {c} has {rows} query rows but its tile has "
                             f"m={int(plan.tile_configs[plan.cta_tile[c], 0])}")


@njit(cache=True, nogil=True)
def _row_overflow_nb(cta_req_indptr, cta_tile, tile_configs, group):
    """The first CTA whose query rows (its token rows x ``group``) exceed its tile's ``m``,
    or ``-1``."""
    for c in range(cta_tile.shape[0]):
        if (cta_req_indptr[c + 1] - cta_req_indptr[c]) * group > tile_configs[cta_tile[c], 0]:
            return c
    return -1


__all__ = ["CudaBackend", "LaunchOptions", "StaticState", "is_available"]
