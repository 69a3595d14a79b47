"""pat as the decode attention of Hugging Face transformers' continuous batching.

Usage (transformers 5.17, ``pip install -e ".[transformers]"``)::

    from pat_core.integrations.transformers import register_pat
    model.set_attn_implementation(register_pat().name)        # "paged|pat"
    outputs = model.generate_batch(prompts, generation_config=gen_cfg)

:func:`register_pat` registers a :class:`PatPagedAttention` under an attention implementation
name with the ``paged|`` prefix, so ``generate_batch`` / ``ContinuousBatchingManager`` keep it
and pass it their per-step metadata.  Per engine step (one forward pass over all layers) it:

1. detects the new step by the identity of the metadata objects the engine builds once per
   step (``read_index``, ``write_index``, ``cu_seq_lens_q``, ``cu_seq_lens_k``), so the layers
   of one step share one decision and one plan;
2. decides whether pat takes the step: every request brings 1 to 16 query tokens
   (``cu_seq_lens_q``) with a cache to read, on a cache of one full-attention layer group;
   otherwise (prefill, mixed prefill and decode, hybrid caches) every layer of the step runs the
   wrapped implementation (``paged|sdpa`` by default), with the block-causal mask the engine
   would have built for it;
3. turns the engine's token read indices into FlashInfer's CSR page form
   (:func:`read_index_to_csr`) and plans once (``qo_indptr`` when a request has several tokens);
4. per layer, writes the new K/V rows into the engine's cache (as the engine's own ``update``
   does), views the cache ``[num_blocks + 2, block_size, num_kv_heads, head_dim]`` (pat's NHD
   layout, no copy; a block is a page) and runs the plan on the backend the tensors are on
   (``"cpu"``: the CPU executor, ``"cuda"``: the kernels).

With the engine's CUDA graphs on (``ContinuousBatchingConfig(use_cuda_graph=True,
use_async_batching=False)``), a hook on the engine's ``ModelRunner.compute_batch`` (installed by
:func:`register_pat`) decides and plans each step before the engine captures or replays its
graph: pat's one-token steps plan into a graph-safe wrapper whose launches the graph holds
(the padded query rows copied into one query buffer all graphs share, the output written to
one output buffer); multi-token steps run pat and the steps pat does not take run the fallback,
both eagerly.

transformers and torch are imported inside the functions that need them: importing this module
needs neither, and ``pat_core`` never imports it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import numpy as np
from numba import njit

from ..inputs import MAX_QO_LEN, _as_int_array, _int64, check_size
from ..wrapper import PrefixAttentionWrapper

#: The transformers releases whose continuous-batching interfaces this module was written
#: against and tested with (the ``transformers`` extra pins the same range).
SUPPORTED_TRANSFORMERS = ">=5.17,<5.18"
_SUPPORTED_MINOR = (5, 17)

#: The wrapped implementations that read the engine's 4-D additive mask.  The engine builds
#: that mask only when its attention implementation is one of them (its ``attn_mask_is_needed``),
#: never for ``paged|pat``, so the fallback path builds it itself.
_MASKED_FALLBACKS = ("paged|sdpa", "paged|eager")


def check_transformers_version(version: str) -> None:
    """``RuntimeError`` unless ``version`` (a transformers ``__version__`` string) is in
    :data:`SUPPORTED_TRANSFORMERS`: the integration reads engine internals (the cache's tensor
    layout, the per-step keyword arguments) that change between minor releases."""
    parts = str(version).split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        raise RuntimeError(f"cannot read the transformers version {version!r}") from None
    if major_minor != _SUPPORTED_MINOR:
        raise RuntimeError(f"pat's transformers integration supports transformers "
                           f"{SUPPORTED_TRANSFORMERS}, found {version}; pass "
                           f"register_pat(check_version=False) to try it anyway")


def read_index_to_csr(read_index, cu_seq_lens_k, page_size: int):
    """The engine's per-token read indices of one step as FlashInfer's CSR page form.

    Parameters
    ----------
    read_index : int ``[n]`` host array, ``n >= cu_seq_lens_k[-1]``: for each request in
        order, the cache row (``page * page_size + offset``) of each of its KV positions
        (past and new tokens); entries past ``cu_seq_lens_k[-1]`` are padding and ignored.
    cu_seq_lens_k : int ``[batch + 1]`` host array, nondecreasing from 0: request ``r`` owns
        ``read_index[cu_seq_lens_k[r]:cu_seq_lens_k[r + 1]]``, at least one position.
    page_size : the cache's block size (tokens per page), ``>= 1``.

    Returns ``(indptr, indices, last_page_len)``: int32 ``[batch + 1]``, ``[num_pages_read]``
    and ``[batch]``, the pages of each request in order and the tokens of its last page.

    ``ValueError`` naming the argument when a request's rows are not whole pages in order
    (position ``p`` of a request at row ``page[p // page_size] * page_size + p % page_size``),
    which is the only layout pat's page tables can express.
    """
    ps = check_size(page_size, "page_size")
    ck = _int_array(cu_seq_lens_k, "cu_seq_lens_k")
    if ck.ndim != 1 or ck.size < 2 or ck[0] != 0:
        raise ValueError("cu_seq_lens_k must be a 1-D array [batch + 1] starting at 0, got "
                         f"shape {ck.shape}")
    lens = np.diff(ck)
    if (lens < 1).any():
        raise ValueError(f"cu_seq_lens_k: request {int(np.argmax(lens < 1))} reads no KV "
                         "position (every request needs at least one)")
    ri = np.ascontiguousarray(_int_array(read_index, "read_index").reshape(-1))
    total = int(ck[-1])
    if ri.size < total:
        raise ValueError(f"read_index has {ri.size} entries but cu_seq_lens_k needs {total}")
    pages_per_req = (lens + ps - 1) // ps
    indptr = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(pages_per_req, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    bad = _pages_of_rows(ri, ck, ps, indptr, indices)
    if bad >= 0:
        raise ValueError(f"read_index: entry {bad} (row {int(ri[bad])}) is not the next row of "
                         f"its request's page (page_size {ps}); pat needs whole pages in order")
    if indices.size and indices.max() > np.iinfo(np.int32).max:
        raise ValueError("read_index: a page id does not fit in int32")
    last_page_len = ((lens - 1) % ps + 1).astype(np.int32)
    return indptr.astype(np.int32), indices.astype(np.int32), last_page_len


@njit(cache=True, nogil=True)
def _pages_of_rows(ri, ck, ps, indptr, indices):
    """One pass over the step's read rows (the engine lists about a million at 256 requests of
    4k tokens, so a vectorised NumPy check of several passes costs 10+ ms): writes each
    request's pages into ``indices`` at ``indptr`` and returns the first entry that is not the
    next row of its page (``-1`` when none is)."""
    for r in range(ck.size - 1):
        base, n = ck[r], ck[r + 1] - ck[r]
        for p in range(indptr[r + 1] - indptr[r]):
            first = ri[base + p * ps]
            if first < 0 or first % ps != 0:
                return base + p * ps
            indices[indptr[r] + p] = first // ps
            for k in range(1, min(ps, n - p * ps)):
                if ri[base + p * ps + k] != first + k:
                    return base + p * ps + k
    return -1


def _int_array(x, name: str) -> np.ndarray:
    """``x`` as int64, any rank; non-integer entries or ints past int64 raise naming ``name``
    (a cast would truncate a float and wrap a large int)."""
    return _int64(_as_int_array(x, name, None), name)


def query_lengths(cu_seq_lens_q):
    """Query tokens per request from ``cu_seq_lens_q`` (int ``[slots + 1]`` host array), with
    the engine's padding slots (zero-length requests after the last real one, present when it
    pads a batch to a fixed shape) dropped: an int64 ``[batch]`` array.  ``ValueError`` for a
    zero-length request before a real one or a decreasing entry."""
    cq = _int_array(cu_seq_lens_q, "cu_seq_lens_q")
    if cq.ndim != 1 or cq.size < 1 or cq[0] != 0:
        raise ValueError("cu_seq_lens_q must be a 1-D array [batch + 1] starting at 0")
    qlen = np.diff(cq)
    if (qlen < 0).any():
        raise ValueError("cu_seq_lens_q must be nondecreasing")
    real = np.flatnonzero(qlen)
    n = int(real[-1]) + 1 if real.size else 0
    if (qlen[:n] == 0).any():
        raise ValueError("cu_seq_lens_q: a zero-length request before the last real one")
    return qlen[:n]


@dataclasses.dataclass
class _Step:
    """What one engine step decided, shared by its layers."""
    key: tuple                  # the step's metadata objects (held, so ids cannot be reused)
    use_pat: bool
    reason: str = ""            # why the step falls back ("" when pat takes it)
    num_tokens: int = 0         # real query rows (padding rows excluded)
    runner: object = None       # what runs a layer (plan_step's result)
    returns_output: bool = False    # runner.run(q, kv) returns its output (plan_step's doc)
    masks: dict = dataclasses.field(default_factory=dict)   # layer type -> fallback mask
    shape_read: bool = False    # a layer call of the step has set the seam's layer shape


class PatPagedAttention:
    """A transformers attention function running pat on decode-like continuous-batching steps.

    Called by the model's attention modules as ``fn(module, query, key, value, attention_mask,
    dropout=..., scaling=..., **engine_kwargs)`` with ``query [1, num_qo_heads, T, head_dim]``
    and ``key``/``value [1, num_kv_heads, T, head_dim]`` (the step's ``T`` new tokens of all
    requests, packed), the engine's ``cache`` (``PagedAttentionCache``), ``read_index`` /
    ``write_index`` (one int64 tensor per layer group), ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    (int32 ``[batch + 1]``); returns ``(attn_output [1, T, num_qo_heads, head_dim] in query's
    dtype, None)``.

    Parameters
    ----------
    name : the implementation name it is registered under (starts with ``"paged|"``).
    fallback : the registered implementation that runs the steps and layers pat does not take.
    packer, gpu : passed to :class:`~pat_core.PrefixAttentionWrapper` (``gpu``: the GPU the CPU
        backend plans for; the CUDA backend detects its own).
    strict : raise instead of falling back when a decode-like step cannot be planned (tests).

    One instance serves one engine at a time (it holds one plan and one query buffer per
    device); engines that generate concurrently each need their own registered name.

    ``stats`` counts steps (``steps``, ``pat_steps``, ``multi_token_steps``), ``plans`` (one per
    pat step), layer calls (``pat_layer_calls``, ``fallback_layer_calls``) and KV tokens over
    the plans (``plan_kv_tokens``: read by the CTAs, one head; ``request_kv_tokens``: the
    requests' sequence lengths; sharing makes the first smaller), ``max_requests`` (the most
    requests of one pat step), ``step_host_s`` (seconds spent deciding and planning steps,
    host copies of the metadata included), ``step_copy_s`` (the part of it copying the
    metadata to the host, which on CUDA includes waiting for the device) and ``layer_host_s``
    (seconds inside the layer calls pat ran, their step's planning included, a step that falls
    back after planning not: in an engine whose step is bound by host work, this is what the
    attention adds to it), ``layer_cpu_s`` (the calling thread's CPU time in those calls:
    ``layer_host_s`` less the time the thread slept, waiting for the GIL or in a blocking call
    that yields the CPU; a device wait that spins, CUDA's default with few contexts, counts
    as CPU time); ``graph_steps`` counts the pat steps run under the engine's CUDA graphs
    (captured or replayed: their layer calls are counted when a graph is captured, twice per
    graph, the engine's warm-up pass and the capture, and add nothing to the layer timers);
    ``last_plan_stats`` is
    :meth:`pat_core.Plan.stats` of the last plan, ``last_seq_lens`` its int64 ``[batch]``
    sequence lengths; ``fallback_reasons`` counts fallback steps by reason.
    """

    #: the decode kernel's name in fallback reasons (a subclass plugging in another says so)
    kernel = "pat"

    def __init__(self, name: str = "paged|pat", fallback: str = "paged|sdpa", *,
                 packer: str = "pat", gpu: str | None = None, strict: bool = False):
        if not isinstance(name, str) or not name.startswith("paged|"):
            raise ValueError(f"name must start with 'paged|' (the engine keeps only paged "
                             f"implementations), got {name!r}")
        if not isinstance(fallback, str) or not fallback.startswith("paged|") or fallback == name:
            raise ValueError(f"fallback must name another registered 'paged|' implementation, "
                             f"got {fallback!r}")
        self.name = name
        self.fallback = fallback
        self.packer = packer
        self.gpu = gpu
        self.strict = bool(strict)
        self._wrappers: dict = {}
        self._q_bufs: dict = {}        # (device, dtype, heads, head_dim) -> query row buffer
        self._step: _Step | None = None
        self._lock = threading.Lock()
        # CUDA-graph steps (the engine hook): the layer shape of the last eager step, the
        # graph-safe wrappers (per device, model shape and engine size), the query and output
        # buffers the captured graphs read and write (kept for good: a graph holds their
        # addresses), and the step being captured or replayed
        self._shape: tuple | None = None
        self._graph_wrappers: dict = {}
        self._graph_bufs: dict = {}
        self._graph_step: _Step | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the counters (``stats``, ``fallback_reasons``, ``last_plan_stats``)."""
        self.stats = {"steps": 0, "pat_steps": 0, "multi_token_steps": 0, "plans": 0,
                      "pat_layer_calls": 0, "fallback_layer_calls": 0,
                      "plan_kv_tokens": 0, "request_kv_tokens": 0, "max_requests": 0,
                      "step_host_s": 0.0, "step_copy_s": 0.0, "layer_host_s": 0.0,
                      "layer_cpu_s": 0.0, "graph_steps": 0}
        self.fallback_reasons: dict = {}
        self._last_plan = None
        self.last_seq_lens: np.ndarray | None = None

    # ------------------------------------------------------------------ per step
    def _wrapper(self, backend: str) -> PrefixAttentionWrapper:
        w = self._wrappers.get(backend)
        if w is None:
            w = PrefixAttentionWrapper(backend=backend, packer=self.packer,
                                       gpu=self.gpu if backend == "cpu" else None)
            self._wrappers[backend] = w
        return w

    def _fall_back(self, key: tuple, reason: str) -> _Step:
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        return _Step(key, False, reason)

    def _new_step(self, key: tuple, kwargs, plan) -> _Step:
        """Decide the step and, when pat takes it, plan it (once for all its layers) with
        ``plan(indptr, indices, last, qo_indptr, cache)`` (:meth:`plan_step`'s arrays; its
        ``ValueError`` / ``TypeError`` make the step fall back)."""
        cache = kwargs["cache"]
        read_index, cu_q, cu_k = kwargs["read_index"], kwargs["cu_seq_lens_q"], \
            kwargs["cu_seq_lens_k"]
        if cache.num_groups != 1 or isinstance(cu_k, dict) or \
                any(w != 1 for w in cache.sliding_windows.values()):
            return self._fall_back(key, "cache with sliding-window or several layer groups")
        if read_index[0].numel() == 0:
            return self._fall_back(key, "no cache read (prefill)")
        # the step's metadata to the host (the first copy waits for the device's queued work)
        t_copy = time.perf_counter()
        cq = cu_q.cpu().numpy()
        self.stats["step_copy_s"] += time.perf_counter() - t_copy
        qlen = query_lengths(cq)
        if qlen.size == 0:
            return self._fall_back(key, "empty step")
        if qlen.max() > MAX_QO_LEN:
            return self._fall_back(key, f"prefill (a request brings more than {MAX_QO_LEN} "
                                        "query tokens)")
        nreq = qlen.size
        t_copy = time.perf_counter()
        ck = cu_k.cpu().numpy()[:nreq + 1].astype(np.int64)
        rows = read_index[0][:int(ck[-1])].cpu().numpy()
        self.stats["step_copy_s"] += time.perf_counter() - t_copy
        seq = np.diff(ck)
        if (seq < qlen).any():
            return self._fall_back(key, "KV shorter than the query")
        try:
            indptr, indices, last = read_index_to_csr(rows, ck, cache.block_size)
        except ValueError as e:
            if self.strict:
                raise
            return self._fall_back(key, f"read_index not in whole pages ({e})")
        qo = None
        if qlen.max() > 1:
            qo = np.zeros(nreq + 1, dtype=np.int32)
            np.cumsum(qlen, out=qo[1:])
        try:
            runner = plan(indptr, indices, last, qo, cache)
        except (ValueError, TypeError) as e:       # a limit the kernel refuses by name
            if self.strict:
                raise
            return self._fall_back(key, f"{self.kernel} refused the step "
                                        f"({type(e).__name__}: {e})")
        self.stats["pat_steps"] += 1
        self.stats["plans"] += 1
        self.stats["multi_token_steps"] += int(qo is not None)
        self.stats["request_kv_tokens"] += int(seq.sum())
        self.stats["max_requests"] = max(self.stats["max_requests"], nreq)
        self.last_seq_lens = seq
        returns = isinstance(runner, PrefixAttentionWrapper) or \
            bool(getattr(runner, "returns_output", False))
        return _Step(key, True, "", int(qlen.sum()), runner, returns)

    def plan_step(self, indptr, indices, last, qo_indptr, query, key_states, scaling, cache):
        """Plan one step for all its layers and return the object whose ``run(q, kv, out=)``
        computes a layer into ``out`` (``[rows, heads, head_dim]``): pat's wrapper for the
        tensors' backend.  A runner with ``returns_output = True`` (pat's wrapper is one) is
        called as ``run(q, kv)`` on steps without padding rows and must return a new
        contiguous ``[rows, heads, head_dim]`` tensor in q's dtype.  The arrays are the step's
        CSR page table (int32 ``[batch + 1]``, ``[pages]``, ``[batch]``) and its int32
        ``[batch + 1]`` ``qo_indptr`` (``None`` when every request brings one token).  This is
        the seam another decode kernel plugs into (override it); ``ValueError`` / ``TypeError``
        make the step fall back."""
        w = self._wrapper("cuda" if query.is_cuda else "cpu")
        plan = w.plan_csr(indptr, indices, last, int(query.shape[1]),
                          int(key_states.shape[1]), int(query.shape[3]),
                          int(cache.block_size), sm_scale=scaling,
                          kv_data_type=cache.key_cache[0].dtype,
                          q_data_type=query.dtype, qo_indptr=qo_indptr)
        self._last_plan = plan
        # KV tokens the plan's CTAs read (one head; Plan.stats' kv_tokens) against those the
        # requests attend to: a shared page is read once per CTA, so sharing shows as the
        # first below the second
        self.stats["plan_kv_tokens"] += int(plan.cta_kv_len.sum(dtype=np.int64))
        return w

    @property
    def last_plan_stats(self) -> dict | None:
        """:meth:`pat_core.Plan.stats` of the last plan (made when read: a step does not pay
        for its tile histogram), ``None`` before the first."""
        return None if self._last_plan is None else self._last_plan.stats()

    # ------------------------------------------------------------------ per layer
    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: float | None = None, **kwargs):
        import torch
        if kwargs.get("cache") is None or "read_index" not in kwargs:
            # not a continuous-batching forward: the wrapped implementation raises its error
            return self._run_fallback(module, query, key, value, attention_mask, dropout,
                                      scaling, kwargs, None)
        # (query.is_cuda, not torch.cuda.is_available(): that one reads the environment
        # and NVML on every call, and this runs per layer)
        if self._graph_step is not None:
            # a step of the engine's CUDA graphs that pat takes, planned by the engine hook
            return self._graph_layer(module, query, key, value, dropout, kwargs)
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.name}: a CUDA graph is being captured around a layer "
                               "call the engine hook did not plan (register_pat installs the "
                               "hook for transformers' continuous batching; other capture "
                               "is not supported)")
        t_call, c_call = time.perf_counter(), time.thread_time()
        step_key = (kwargs["read_index"], kwargs["write_index"], kwargs["cu_seq_lens_q"],
                    kwargs["cu_seq_lens_k"])
        with self._lock:
            step = self._step
            if step is None or any(a is not b for a, b in zip(step_key, step.key)):
                self.stats["steps"] += 1
                t0 = time.perf_counter()
                step = self._new_step(
                    step_key, kwargs, lambda i, x, last, qo, c: self.plan_step(
                        i, x, last, qo, query, key, scaling, c))
                self.stats["step_host_s"] += time.perf_counter() - t0
                self._step = step
            if not step.shape_read:
                # what the engine hook plans CUDA-graph steps with: read at the first layer
                # call of every eager step, also of one the hook decided (the prefill steps
                # before any graph step), so a later model through the seam plans with its own
                self._shape = (int(query.shape[1]), int(key.shape[1]), int(query.shape[3]),
                               scaling, query.dtype, query.device)
                step.shape_read = True
        if not (step.use_pat and _layer_runs_pat(module, dropout, kwargs)):
            return self._run_fallback(module, query, key, value, attention_mask, dropout,
                                      scaling, kwargs, step)
        self.stats["pat_layer_calls"] += 1
        kv = _write_and_view_cache(module, key, value, kwargs)
        n = step.num_tokens
        t_rows, hq, d = int(query.shape[2]), int(query.shape[1]), int(query.shape[3])
        q = self._query_rows(query, n)                       # [n, num_qo_heads, head_dim]
        if n == t_rows and step.returns_output:
            # no padding rows: the kernel's own output ([n, heads, head_dim], contiguous), so
            # no buffer is made here and no caller's buffer is checked on every call
            out = step.runner.run(q, kv).unsqueeze(0)
        else:
            out = query.new_zeros((1, t_rows, hq, d))       # padding rows stay zero
            step.runner.run(q, kv, out=out[0, :n])
        self.stats["layer_host_s"] += time.perf_counter() - t_call
        self.stats["layer_cpu_s"] += time.thread_time() - c_call
        return out, None

    def _query_rows(self, query, n: int):
        """The step's ``n`` real query rows as a contiguous ``[n, num_qo_heads, head_dim]``
        tensor in a buffer kept across layers and steps (one per device, dtype and shape),
        so the CUDA backend sees the same q pointer on every call and reuses its validated
        launch arguments (it caches them per input set) instead of preparing them per layer.
        Stream order keeps a layer's copy behind the previous layer's kernels."""
        hq, d = int(query.shape[1]), int(query.shape[3])
        k = (query.device, query.dtype, hq, d)
        buf = self._q_bufs.get(k)
        if buf is None or buf.shape[0] < n:
            grow = 0 if buf is None else 2 * int(buf.shape[0])
            buf = query.new_empty((max(n, grow), hq, d))
            self._q_bufs[k] = buf
        q = buf[:n]
        q.copy_(query[0, :, :n].transpose(0, 1))
        return q

    def _run_fallback(self, module, query, key, value, attention_mask, dropout, scaling,
                      kwargs, step):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self.stats["fallback_layer_calls"] += 1
        if attention_mask is None and step is not None and self.fallback in _MASKED_FALLBACKS:
            attention_mask = self._fallback_mask(step, module, query, kwargs)
        fn = ALL_ATTENTION_FUNCTIONS[self.fallback]
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                  **kwargs)

    @staticmethod
    def _fallback_mask(step: _Step, module, query, kwargs):
        """The additive block-causal mask ``[1, 1, T, kv_rows]`` (query's dtype) the engine
        builds for ``paged|sdpa`` / ``paged|eager``, made once per step and layer type."""
        import torch
        from transformers.generation.continuous_batching.utils import build_attention_mask
        cache = kwargs["cache"]
        window = cache.sliding_windows[module.layer_idx]
        layer_type = "full_attention" if window == 1 else "sliding_attention"
        mask = step.masks.get(layer_type)
        if mask is not None:
            return mask
        cu_k = kwargs["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k[layer_type]
        group = cache.layer_index_to_group_indices[module.layer_idx][0]
        t_rows = int(query.shape[2])
        kv_rows = int(kwargs["read_index"][group].numel()) or t_rows
        mask = torch.full((1, 1, t_rows, kv_rows), torch.finfo(query.dtype).min,
                          dtype=query.dtype, device=query.device)
        build_attention_mask(mask, kwargs["cu_seq_lens_q"].tolist(), cu_k.tolist(),
                             sliding_window=window)
        step.masks[layer_type] = mask
        return mask

    # ------------------------------------------------------------------ registration
    def register(self) -> "PatPagedAttention":
        """Register this function under its name with transformers' ``AttentionInterface``
        and the engine hook (:meth:`engine_step`); returns it."""
        from transformers import AttentionInterface
        AttentionInterface.register(self.name, self)
        _install_engine_hook()
        _SEAMS[self.name] = self
        return self

    # ------------------------------------------------------------------ CUDA graphs
    def engine_step(self, runner, model, batch_data, compute):
        """One engine step with the engine's CUDA graphs on (called by the hook that
        :func:`register_pat` installs on the engine's ``ModelRunner.compute_batch``; ``compute``
        is the engine's own).  The step is decided and, when pat takes it, planned here on the
        host, before the engine captures or replays its graph, into a graph-safe wrapper's
        device state (``use_cuda_graph=True``, limits from the engine's static sizes), with
        the copy on the engine's compute stream; the graph holds pat's launches, which read
        each step's plan from that state.  A step with several query tokens per request runs
        pat eagerly, and a step pat does not take (prefill, a limit) the fallback: never from a
        graph holding pat's graph-safe kernels."""
        from transformers.generation.continuous_batching.input_outputs import \
            ContinuousBatchingAsyncIOs
        io = runner.inputs_and_outputs
        if isinstance(io, ContinuousBatchingAsyncIOs):
            raise RuntimeError(f"{self.name}: CUDA graphs with async batching are not "
                               "supported; use ContinuousBatchingConfig(use_async_batching="
                               "False)")
        key = (batch_data["read_index"], batch_data["write_index"],
               batch_data["cu_seq_lens_q"], batch_data["cu_seq_lens_k"])
        if io.use_block_table:       # the flash decode path: not a paged|pat step
            return compute(runner, model, batch_data)
        with self._lock:
            self.stats["steps"] += 1
            t0 = time.perf_counter()
            rows = int(batch_data["input_ids"].shape[-1])       # the step's padded tokens
            step = self._new_step(key, batch_data,
                                  lambda i, x, last, qo, c: self.plan_graph_step(
                                      i, x, last, qo, c, io, rows))
            self.stats["step_host_s"] += time.perf_counter() - t0
        if step.use_pat and getattr(step.runner, "use_cuda_graph", False):
            self.stats["graph_steps"] += 1
            self._graph_step = step
            # the engine keys its graphs by the padded query rows and the padded KV read, so
            # a batch whose KV grows captures a new graph every padding interval; a graph
            # step's graph reads no read index (the runner reads its plan from device
            # memory), so its graphs are keyed by the padded query rows alone
            own = io.__dict__.get("_get_graph_key")
            io._get_graph_key = lambda: (GRAPH_KEY_TAG, int(io.num_q_tokens))
            try:
                return compute(runner, model, batch_data)
            finally:
                self._graph_step = None
                if own is None:
                    del io._get_graph_key
                else:
                    io._get_graph_key = own
        # eager (a fallback step, or pat's multi-token plan): its layers find the decision by
        # the metadata's identity; the flag is read by the hook on _get_forward_fn
        self._step = step
        runner._pat_eager = True
        try:
            return compute(runner, model, batch_data)
        finally:
            runner._pat_eager = False

    def plan_graph_step(self, indptr, indices, last, qo_indptr, cache, io, rows: int):
        """Plan a step of the engine's CUDA graphs (:meth:`engine_step`) and return its runner:
        the arrays as :meth:`plan_step`'s, ``io`` the engine's inputs (static sizes, compute
        stream), ``rows`` the step's padded query rows.  A runner whose ``use_cuda_graph`` is
        true runs the step from the graph, as ``run(q, kv, out=)`` on query and output buffers
        of ``rows`` rows (of ``static_limits.max_batch_size`` rows where the runner has
        ``static_limits``, as pat's graph-safe wrapper does), the step's rows first, and must
        read everything that changes from step to step from device memory written here, on
        the compute stream (the engine keys such a step's graph by its padded query rows
        alone, so the graph must not depend on the padded KV read: the read index's length,
        ``max_seqlen_k``); any other runner runs the step eagerly as :meth:`plan_step`'s.
        ``ValueError`` / ``TypeError`` make the step fall back.  pat's: a one-token step into
        the graph-safe wrapper of the layers' device (made at the first such step, for the
        engine's largest step: ``max_batch_tokens`` query rows and the page entries its
        read-index storage can hold); a multi-token step into pat's plain wrapper."""
        import torch
        if self._shape is None:
            raise ValueError("no layer call seen yet (the step's shapes are not known)")
        hq, hk, d, scaling, q_dtype, device = self._shape
        ps = int(cache.block_size)
        kw = dict(sm_scale=scaling, kv_data_type=cache.key_cache[0].dtype, q_data_type=q_dtype)
        stream = io.compute_stream
        # the plan's copy (and a new state's zero-fill) on the stream the step runs on, graph
        # or eager: the engine's compute stream does not wait for the default one
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if qo_indptr is not None:
                # several tokens per request: pat's plain wrapper, run eagerly (a graph-safe
                # state sized for them would run every graph step on the multi-token kernels)
                w = self._wrapper("cuda")
                plan = w.plan_csr(indptr, indices, last, hq, hk, d, ps, qo_indptr=qo_indptr,
                                  **kw)
            else:
                most = int(cache.max_batch_tokens)
                pages = int(io.read_index_storage.shape[-1]) // ps + most
                if rows > most:
                    raise ValueError(f"the step has {rows} padded rows, more than the "
                                     f"engine's max_batch_tokens={most}")
                # one graph-safe wrapper per device, model shape and engine size (a later
                # engine or model gets its own)
                wkey = (device, self._shape, most, pages)
                w = self._graph_wrappers.get(wkey)
                if w is None:
                    w = PrefixAttentionWrapper(backend="cuda", packer=self.packer,
                                               use_cuda_graph=True, max_batch_size=most,
                                               max_num_pages=pages)
                    self._graph_wrappers[wkey] = w
                plan = w.plan_csr(indptr, indices, last, hq, hk, d, ps, **kw)
        self._last_plan = plan
        self.stats["plan_kv_tokens"] += int(plan.cta_kv_len.sum(dtype=np.int64))
        return w

    def _graph_layer(self, module, query, key, value, dropout, kwargs):
        """One layer of a CUDA-graph step (captured once per engine graph, then replayed):
        the cache writes, the step's padded query rows into the query buffer and the run into
        the output buffer (:meth:`_graph_buffers`), whose first rows are returned.  Rows past
        the step's requests hold finite values the engine drops."""
        if not _layer_runs_pat(module, dropout, kwargs):
            raise RuntimeError(f"{self.name}: layer {module.layer_idx} needs an attention pat "
                               "does not run (dropout, sinks, sliding window or softcap), "
                               "which a CUDA-graph step cannot fall back from; turn the "
                               "engine's CUDA graphs off")
        self.stats["pat_layer_calls"] += 1
        kv = _write_and_view_cache(module, key, value, kwargs)
        runner = self._graph_step.runner
        t = int(query.shape[2])
        q, out = self._graph_buffers(runner, query, t)
        q[:t].copy_(query[0].transpose(0, 1))
        runner.run(q, kv, out=out)
        return out[:t].unsqueeze(0), None

    def _graph_buffers(self, runner, query, t: int) -> tuple:
        """The query and output buffers ``[rows, heads, head_dim]`` of a graph step, made
        zeroed at first use and kept: pat's graph-safe wrapper takes one pair of
        ``max_batch_size`` rows for every engine graph (its launches are prepared for one q
        buffer, and later plans are checked against that buffer's rows), another runner a pair
        of the step's ``t`` padded rows (its ``run`` then sees exactly the graph's rows)."""
        hq, d = int(query.shape[1]), int(query.shape[3])
        limits = getattr(runner, "static_limits", None)
        rows = t if limits is None else int(limits.max_batch_size)
        key = (query.device, query.dtype, hq, d, rows)
        bufs = self._graph_bufs.get(key)
        if bufs is None:
            bufs = self._graph_bufs[key] = (query.new_zeros((rows, hq, d)),
                                            query.new_zeros((rows, hq, d)))
        return bufs


def _layer_runs_pat(module, dropout: float, kwargs) -> bool:
    """Whether pat computes this layer's attention: not for training with dropout, attention
    sinks, a per-call sliding window or a logit soft-cap (the wrapped implementation does)."""
    return not ((module.training and dropout > 0) or hasattr(module, "sinks")
                or kwargs.get("sliding_window") is not None or kwargs.get("softcap"))


def _write_and_view_cache(module, key, value, kwargs) -> tuple:
    """Write the step's new K/V rows into the layer's cache, as the engine's ``update()``
    does (rows of ``[T, num_kv_heads, head_dim]`` at ``write_index``; padding rows go to its
    trash block), and return the cache as pat's NHD pages ``(k, v)``, each ``[num_blocks + 2,
    block_size, num_kv_heads, head_dim]`` views (no copy)."""
    cache = kwargs["cache"]
    group, j = cache.layer_index_to_group_indices[module.layer_idx]
    k_cache, v_cache = cache.key_cache[j], cache.value_cache[j]
    write = kwargs["write_index"][group]
    k_cache.index_copy_(0, write, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write, value[0].transpose(0, 1))
    bs = int(cache.block_size)
    shape = (k_cache.shape[0] // bs, bs, k_cache.shape[1], k_cache.shape[2])
    return k_cache.view(shape), v_cache.view(shape)


#: the first element of the engine's graph keys for graph steps a seam runs (the engine's own
#: keys are tuples of sizes, all >= 0)
GRAPH_KEY_TAG = -1

#: the seams registered by name, for the engine hook (register_pat)
_SEAMS: dict = {}
_HOOKED: list = []


def _install_engine_hook() -> None:
    """Wrap transformers' ``ModelRunner.compute_batch`` (once per process) so that a step of a
    model whose attention implementation is a registered seam runs through
    :meth:`PatPagedAttention.engine_step` when the engine's CUDA graphs are on, and
    ``ModelRunner._get_forward_fn`` so that a step the seam runs eagerly does not use a graph.
    Other models and implementations pass through unchanged."""
    if _HOOKED:
        return
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    compute, forward_fn = ModelRunner.compute_batch, ModelRunner._get_forward_fn

    def compute_batch(runner, model, batch_data):
        seam = _SEAMS.get(getattr(model.config, "_attn_implementation", None))
        if seam is None or not runner.use_cuda_graph_varlen:
            return compute(runner, model, batch_data)
        return seam.engine_step(runner, model, batch_data, compute)

    def get_forward_fn(runner, use_block_table):
        fn, use_graph = forward_fn(runner, use_block_table)
        return fn, use_graph and not getattr(runner, "_pat_eager", False)

    ModelRunner.compute_batch = compute_batch
    ModelRunner._get_forward_fn = get_forward_fn
    _HOOKED.append((compute, forward_fn))


def register_pat(name: str = "paged|pat", fallback: str = "paged|sdpa", *,
                 packer: str = "pat", gpu: str | None = None, strict: bool = False,
                 check_version: bool = True) -> PatPagedAttention:
    """Register pat as a transformers attention implementation and return it.

    ``model.set_attn_implementation(register_pat().name)`` then makes ``generate_batch`` and
    ``ContinuousBatchingManager`` run pat on their decode steps and ``fallback`` on the rest
    (see :class:`PatPagedAttention` for the arguments), with the engine's CUDA graphs on or off
    (on: ``use_async_batching=False``; the first call installs the engine hook, see
    :meth:`PatPagedAttention.engine_step`).  ``check_version``: refuse transformers
    releases outside :data:`SUPPORTED_TRANSFORMERS` (``RuntimeError``).  Registering a name
    again replaces the earlier function.
    """
    import transformers
    from transformers import AttentionInterface
    if check_version:
        check_transformers_version(transformers.__version__)
    registered = AttentionInterface().valid_keys()
    if fallback not in registered:
        raise ValueError(f"fallback={fallback!r} is not a registered attention implementation "
                         f"(registered: {sorted(registered)})")
    return PatPagedAttention(name, fallback, packer=packer, gpu=gpu, strict=strict).register()
