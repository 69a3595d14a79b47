"""The device state a plan runs from: :class:`StaticState`.

One int32 buffer holds every Plan array at a fixed offset (:class:`pat_core.static_plan.
StaticLayout`), written by one asynchronous copy from pinned memory on the caller's stream;
fixed fp32 partial buffers; one work counter per forward launch; and the launch set.  Plain
plans use one state per problem shape (launching only the tiles a plan uses); graph-safe
wrappers fix one state's limits and launches once.
"""
from __future__ import annotations

import os

import numpy as np

from . import cuda_compile as cc
from . import kernel_params as kp
from .cuda_launch import _Launch, _copy_params, _external_stream, _fwd_params, _ptr
from .cuda_views import _Dev, _check_cache, _check_rows
from .launch import launch_grid, merge_needed_for
from .plan import Plan, dtype_name



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

    Multi-token queries: a layout with ``max_num_qo_tokens`` (:class:`~pat_core.static_plan.
    StaticLimits`) also holds each plan's causal limits, and the state has a second kernel set,
    the multi-token (causal) variants of the same tiles.  A plain state runs them for the plans
    that give a request several tokens (the one-token variants for the others, unchanged); a
    graph-safe state runs them for every step, since a captured graph may replay any mix.  Either
    way the request tables in the buffer are the plan's token view, so "batch" below counts query
    tokens (q rows) and "slots" partial rows.

    ``backend``: the :class:`pat_core.cuda_backend.CudaBackend` that compiles and launches the
    kernels (not imported here: the backend module imports this one).
    """

    _MERGE_BLOCKS_PER_SM = 12      # the merge kernel's launch bounds: 48 warps of 4-warp blocks

    def __init__(self, backend, layout, num_qo_heads, num_kv_heads, head_dim,
                 page_size, dtype, sm_scale, fused: bool = False, fixed: bool = True,
                 kv_dtype: str | None = None):
        cp = backend.cp
        self.backend, self.cp = backend, cp
        self.layout = layout
        self.fixed = bool(fixed)
        self.num_qo_heads, self.num_kv_heads = int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size = int(head_dim), int(page_size)
        # dtype: q's and the output's; kv_dtype: the cache's (fp8, or the same as dtype)
        self.dtype = dtype_name(dtype)
        self.kv_dtype = dtype_name(kv_dtype) if kv_dtype is not None else self.dtype
        self.sm_scale = float(sm_scale)
        if self.dtype not in cc.DTYPE_CTYPE:
            raise ValueError(f"the CUDA kernels take float16 or bfloat16, got {self.dtype}")
        if self.kv_dtype != self.dtype and self.kv_dtype not in cc.KV_CTYPE:
            raise ValueError(f"the CUDA kernels read a {self.dtype} or float8_e4m3fn cache with "
                             f"{self.dtype} queries, got {self.kv_dtype}")
        kv = self.kv_dtype if self.kv_dtype != self.dtype else None
        for m, n in layout.tiles:
            if not cc.fwd_variant_supported(m, n, self.head_dim, kv):
                raise ValueError(f"no CUDA kernel for tile ({m}, {n}) at head_dim "
                                 f"{self.head_dim}")
        self.device = cp.cuda.runtime.getDevice()
        lim = layout.limits
        V = layout.num_variants
        # zeroed by the first write(), on the stream of its copy (cp.zeros would zero them on
        # CuPy's current stream, which a caller's stream need not be ordered after)
        self.buf = cp.empty(layout.total, dtype=cp.int32)
        self.counters = cp.empty(V, dtype=cp.int32)     # zeroed again by every merge
        self.chain = cp.empty(V, dtype=cp.int32)        # chained launches' block counts
        self._zeroed = False
        self.o_part = cp.empty(lim.max_partials * self.num_qo_heads * self.head_dim,
                               dtype=cp.float32)
        self.l_part = cp.empty(lim.max_partials * self.num_qo_heads, dtype=cp.float32)
        # two pinned staging buffers, used in turn: a plan is packed into the one whose copy
        # was issued two plans ago, so write() waits only on that copy (planning the next step
        # while the last one's copy is still queued behind the GPU's work does not wait)
        self._pinned = [cp.cuda.alloc_pinned_memory(layout.total * 4) for _ in range(2)]
        self._staging = [np.frombuffer(b, dtype=np.int32, count=layout.total)
                         for b in self._pinned]
        # not recorded yet (waiting on such an event returns at once; one recorded here, on
        # CuPy's current stream, would make the first write wait for the work queued there)
        self._copied = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        self._half = 0              # the staging buffer the next write() packs into
        # caller streams this state's copies and launches were enqueued on, each with the
        # CuPy stream object when it is CuPy's (kept, so the stream outlives the work), or None
        # (torch's pooled streams are never destroyed): a plain state that is replaced is kept
        # until the work on them has finished (CudaBackend._retire)
        self.streams: dict = {}
        self.streams_overflow = False   # more than MAX_STREAMS: retired by a device wait
        self.merge_variant = cc.MergeVariant(self.head_dim, self.dtype)
        self.fused = bool(fused) and self.fixed
        self.num_sms = backend._num_sms()
        # kernel sets by causal flag: the one-token variants, and for a multi-token layout the
        # multi-token ones (graph-safe: those alone, every step may hold several tokens)
        if lim.multi_token:
            causal_sets = (True,) if self.fixed else (False, True)
        else:
            causal_sets = (False,)
        self._sets = {c: self._kernel_set(c, kv) for c in causal_sets}
        self.causal = False
        self._use(causal_sets[-1] if self.fixed else False)
        self.prepared: dict = {}
        self.batch = None           # live query tokens (q rows) of the last plan written
        self.plan = None
        self.plan_version = None
        self.live = None            # [V, 2] first CTA and count per variant of that plan
        self.order = ()             # plain plans: variants with CTAs, in launch-set order
        self.plan_grids = {}        # plain plans: variant -> blocks of its launch
        self.needs_merge = True
        self.merge_key = (False, 1)
        self.max_rows = None        # graph-safe: the fewest q rows and KV pages of the inputs
        self.num_pages = None       # launches were built for (a later plan must fit them)

    def _kernel_set(self, causal: bool, kv) -> dict:
        """Compile the launch set's forward kernels (``causal``: the multi-token variants) and
        size their grids: ``{"variants", "launch_variants", "per_sm", "grids"}``."""
        backend = self.backend
        variants = [cc.FwdVariant.make(m, n, self.head_dim, self.dtype, arch=backend.arch,
                                       kv_dtype=kv, causal=causal)
                    for m, n in self.layout.tiles]
        if self.fused:
            # one kernel holds every tile (warmup compiles it in this process)
            launch_variants = [cc.FusedVariant(self.head_dim, self.dtype, tuple(variants))]
            backend.warmup(variants=launch_variants + [self.merge_variant], jobs=1)
        else:
            launch_variants = list(variants)
            backend.warmup(variants=variants + [self.merge_variant],
                           jobs=min(len(variants), os.cpu_count() or 1))
        per_sm = [backend._blocks_per_sm(v) for v in launch_variants]
        # every block that can be resident at once, at most one per item the limits allow
        grids = [launch_grid(self.layout.limits.max_ctas * self.num_kv_heads, b, self.num_sms)
                 for b in per_sm]
        return {"variants": variants, "launch_variants": launch_variants, "per_sm": per_sm,
                "grids": grids}

    def _use(self, causal: bool) -> None:
        """Make the kernel set of ``causal`` the current one (:attr:`variants`,
        :attr:`launch_variants`, :attr:`per_sm`, :attr:`grids`)."""
        ks = self._sets[causal]
        self.causal = causal
        self.variants, self.launch_variants = ks["variants"], ks["launch_variants"]
        self.per_sm, self.grids = ks["per_sm"], ks["grids"]

    def check_plan(self, plan: Plan) -> None:
        """``ValueError`` unless ``plan`` fits this state: its shape and, in graph-safe mode,
        the inputs the launches were built for, and no negative page id.  (The layout's limits
        are checked by :meth:`write`, before it waits for its staging memory.)"""
        want = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                self.kv_dtype, self.dtype)
        have = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                dtype_name(plan.kv_dtype), plan.io_dtype)
        names = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "kv_data_type",
                 "q_data_type")
        for nm, w, h in zip(names, want, have):
            if w != h:
                raise ValueError(f"graph-safe mode: {nm}={h!r} differs from {w!r} of the first "
                                 "plan (the launches are fixed; create another wrapper)")
        if abs(plan.sm_scale - self.sm_scale) > 1e-12 * abs(self.sm_scale):
            raise ValueError(f"graph-safe mode: sm_scale={plan.sm_scale} differs from "
                             f"{self.sm_scale} of the first plan")
        if self.fixed and self.max_rows is not None:
            self.check_inputs(plan, self.max_rows, self.num_pages)
        lo = plan.page_range()[0]
        if lo < 0:
            raise ValueError(f"the plan reads page {lo}: page ids must be >= 0")

    def check_inputs(self, plan: Plan, rows: int, num_pages: int) -> None:
        """``ValueError`` unless ``plan`` fits inputs of ``rows`` q rows and ``num_pages`` KV
        pages (graph-safe: at least the batch's query tokens; plain: exactly)."""
        need = plan.num_qo_tokens
        if need > rows or (not self.fixed and need != rows):
            what = "the q buffer the launches were built for has" if self.fixed else "q has"
            toks = (f"{need} query tokens (qo_indptr[-1])" if plan.multi_token
                    else f"{need} requests")
            raise ValueError(f"the plan has {toks} but {what} {rows} rows")
        hi = plan.page_range()[1]
        if hi >= num_pages:
            raise ValueError(f"the KV cache (paged_kv_cache) holds {num_pages} pages but the "
                             f"plan reads page {hi}")

    def write(self, plan: Plan, stream_ptr: int) -> None:
        """Put ``plan`` into the device buffer: pack into pinned memory, then one asynchronous
        host-to-device copy on ``stream_ptr``, ordered after the work already on that stream
        (a run of the previous plan reads the old contents until then)."""
        self.check_plan(plan)
        self.layout.check(plan)            # a plan past a limit fails before any wait
        cp = self.cp
        h = self._half
        staging, copied = self._staging[h], self._copied[h]
        self.note_stream(stream_ptr)       # before anything is enqueued on it
        with cp.cuda.Device(self.device):
            copied.synchronize()           # the copy of two plans ago has read this buffer
            packed = self.layout.pack_checked(plan, out=staging)
            rt = cp.cuda.runtime
            try:
                if not self._zeroed:
                    for a in (self.buf, self.counters, self.chain):
                        rt.memsetAsync(int(a.data.ptr), 0, a.nbytes, stream_ptr)
                rt.memcpyAsync(int(self.buf.data.ptr), staging.ctypes.data,
                               packed.shape[0] * 4, rt.memcpyHostToDevice, stream_ptr)
                copied.record(_external_stream(cp, stream_ptr, self.device))
            except Exception:
                # a copy may be queued from this staging buffer with no event after it: wait
                # until nothing reads it (an error path only)
                cp.cuda.Device(self.device).synchronize()
                raise
        self._zeroed = True
        self._half = 1 - h
        self.batch = plan.num_qo_tokens
        self.plan, self.plan_version = plan, plan.version
        off = self.layout.offset["live"]
        self.live = packed[off:off + 2 * self.layout.num_variants].reshape(-1, 2).copy()
        if not self.fixed:
            # plain: the multi-token variants only for a plan that needs them
            self._use(plan.multi_token)
            self._plain_schedule(plan)

    #: streams a state tracks for its retirement; past them it is retired by a device wait
    MAX_STREAMS = 8

    def note_stream(self, handle: int) -> None:
        """Note that work reading this state is enqueued on stream ``handle`` (before it is):
        with the CuPy stream object when ``handle`` is CuPy's current stream, kept so that the
        stream is not destroyed while :meth:`CudaBackend._retire` may record on it.  Past
        :data:`MAX_STREAMS` streams (a caller making a stream per step) nothing more is kept,
        and those kept are let go: the state will be retired by a device synchronize."""
        if handle in self.streams or self.streams_overflow:
            return
        if len(self.streams) >= self.MAX_STREAMS:
            self.streams_overflow = True
            self.streams.clear()
            return
        cur = self.cp.cuda.get_current_stream()
        self.streams[handle] = cur if int(cur.ptr) == int(handle) else None

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
        # from the live counts the pack already made
        self.needs_merge = merge_needed_for(plan, [int(self.live[v, 1]) * Hk for v in used],
                                            [self.plan_grids[v] for v in used])
        self.merge_key = self.backend._merge_layout(plan)

    def prepare(self, qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str,
                scales: tuple = (1.0, 1.0)) -> dict:
        """Check the inputs and build the launches for them (``scales``: an fp8 cache's
        ``(k_scale, v_scale)``, host floats)."""
        Hq, Hk, D = self.num_qo_heads, self.num_kv_heads, self.head_dim
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        _check_rows(qd, "q", 3)
        if qd.shape[1:] != (Hq, D):
            raise ValueError(f"q has shape {qd.shape}; the plan needs [batch, {Hq}, {D}]")
        if qd.dtype not in cc.DTYPE_CTYPE:
            raise TypeError(f"q: the CUDA kernels take float16 or bfloat16, got {qd.dtype}")
        if self.kv_dtype == self.dtype:
            if not (qd.dtype == kd.dtype == vd.dtype == self.dtype):
                raise TypeError(f"q ({qd.dtype}) and paged_kv_cache ({kd.dtype}, {vd.dtype}) "
                                f"must be {self.dtype}, the plan's dtype")
        else:
            # an fp8 cache: torch float8_e4m3fn tensors, or CuPy uint8 arrays of its bytes
            ok = {self.kv_dtype, "uint8"}
            if qd.dtype != self.dtype or kd.dtype not in ok or vd.dtype != kd.dtype:
                raise TypeError(f"q ({qd.dtype}) must be {self.dtype} and paged_kv_cache "
                                f"({kd.dtype}, {vd.dtype}) {self.kv_dtype} (or its uint8 bytes)")
        num_pages, axes = _check_cache(qd, kd, vd, kv_layout, self.page_size, Hk, D)
        devs = {t.device for t in (qd, kd, vd) if t.device is not None}
        if devs and devs != {self.device}:
            raise ValueError(f"q and paged_kv_cache live on device(s) {sorted(devs)}, the plan's "
                             f"state on device {self.device}")
        rows = int(qd.shape[0])
        if self.plan is not None:
            self.check_inputs(self.plan, rows, int(num_pages))
        if self.fixed:
            # a captured graph keeps these inputs: later plans must fit them, and those of
            # every input set prepared before (graphs captured with them may be replayed)
            if self.max_rows is None:
                self.max_rows, self.num_pages = rows, int(num_pages)
            else:
                self.max_rows = min(self.max_rows, rows)
                self.num_pages = min(self.num_pages, int(num_pages))
        lay = self.layout
        base_ptr = int(self.buf.data.ptr)
        arrays = {name: base_ptr + 4 * lay.offset[name] for name in lay.offset}
        group = Hq // Hk
        base = _fwd_params(qd, kd, vd, axes, self.o_part, self.l_part, arrays, group, Hq, Hk,
                           self.page_size, self.sm_scale, *scales)
        # single-slot requests: the forward item writes the output (out set per call)
        base.merge.req_slot_indptr = arrays["req_slot_indptr"]
        ctr, chain = int(self.counters.data.ptr), int(self.chain.data.ptr)
        by_set = {}
        be = self.backend
        with self.cp.cuda.Device(self.device):
            for causal, ks in self._sets.items():
                launches = []
                for i, v in enumerate(ks["launch_variants"]):
                    prm = _copy_params(base)
                    # the fused kernel reads the whole live table (one {first, count} per tile)
                    prm.live = arrays["live"] + 8 * i
                    prm.work_counter = ctr + 4 * i
                    prm.chain = chain + 4 * i
                    if causal:          # the causal limits (the one-token variants: nullptr)
                        prm.cta_kv_limit = arrays["cta_kv_limit"]
                        prm.cta_causal = arrays["cta_causal"]
                    launches.append(_Launch(be._function(v), (ks["grids"][i], 1, 1),
                                            (v.threads, 1, 1), prm, v.smem_bytes,
                                            be.options.fast))
                by_set[causal] = launches
            # "launches": the graph-safe set (its only one), or the plain one-token set
            prep = {"launches": by_set[self.causal if self.fixed else False],
                    "launches_by_set": by_set, "merges": {}, "rows": rows,
                    "num_pages": int(num_pages), "checked": self.plan,
                    "checked_version": self.plan_version, "arrays": arrays}
            if self.fixed:
                mv = self.merge_variant
                pairs = lay.limits.max_tokens * Hq      # (query token, head) pairs
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
                       be.options.fast)

    def live_launches(self, prep: dict) -> tuple:
        """Plain plans: the written plan's forward launches (in :attr:`order`) and its merge
        (``None`` when it needs none)."""
        launches = [prep["launches_by_set"][self.causal][v] for v in self.order]
        for v, ln in zip(self.order, launches):
            ln.set_grid(self.plan_grids[v])
        if not self.needs_merge:
            return launches, None
        per_block, nh = self.merge_key
        mv = cc.MergeVariant(self.head_dim, self.dtype, cc.MERGE_WARPS, nh)   # q's dtype
        pairs = self.batch * self.num_qo_heads
        grid = pairs if per_block else (pairs // nh + mv.warps - 1) // mv.warps
        key = (per_block, nh)
        merge = prep["merges"].get(key)
        if merge is None:
            merge = prep["merges"][key] = self._merge_launch(prep["arrays"], mv, max(1, grid),
                                                             per_block)
        merge.set_grid(max(1, grid))      # its grid follows the batch (params do not)
        return launches, merge
