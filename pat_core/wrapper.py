"""``PrefixAttentionWrapper``: the public plan()/run() API (FlashInfer-style).

Example (CPU)::

    import numpy as np, pat_core
    from pat_core.workloads import build_tree_batch, random_kv_cache
    batch = build_tree_batch("1,4,16_128,256,1024", page_size=16)
    k, v = random_kv_cache(batch.num_pages, 16, num_kv_heads=8, head_dim=128)
    q = np.random.default_rng(0).standard_normal((batch.batch_size, 32, 128)).astype(np.float32)
    w = pat_core.PrefixAttentionWrapper(backend="cpu", packer="pat")
    w.plan(batch.block_tables, batch.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    out, lse = w.run(q, (k, v), return_lse=True)      # [16, 32, 128], [16, 32]

Backend limits
--------------
==========  ==========================================  =====================================
backend     dtypes (``q`` and the KV cache alike)        ``head_dim``
==========  ==========================================  =====================================
``"cpu"``   float16, float32 (NumPy or CPU torch);       any for which a tile fits the GPU
            bfloat16 (CPU torch tensors only; NumPy      the plan is made for (``gpu=``; H100:
            bfloat16 from ml_dtypes is refused)          4..807 in 16-bit dtypes, 2..414 in
                                                         float32, 8..828 with an fp8 cache)
``"cuda"``  float16, bfloat16 (torch CUDA or CuPy;       64, 128 or 256 (one compiled kernel
            bfloat16 needs torch or ``out=``)            family per head_dim)
==========  ==========================================  =====================================

FP8 caches: ``kv_data_type="float8_e4m3fn"`` with float16 or bfloat16 queries (the one mixed
case), ``run(..., k_scale=, v_scale=)``.  CPU: ml_dtypes ``float8_e4m3fn`` arrays or CPU torch
float8 tensors (bfloat16 queries as CPU torch tensors); CUDA: torch ``float8_e4m3fn`` tensors
or CuPy ``uint8`` arrays holding the e4m3fn bytes.

The CPU executor runs the very tiles the GPU would, so both backends share the planner's
limits: the GQA ratio ``num_qo_heads / num_kv_heads`` may be at most the largest tile's rows
(128 for head_dim 64, 128 and 256; fewer for large head_dims), and ``page_size``, ``seq_lens``
and page ids must fit in int32.  :meth:`PrefixAttentionWrapper.plan` names the limit it hits.
Any page size within that works.  ``q`` and the KV cache share one dtype (except an fp8
cache), fixed at :meth:`PrefixAttentionWrapper.plan`.  Multi-token queries
(``plan(..., qo_indptr=...)``, 1 to 16 query tokens per request, causal among themselves) run on
both backends (the CUDA backend through its multi-token kernel variants; graph-safe wrappers
need ``max_num_qo_tokens``).
"""
from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from .inputs import (byte_extent, check_heads, csr_to_padded, refuse_overlap,
                     refuse_self_overlap)
from .packers import PACKERS
from .fp8 import FLOAT32_MAX, as_scale, kv_cache_dtype
from .plan import KV_ONLY_DTYPES, Plan, dtype_name
from .planner import Planner, fp8_q_dtype
from .reference import split_kv_cache

BACKENDS = ("cpu", "cuda")


def _not_supported(method: str, name: str, value, default) -> None:
    raise ValueError(f"{method}(): {name}={value!r} is not supported by pat (accepted for "
                     f"FlashInfer compatibility; only the default {default!r} works)")


def _check_off(method: str, name: str, value, off: tuple) -> None:
    """Raise the named "not supported" error unless ``value`` is one of the ``off`` values."""
    for o in off:
        if value is o or (o is not None and value is not None and not isinstance(value, bool)
                          and _equal(value, o)):
            return
    _not_supported(method, name, value, off[0])


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _plan_dtypes(kv_data_type, q_data_type) -> tuple:
    """``(kv_dtype, q_dtype)`` canonical names from :meth:`PrefixAttentionWrapper.plan`'s
    arguments: the cache's defaults to ``q_data_type``, else float16; the queries' to the
    cache's (float16 for an fp8 cache).  Mixed precision other than 16-bit queries over an
    fp8 cache raises ``ValueError`` naming both."""
    q_dtype = dtype_name(q_data_type, "q_data_type") if q_data_type is not None else None
    kv_dtype = (dtype_name(kv_data_type, "kv_data_type") if kv_data_type is not None
                else q_dtype or "float16")
    q_dtype = fp8_q_dtype(kv_dtype, q_dtype)    # fp16 by default for an fp8 cache
    if q_dtype != kv_dtype and kv_dtype not in KV_ONLY_DTYPES:
        raise ValueError(f"q_data_type={q_dtype!r} differs from kv_data_type={kv_dtype!r}: "
                         "mixed-precision attention is not supported (q and the KV cache "
                         "share one dtype, except float16/bfloat16 q with a "
                         "float8_e4m3fn cache)")
    return kv_dtype, q_dtype


class PrefixAttentionWrapper:
    """Prefix-aware paged decode attention.

    Parameters
    ----------
    backend : ``"cpu"`` (tile-faithful Numba executor, NumPy / CPU tensors) or ``"cuda"``
        (hand-written kernels through CuPy; torch CUDA tensors or CuPy arrays).  Dtype and
        head_dim limits of each are in the module docstring.
    packer : ``"pat"`` (default), ``"query"``, ``"node"``, ``"compute"`` or ``"cascade"``.
    kv_layout : ``"NHD"`` (``[num_pages, page_size, num_kv_heads, head_dim]``) or ``"HND"``
        (``[num_pages, num_kv_heads, page_size, head_dim]``).
    gpu : GPU model the tile solver plans for (``"h100"``, ``"h200"``, ``"a100"``).  With the
        CUDA backend, the default is the device's own model.
    use_cuda_graph : graph-safe mode (CUDA backend only; FlashInfer's convention).  Device
        buffers are allocated once for the limits below, :meth:`plan` writes each new plan into
        them (an asynchronous copy on the current stream), and :meth:`run` always enqueues the
        same launches with the same arguments: one per tile the planner can pick for batches of
        at most ``max_batch_size`` requests (so a small batch bucket gets few launches), each over a
        fixed grid whose blocks pull work until the live count in device memory, then a merge
        that reads the live batch size from device memory.  A CUDA graph captured around one
        :meth:`run` therefore stays correct for every later plan within the limits.  Replays
        read the ``q``, KV cache and ``out``/``lse`` buffers given at capture: copy each step's
        queries into that ``q`` (it may have ``max_batch_size`` rows; rows past the live batch
        are neither read nor written), and replay on the stream :meth:`plan` ran on (or order
        the two).  Since any graph captured may replay, every later plan must fit the fewest
        ``q`` rows and KV-cache pages of all the inputs :meth:`run` has been given (one set per
        model layer, say): run with buffers of the sizes you capture with.  A plan beyond a
        limit raises ``ValueError`` naming the limit.  The first
        plan fixes the heads, head_dim, page size, dtype, ``sm_scale`` and the launch set (the
        tiles its selector can pick, or the one ``tile=`` forces); ``serial`` is ignored.
        When every CTA fits one 16-row tile (``max_batch_size x`` the GQA group ``<= 16``),
        the planner uses one KV tile width, ``n = 64``, unless its tuning names a table
        (:func:`~pat_core.static_plan.graph_safe_tile_table`): one forward launch, not three.
        A bucket of at most 16 requests whose launch set still has several tiles runs them as
        one fused pull launch (:func:`~pat_core.static_plan.graph_safe_fused`; the CUDA
        backend's ``options.graph_fused``: ``"auto"``, ``"on"``, ``"off"``);
        such a bucket plans with one KV tile width, ``n = 64``
        (:data:`~pat_core.static_plan.FUSED_TILE_TABLE`), and without the tiles whose
        size would cut the fused block's residency
        (:func:`~pat_core.static_plan.fused_pull_exclusions`; at head_dim 128 on the H100,
        ``(32, 64)``: such CTAs take ``(32, 32)``), and, when the fused block still fits one
        per SM, with CTA rows capped below its largest ``m``
        (:func:`~pat_core.static_plan.fused_pull_max_rows`; 64 instead of 128 at 64:8), unless
        its tuning names a table, exclusions or a row cap.  Every other bucket at head_dim
        <= 128 plans with two widths: ``n = 32`` for CTAs of at most 16 rows and 96 tokens,
        ``n = 64`` for the rest (:data:`~pat_core.static_plan.LEAN_TILE_TABLE`): five
        launches where the GPU's table gives eleven or twelve.
    max_batch_size, max_num_pages : graph-safe limits (required with ``use_cuda_graph``):
        requests per step, and block-table entries per step (the sum over requests of
        ``ceil(seq_len / page_size)``).
    max_ctas, max_partials : graph-safe limits on the plan's CTAs and partial result rows
        (defaults ``4 * max_batch_size + 256`` and ``4 * max_num_qo_tokens + max_ctas``; see
        :class:`~pat_core.static_plan.StaticLimits`).
    max_num_qo_tokens : graph-safe limit on the query tokens (q rows) of a step, for
        multi-token queries (``plan(..., qo_indptr=)``).  Default ``None``: one token per
        request, and a multi-token plan is refused.  Given, every replay runs the multi-token
        kernel variants (a captured graph may replay any mix of query lengths up to it).
    """

    def __init__(self, backend: str = "cuda", packer: str = "pat", kv_layout: str = "NHD",
                 gpu: str | None = None, *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None,
                 max_ctas: int | None = None, max_partials: int | None = None,
                 max_num_qo_tokens: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {PACKERS}, got {packer!r}")
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self.backend = backend
        self.packer = packer
        self.kv_layout = kv_layout
        self._gpu_backend = None
        if backend == "cuda":
            from .cuda_backend import CudaBackend
            try:
                self._gpu_backend = CudaBackend()
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n(backend='cuda' needs CuPy and a CUDA GPU; "
                                   f"backend='cpu' runs the same plans with the CPU executor)"
                                   ) from e
            if gpu is None:
                gpu = getattr(self._gpu_backend, "gpu_name", None) or "h100"
        self.planner = Planner(packer, gpu or "h100")
        self._plan: Plan | None = None
        self._failed: str | None = None    # the error of a failed plan() call
        # threading contract (class docstring): calls that overlap in time are refused, and a
        # plan is run by the thread that made it unless run() names it (plan=)
        self._busy = threading.Lock()
        self._owner: int | None = None
        if not isinstance(use_cuda_graph, (bool, np.bool_)):
            raise TypeError(f"use_cuda_graph must be a bool, got {use_cuda_graph!r}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.static_limits = None
        self._static = None            # StaticState, made by the first plan()
        # tuning fields graph-safe mode set before the first plan: {field: value set}, so that a
        # refused first plan undoes them (only where the field still holds that value)
        self._auto_tuning = {}
        if self.use_cuda_graph:
            if backend != "cuda":
                raise ValueError("use_cuda_graph=True needs backend='cuda' (it fixes device "
                                 "buffers and kernel launches for CUDA graph replay)")
            from .static_plan import StaticLimits
            self.static_limits = StaticLimits.make(max_batch_size, max_num_pages, max_ctas,
                                                   max_partials, max_num_qo_tokens)
        elif any(x is not None for x in (max_batch_size, max_num_pages, max_ctas,
                                         max_partials, max_num_qo_tokens)):
            raise ValueError("max_batch_size, max_num_pages, max_ctas, max_partials and "
                             "max_num_qo_tokens are graph-safe limits: pass them with "
                             "use_cuda_graph=True")

    # ------------------------------------------------------------------ plan
    def plan(self, block_tables, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, sm_scale: float | None = None, kv_data_type=None,
             q_data_type=None, tile=None, serial: bool = False, split=True,
             pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True,
             disable_split_kv: bool = False, data_type=None, o_data_type=None,
             fixed_split_size=None, q_len_per_req=None, batch_invariant: bool = False,
             qo_indptr=None) -> Plan:
        """Pack the batch into CTAs and pick tiles.  Host arrays only; no device copies back.

        Parameters
        ----------
        block_tables : int ``[batch, max_blocks]`` (padding past ``ceil(seq_len/page_size)``
            ignored), a list of page lists, or a :class:`~pat_core.inputs.BlockTable` (for
            FlashInfer's CSR form use :meth:`plan_csr`).
        seq_lens : int ``[batch]``, every entry ``>= 1``.
        num_qo_heads, num_kv_heads : head counts; ``num_qo_heads % num_kv_heads == 0``.
        head_dim, page_size : ints (CUDA backend: head_dim 64, 128 or 256).
        sm_scale : softmax scale, default ``1 / sqrt(head_dim)``.
        kv_data_type : dtype of the KV cache (``"float16"``, ``"bfloat16"``, ``"float32"``,
            ``"float8_e4m3fn"``, or a NumPy/torch/ml_dtypes dtype).  Default: ``q_data_type``,
            else ``"float16"``.  Fixed for the plan: :meth:`stats` prices bytes in it (one byte
            per fp8 element) and :meth:`run` refuses a cache of another dtype.  ``data_type``
            is FlashInfer's older name for it.
        q_data_type : dtype of ``q`` and the output; default ``kv_data_type`` (``"float16"``
            for an fp8 cache).  Both executors need it equal to ``kv_data_type``, except that
            an fp8 cache takes ``"float16"`` or ``"bfloat16"`` queries (other mixed precision
            is refused; the :class:`~pat_core.planner.Planner` alone accepts it, for byte
            accounting; fp8 queries are refused everywhere).
        tile : force one ``(m, n)`` for every CTA (the fixed-tile ablation).
        serial : mark the plan level by level (``Plan.serial``, as the ``cascade`` packer
            does; the ``pat`` packer's per-request rule is then off).  No executor launches it
            differently: the CUDA backend runs every plan as the same chained launches.
        split : long-KV split: ``True``/``"sm"`` (default: split CTAs longer than an SM's
            share of the work), ``"mean"`` (the PAT paper's mean rule) or ``False``.
        qo_indptr : several query tokens per request (speculative decoding's draft
            verification; FlashInfer's ragged layout): int ``[batch + 1]`` host array,
            ``qo_indptr[0] == 0``, request ``r`` owning rows ``qo_indptr[r]:qo_indptr[r + 1]``
            of ``q`` and the output, 1 to 16 of them (mixed in a batch).  ``seq_lens`` include
            the new tokens; token ``j`` (0-based) of a request of ``n`` tokens sees the KV
            positions ``< seq_len - n + 1 + j`` (causal among the new tokens).  ``q``, the
            output and the LSE then have ``qo_indptr[-1]`` rows.  A request's tokens share
            its CTAs as the GQA group's heads do (``n x group`` rows, at most the largest
            tile's).  ``None`` (default): one token per request.  Both backends (a graph-safe
            wrapper needs ``max_num_qo_tokens``).
        disable_split_kv : FlashInfer's switch; ``True`` means ``split=False``.
        batch_invariant : ``True``: a request's output and LSE are the same bits whatever else
            is in the batch (same q row, same KV pages and values, same seq_len), on either
            backend.  Every CTA reads inside one fixed KV chunk of absolute positions
            (:func:`pat_core.split.invariant_chunk`, 1024 tokens by default; requests share a
            chunk only where they read exactly the same tokens of it), every CTA has one tile
            (``tile`` if given, else :func:`pat_core.planner.invariant_tile`), ``split`` is
            replaced by the chunks, and the merge takes one fixed layout.  Needs
            ``packer="pat"``; refused with ``use_cuda_graph``.  See docs/design.md.
        non_blocking : accepted and ignored (planning is host work; the CUDA backend's copy
            of the plan is always an asynchronous copy on the current stream, ordered before
            the work enqueued after it).

        FlashInfer options pat does not implement are accepted by name and raise
        ``ValueError("... is not supported ...")`` when set to anything but their default:
        ``pos_encoding_mode`` (only ``"NONE"``: apply RoPE before calling), ``window_left``
        (only ``-1``), ``logits_soft_cap`` (only ``None``/``0``), ``rope_scale``,
        ``rope_theta``, ``fixed_split_size`` (only ``None``), ``q_len_per_req`` (only
        ``None``/``1``; several tokens per request go through ``qo_indptr``, as in
        FlashInfer's prefill wrappers, whose decode wrapper has no such argument) and
        ``o_data_type`` (only ``None`` or ``q_data_type``).

        Returns the :class:`~pat_core.plan.Plan` (also kept for :meth:`run`).  A call that
        raises leaves the wrapper with no runnable plan: :meth:`run` and :meth:`stats` raise,
        naming that error, until a ``plan()`` succeeds (a CUDA graph captured earlier still
        replays whatever its device state last received; do not replay it after a failed plan).
        """
        self._enter("plan")
        # a failed call leaves no runnable plan: run() must not compute the previous batch
        self._plan, self._failed = None, None
        try:
            _check_off("plan", "pos_encoding_mode", pos_encoding_mode, ("NONE",))
            _check_off("plan", "window_left", window_left, (-1, None))
            _check_off("plan", "logits_soft_cap", logits_soft_cap, (None, 0.0))
            _check_off("plan", "rope_scale", rope_scale, (None,))
            _check_off("plan", "rope_theta", rope_theta, (None,))
            _check_off("plan", "fixed_split_size", fixed_split_size, (None,))
            _check_off("plan", "q_len_per_req", q_len_per_req, (None, 1))
            if not isinstance(disable_split_kv, (bool, np.bool_)):
                raise TypeError(f"disable_split_kv must be a bool, got {disable_split_kv!r}")
            if disable_split_kv:
                split = False
            if data_type is not None:
                if kv_data_type is not None and dtype_name(kv_data_type, "kv_data_type") \
                        != dtype_name(data_type, "data_type"):
                    raise ValueError(f"data_type={data_type!r} (FlashInfer's older name for "
                                     f"kv_data_type) disagrees with kv_data_type={kv_data_type!r}")
                kv_data_type = data_type
            kv_dtype, q_dtype = _plan_dtypes(kv_data_type, q_data_type)
            if o_data_type is not None and dtype_name(o_data_type, "o_data_type") != q_dtype:
                _not_supported("plan", "o_data_type", o_data_type, None)
            self._check_backend_limits(head_dim, kv_dtype)
            if not isinstance(batch_invariant, (bool, np.bool_)):
                raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
            if batch_invariant and self.use_cuda_graph:
                # the graph-safe launch sets run other kernels (a fused pull launch, a merge
                # captured with one layout) than the plain path: not checked bit for bit
                raise ValueError("batch_invariant=True is not supported with use_cuda_graph=True "
                                 "(graph-safe launch sets); plan it on a wrapper without CUDA "
                                 "graphs")
            if self.use_cuda_graph and self._static is None:
                self._graph_safe_tuning(num_qo_heads, num_kv_heads, head_dim, kv_dtype, tile)
            plan = self.planner.plan(block_tables, seq_lens, num_qo_heads, num_kv_heads, head_dim,
                                     page_size, sm_scale=sm_scale, kv_data_type=kv_dtype,
                                     q_data_type=q_dtype, tile=tile, serial=serial, split=split,
                                     batch_invariant=bool(batch_invariant),
                                     qo_indptr=qo_indptr)
            if self.use_cuda_graph:
                self._write_static(plan, tile)
            elif self._gpu_backend is not None:
                self._gpu_backend.upload(plan, self._current_stream())
            self._plan = plan
            self._owner = threading.get_ident()
            return plan
        except Exception as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._busy.release()

    def warmup(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
               kv_data_type=None, q_data_type=None, kernels: bool = True,
               jobs: int | None = None) -> None:
        """Load before the first decode step what the first steps would load on first use, so
        that none of them stalls: an engine calls this once at start-up, per configuration.

        - the planner's compiled paths for this configuration (:meth:`pat_core.planner.
          Planner.warmup`: half a second at the first plan, then several milliseconds the
          first time requests grow, leave or join), for int32 and int64 block tables, and the
          CSR conversion of :meth:`plan_csr` for int32 and int64 arrays;
        - on the CUDA backend, the host code that checks and packs a plan for the device and,
          with ``kernels``, every forward kernel the planner can pick for this configuration
          and the merge kernels (1-2 s each the first time a variant is used; compiled in
          ``jobs`` processes, default one per CPU, where the kernel cache has none, loaded
          otherwise).  A graph-safe wrapper compiles its launch set, fused kernels included,
          at its first plan in any case.

        Arguments as :meth:`plan`.  Nothing is planned or allocated for later use: the next
        :meth:`plan` is planned as if this had not run.  Safe to call again (later calls find
        everything loaded)."""
        from .inputs import csr_to_padded
        kv_dtype, q_dtype = _plan_dtypes(kv_data_type, q_data_type)
        self._check_backend_limits(head_dim, kv_dtype)
        plans = self.planner.warmup(num_qo_heads, num_kv_heads, head_dim, page_size,
                                    kv_data_type=kv_dtype, q_data_type=q_dtype)
        bt = plans[0].extra["block_table"]
        csr = bt.to_csr()
        for dt in (np.int32, np.int64):           # plan_csr's conversion, per integer type
            csr_to_padded(*(a.astype(dt) for a in csr), bt.page_size)
        if self._gpu_backend is not None:
            self._gpu_backend.warmup_host(plans)
            if kernels:
                sel = self.planner.tile_selector(head_dim, kv_dtype)
                self._gpu_backend.warmup_configuration(sel.feasible, head_dim, q_dtype,
                                                       kv_dtype, jobs=jobs or os.cpu_count())

    def _graph_safe_tuning(self, num_qo_heads, num_kv_heads, head_dim, kv_dtype, tile) -> None:
        """Before the first graph-safe plan: the planner tuning fields graph-safe mode sets
        where the tuning leaves them unset (:func:`~pat_core.static_plan.graph_safe_tuning`:
        the coarse split parts, the KV tile table, and for a fused bucket the tiles left out
        and the row cap)."""
        from .static_plan import graph_safe_tuning
        # undo what an earlier first plan that was refused set, unless changed since
        undo = {k: None for k, v in self._auto_tuning.items()
                if getattr(self.planner.tuning, k) == v}
        if undo:
            self.planner.tuning = dataclasses.replace(self.planner.tuning, **undo)
        self._auto_tuning = {}
        hq, hk, _ = check_heads(num_qo_heads, num_kv_heads, head_dim)   # the planner's check
        auto = graph_safe_tuning(self.planner.gpu, self.planner.tuning, self.static_limits,
                                 hq // hk, head_dim, kv_dtype, self._graph_fused_mode(), tile)
        if auto:
            self.planner.tuning = dataclasses.replace(self.planner.tuning, **auto)
            # as the tuning holds them (normalised), for the undo's comparison
            self._auto_tuning = {k: getattr(self.planner.tuning, k) for k in auto}

    def _static_max_rows(self, group: int) -> int:
        """Most query rows a CTA of a graph-safe plan can hold
        (:func:`~pat_core.static_plan.graph_safe_max_rows` under the planner's row cap)."""
        from .static_plan import graph_safe_max_rows
        return graph_safe_max_rows(self.static_limits, group, self.planner.tuning.max_rows)

    def _graph_fused_mode(self) -> str:
        """The CUDA backend's ``graph_fused`` setting (``"auto"`` without a backend)."""
        return getattr(self._gpu_backend, "graph_fused", "auto")

    def _write_static(self, plan: Plan, tile) -> None:
        """Graph-safe mode: make the fixed state on the first plan, then copy each plan in."""
        if self._static is None:
            from .static_plan import StaticLayout, graph_safe_launch_set
            tiles, fused = graph_safe_launch_set(
                self.planner.gpu, self.planner.tuning, self.static_limits, plan.group_size,
                plan.head_dim, plan.kv_dtype, self._graph_fused_mode(), tile)
            layout = StaticLayout(self.static_limits, tiles)
            layout.check(plan)          # refuse before allocating anything
            self._static = self._gpu_backend.static_state(
                layout, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                plan.io_dtype, plan.sm_scale, fused=fused, kv_dtype=plan.kv_dtype)
        self._static.write(plan, self._current_stream())

    def _current_stream(self) -> int:
        """The stream plan() copies on: torch's current stream when torch has CUDA set up
        (the usual serving setting), else CuPy's current stream."""
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            from .cuda_launch import _torch_stream_handle    # (torch.cuda.current_stream
            return _torch_stream_handle(torch.cuda.current_device())   # costs ~20 us)
        return int(self._gpu_backend.cp.cuda.get_current_stream().ptr)

    def _check_backend_limits(self, head_dim, kv_dtype: str) -> None:
        if self.backend == "cuda":
            from .cuda_compile import DTYPE_CTYPE, HEAD_DIMS, KV_CTYPE   # the kernel families
            if kv_dtype not in DTYPE_CTYPE and kv_dtype not in KV_CTYPE:
                raise ValueError(f"kv_data_type={kv_dtype!r} is not supported by the CUDA "
                                 f"backend (its kernels take "
                                 f"{', '.join(tuple(DTYPE_CTYPE) + tuple(KV_CTYPE))})")
            if isinstance(head_dim, (int, np.integer)) and head_dim not in HEAD_DIMS:
                raise ValueError(f"head_dim={head_dim} is not supported by the CUDA backend "
                                 f"(kernels exist for head_dim {', '.join(map(str, HEAD_DIMS))})")

    def plan_csr(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, **kwargs) -> Plan:
        """:meth:`plan` from FlashInfer's CSR form (``indptr [batch + 1]``, ``indices [nnz]``,
        ``last_page_len [batch]``, int host arrays); keyword options as :meth:`plan`.  The
        CSR arrays become a padded table (:func:`pat_core.inputs.csr_to_padded`), so a serving
        loop's steps take the planner's incremental path as padded tables do."""
        try:
            table, seq_lens = csr_to_padded(indptr, indices, last_page_len, page_size)
        except Exception as e:      # as plan(): a failed call leaves no runnable plan
            self._enter("plan_csr")
            self._plan, self._failed = None, f"{type(e).__name__}: {e}"
            self._busy.release()
            raise
        return self.plan(table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                         **kwargs)

    @property
    def current_plan(self) -> Plan:
        if self._plan is None:
            if self._failed:
                raise RuntimeError(f"the last plan() call failed ({self._failed}); no plan is "
                                   "runnable until plan() succeeds")
            raise RuntimeError("call plan() before run() or stats()")
        return self._plan

    def stats(self) -> dict:
        """Byte accounting and tile histogram of the current plan, priced in the dtypes fixed at
        :meth:`plan`: ``num_ctas``, ``num_slots``, ``kv_tokens`` (one KV head), ``kv_bytes``
        (all heads), ``q_bytes``, ``partial_bytes``, ``out_bytes``, ``total_bytes``, ``tiles``
        (:meth:`pat_core.plan.Plan.stats` defines each)."""
        return self.current_plan.stats()

    # ------------------------------------------------------------------ run
    def _enter(self, what: str) -> None:
        """Take the wrapper for one call, or ``RuntimeError`` if another thread is inside one."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{what}(): another thread is inside plan() or run() of this "
                               "wrapper; use one wrapper per thread, or order the calls")

    def run(self, q, paged_kv_cache, return_lse: bool = False, *, out=None, lse=None,
            plan: Plan | None = None, q_scale=None, k_scale=None, v_scale=None,
            window_left=None, enable_pdl=None, sinks=None):
        """Attention of every request's query against its paged KV cache.

        Parameters
        ----------
        q : ``[batch, num_qo_heads, head_dim]`` in the plan's ``q_data_type``
            (``[qo_indptr[-1], num_qo_heads, head_dim]`` with ``qo_indptr``).
        paged_kv_cache : ``(k_cache, v_cache)`` 4-D in ``kv_layout``, or the 5-D single tensor
            ``[num_pages, 2, ...]``, in the plan's ``kv_data_type``.
        return_lse : also return the log-sum-exp.
        out : optional ``[batch, num_qo_heads, head_dim]`` buffer in q's dtype, written in
            place and returned (CPU backend: a writable NumPy array or CPU torch tensor, any
            strides; CUDA backend: a device array with a contiguous last dimension).
        lse : optional float32 ``[batch, num_qo_heads]`` buffer, written in place; implies
            ``return_lse``.  Neither may share memory with each other or the inputs.
        plan : the :class:`~pat_core.plan.Plan` this call runs, when the thread calling
            ``run()`` is not the one that made it (see Threading); it must be this wrapper's
            current plan.

        k_scale, v_scale : per-tensor scales of an fp8 (``float8_e4m3fn``) cache, as
            FlashInfer: scores ``sm_scale * q . (k_scale * k)``, output ``softmax @ (v_scale *
            v)``; the LSE is of those scores.  A Python float or int, a NumPy scalar, or a
            one-element array/tensor (read once on the host; a device tensor waits for its
            stream); finite and positive; ``None`` means 1.  Other forms raise ``TypeError`` /
            ``ValueError`` naming the argument.  Caches of other dtypes take only ``None``/``1``.

        FlashInfer's run options ``q_scale`` (only ``None``/``1``), ``window_left`` (only
        ``None``/``-1``), ``enable_pdl`` (only ``None``/``False``) and ``sinks`` (only
        ``None``) are accepted by name; other values raise
        ``ValueError("... is not supported ...")``.

        Returns ``out [batch, num_qo_heads, head_dim]`` in q's dtype and, with ``return_lse``
        (or ``lse``), float32 ``lse [batch, num_qo_heads]`` (natural log of the sum of
        exponentials of the scaled scores); ``qo_indptr[-1]`` rows instead of ``batch`` with
        ``qo_indptr`` (the ``out``/``lse`` buffers too).

        Threading: a wrapper serves one thread at a time.  A call that overlaps another
        thread's ``plan()`` or ``run()`` raises ``RuntimeError``, and so does ``run()`` of a
        plan another thread made unless it is passed as ``plan=``: a step planned on one thread
        and run on another says so, and two threads that interleave plan/run on one wrapper get
        an error, never the other's batch.  For steps in flight at once, use one wrapper each.

        Pipelining (CUDA backend): ``plan()`` does host work and puts its device copy on the
        calling thread's current stream, behind the work already queued there, so once the
        current step's last ``run()`` has returned the next step can be planned, on this thread
        or another (then run it with ``plan=``), while the current step's kernels still run.
        One wrapper and one stream serve such a loop, since the copy reaches the device state
        only after the kernels that read the last plan.  The planning thread's current stream
        must be the one the steps run on (torch's is per thread: ``with
        torch.cuda.stream(s):``).  ``plan()`` waits for the device only to reuse a pinned
        staging buffer whose copy, issued two plans earlier, has not run yet, and to replace a
        device state used on more than 8 streams (its growth otherwise allocates, no wait).
        """
        self._enter("run")
        try:
            cur = self.current_plan
            if plan is not None:
                if plan is not cur:
                    raise ValueError("plan= is not this wrapper's current plan (the last plan() "
                                     "made another); call plan() again for it")
            elif self._owner != threading.get_ident():
                raise RuntimeError("run(): the current plan was made by another thread; pass it "
                                   "as run(..., plan=...) if that is intended")
            return self._run(q, paged_kv_cache, return_lse, out=out, lse=lse, q_scale=q_scale,
                             k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                             enable_pdl=enable_pdl, sinks=sinks)
        finally:
            self._busy.release()

    def _run(self, q, paged_kv_cache, return_lse: bool = False, *, out=None, lse=None,
             q_scale=None, k_scale=None, v_scale=None, window_left=None, enable_pdl=None,
             sinks=None):
        """The body of :meth:`run`, under its guard."""
        plan = self.current_plan
        if (self._gpu_backend is not None and not self.use_cuda_graph
                and type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2
                and all(hasattr(a, "shape") and hasattr(a, "dtype")
                        for a in (q, *paged_kv_cache))
                and q_scale is None and k_scale is None and v_scale is None
                and window_left is None and enable_pdl is None and sinks is None
                and (return_lse is False or return_lse is True)):
            # the decode loop's call (every option at its default, the cache as a pair of
            # arrays): the backend validates an input set once (pointers, shapes, strides,
            # dtypes) and runs these checks then, so a layer's later calls skip them
            k_cache, v_cache = paged_kv_cache
            return self._gpu_backend.run(plan, q, k_cache, v_cache, kv_layout=self.kv_layout,
                                         return_lse=return_lse or lse is not None, out=out,
                                         lse=lse, check=self._input_checks(plan, q,
                                                                           paged_kv_cache))
        _check_off("run", "q_scale", q_scale, (None, 1.0))
        if plan.kv_dtype in KV_ONLY_DTYPES:
            scales = (as_scale(k_scale, "k_scale"), as_scale(v_scale, "v_scale"))
            # both backends fold k_scale into the softmax scale, one float32
            if plan.sm_scale * scales[0] > FLOAT32_MAX:
                raise ValueError(f"k_scale={scales[0]} times the plan's sm_scale="
                                 f"{plan.sm_scale} exceeds the float32 range the kernels "
                                 "hold the softmax scale in")
        else:
            # a 16/32-bit cache holds its values as they are: the kernels of those dtypes take
            # no scales (their code stays as it was), so a scale other than 1 is refused
            for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
                _check_off("run", name, val, (None, 1.0))
            scales = None
        # the GPU backend gets the scales of an fp8 cache only (its other calls are unchanged)
        gpu_kw = {} if scales is None else {"scales": scales}
        _check_off("run", "window_left", window_left, (None, -1))
        _check_off("run", "enable_pdl", enable_pdl, (None, False))
        _check_off("run", "sinks", sinks, (None,))
        _check_array(q, "q")
        k_cache, v_cache = split_kv_cache(paged_kv_cache, self.kv_layout)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        want_lse = bool(return_lse or lse is not None)
        if self._gpu_backend is not None and not self.use_cuda_graph:
            return self._gpu_backend.run(plan, q, k_cache, v_cache, kv_layout=self.kv_layout,
                                         return_lse=want_lse, out=out, lse=lse,
                                         check=self._input_checks(plan, q, paged_kv_cache),
                                         **gpu_kw)
        if self._gpu_backend is None:
            for t, name in ((q, "q"), (k_cache, "paged_kv_cache"), (v_cache, "paged_kv_cache")):
                _check_cpu_array(t, name)
        self._check_run_dtypes(plan, q, k_cache, v_cache)
        if self.use_cuda_graph:
            return self._gpu_backend.run_static(self._static, q, k_cache, v_cache,
                                                kv_layout=self.kv_layout, return_lse=want_lse,
                                                out=out, lse=lse, **gpu_kw)
        qdt = _dtype_of(q)
        B, Hq, D = plan.num_qo_tokens, plan.num_qo_heads, plan.head_dim
        # check the caller's buffers before the work, so a bad one costs nothing
        if out is not None:
            _check_host_buffer(out, "out", (B, Hq, D), qdt)
        if lse is not None:
            _check_host_buffer(lse, "lse", (B, Hq), "float32")
        outs = {n: _host_extent(b) for n, b in (("out", out), ("lse", lse)) if b is not None}
        if outs:
            refuse_overlap(outs, {"q": _host_extent(q), "k_cache": _host_extent(k_cache),
                                  "v_cache": _host_extent(v_cache)})
        from .executor import execute             # checks its inputs against the plan
        out_dtype = np.float16 if qdt == "float16" else np.float32
        res, res_lse = execute(plan, q, k_cache, v_cache, kv_layout=self.kv_layout,
                               return_lse=True, input_dtype=qdt, out_dtype=out_dtype,
                               **({} if scales is None else
                                  {"k_scale": scales[0], "v_scale": scales[1]}))
        torch_in = hasattr(q, "detach")
        if out is not None:
            _write_host(out, res)
        elif torch_in:                        # CPU torch in, CPU torch out (q's dtype)
            import torch
            out = torch.from_numpy(res).to(q.dtype)
        else:
            out = res
        if not want_lse:
            return out
        if lse is not None:
            _write_host(lse, res_lse)
        elif torch_in:
            import torch
            lse = torch.from_numpy(res_lse)
        else:
            lse = res_lse
        return out, lse

    def _input_checks(self, plan: Plan, q, paged_kv_cache):
        """The checks of ``q`` and the cache against ``plan``, as a callable the CUDA backend
        runs only when it validates a new input set (plan, pointers, shapes, strides,
        dtypes): a decode loop pays for them once per layer, not per call."""
        def check():
            _check_array(q, "q")
            k_cache, v_cache = split_kv_cache(paged_kv_cache, self.kv_layout)
            self._check_run_dtypes(plan, q, k_cache, v_cache)
            plan.check_inputs(q, k_cache, v_cache, self.kv_layout)
        return check

    @staticmethod
    def _check_run_dtypes(plan: Plan, q, k_cache, v_cache) -> None:
        qdt = _dtype_of(q)
        want_q = plan.q_dtype or plan.kv_dtype
        if qdt in KV_ONLY_DTYPES:
            raise TypeError(f"q is {qdt}: a KV-cache-only dtype; queries must be float16 or "
                            f"bfloat16 (the plan's q_data_type is {want_q!r})")
        if qdt != want_q:
            raise TypeError(f"q is {qdt} but plan() fixed q_data_type={want_q!r}; plan again "
                            f"with q_data_type={qdt!r} (stats() prices bytes in the plan's "
                            "dtypes)")
        for t in (k_cache, v_cache):
            kdt = kv_cache_dtype(t)
            if kdt != plan.kv_dtype:
                raise TypeError(f"paged_kv_cache is {kdt} but plan() fixed "
                                f"kv_data_type={plan.kv_dtype!r}; plan again with "
                                f"kv_data_type={kdt!r}")


def _check_array(x, name: str) -> None:
    """``TypeError`` naming ``name`` unless ``x`` is an array with a shape and a dtype."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (NumPy, torch or CuPy) with a shape and a "
                        f"dtype, got {type(x).__name__}; wrap nested lists with np.asarray")


def _check_cpu_array(x, name: str) -> None:
    """The CPU backend takes bfloat16 only as CPU torch tensors: NumPy has no bfloat16 of its
    own, and an ml_dtypes array would come back as another dtype."""
    if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16":
        raise TypeError(f"{name} is a NumPy bfloat16 (ml_dtypes) array; backend='cpu' takes "
                        "bfloat16 only as CPU torch tensors (NumPy arrays must be float16 or "
                        "float32)")


def _dtype_of(x, name: str = "q") -> str:
    return dtype_name(getattr(x, "dtype", None), name)


def _host_extent(a) -> tuple:
    """Byte range of a NumPy array or CPU tensor (:func:`pat_core.inputs.byte_extent`)."""
    if hasattr(a, "data_ptr") and hasattr(a, "stride"):        # torch tensor
        return byte_extent(a.data_ptr(), tuple(a.shape), a.stride(), a.element_size())
    a = np.asarray(a)
    lo, hi = byte_extent(a.__array_interface__["data"][0], a.shape, a.strides, 1)  # byte strides
    return (lo, hi + a.itemsize - 1) if hi > lo else (lo, hi)


def _check_host_buffer(buf, name: str, shape: tuple, dtype: str) -> None:
    """``buf`` must be a writable host array (NumPy or CPU torch) of ``shape`` and ``dtype``."""
    if hasattr(buf, "detach") and hasattr(buf, "device"):        # torch tensor
        if str(buf.device) != "cpu":
            raise TypeError(f"{name} is on {buf.device}; the CPU backend writes host buffers "
                            "(NumPy arrays or CPU tensors)")
        if buf.requires_grad:
            raise ValueError(f"{name} requires grad; pass a tensor that can be written in place")
    elif not isinstance(buf, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array or CPU tensor for backend='cpu', got "
                        f"{type(buf).__name__}")
    elif not buf.flags.writeable:
        raise ValueError(f"{name} is read-only")
    if tuple(int(x) for x in buf.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(buf.shape)}, expected {shape}")
    bdt = dtype_name(getattr(buf, "dtype", None), name)
    if bdt != dtype:
        raise TypeError(f"{name} is {bdt}, expected {dtype}")
    strides = buf.stride() if hasattr(buf, "detach") else \
        tuple(st // buf.itemsize for st in buf.strides)
    refuse_self_overlap(name, shape, strides)


def _write_host(buf, values: np.ndarray) -> None:
    """Copy ``values`` into the checked host buffer ``buf`` (any strides)."""
    if isinstance(buf, np.ndarray):
        np.copyto(buf, values, casting="unsafe")
    else:
        import torch
        with torch.no_grad():
            buf.copy_(torch.from_numpy(np.ascontiguousarray(values)))
