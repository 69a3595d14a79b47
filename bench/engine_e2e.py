"""pat against the engine's own paged attention, end to end in transformers' continuous batching.

    python bench/engine_e2e.py --model llama8b --workload sysprompt --requests 128 --out FILE.json

Builds a Llama model from its config with random weights (no downloads; ``--model llama8b``:
Llama-3.1-8B's shapes, ``gqa-small``: a 1B-class GQA model, ``tiny``: a CPU smoke model) and
runs ``generate_batch`` (greedy, ``--new-tokens``, block sharing on, CUDA graphs off: pat plans
on the host per step; an ``--impls`` entry ending in ``+graph``, e.g. ``paged|sdpa+graph``,
runs that implementation with the engine's CUDA graphs on, async batching off as pat's
graph steps need; a graph replay calls no forward hook and the engine pads every step's query
length, so such a run reports no per-step fields, decode steps or profile, only the token
timings, the engine's per-call times and the seam's counters) per attention implementation of
``--impls``: once to warm up
(``--warmup-tokens``), ``--repeats`` times timed, and (``--profile-tokens`` > 0) once more
with the attention function and the model's forward timed per call.  Workloads (random token ids):

* ``sysprompt``: one shared system prompt of ``--prompt-tokens`` + a short own suffix per request;
* ``sampling``: ``--requests / --samples`` distinct prompts, each sent ``--samples`` times
  (parallel sampling as the block manager sees it: the copies share the prompt's full blocks;
  transformers 5.17's ``generate_batch`` returns one sample per prompt with
  ``num_return_sequences``, so the copies are separate requests);
* ``agent``: ``--templates`` shared templates of ``--prompt-tokens``; each session adds its own
  history and sends ``--turns`` turns, each turn's prompt extending the previous one;
* ``none``: distinct prompts of the same lengths, nothing shared.

The timed runs are repeated (``--repeats``, interleaved across the implementations, the order
reversed every other round) and the repeat with the median decode throughput is reported, with
every repeat's throughput and, against ``--reference``, each round's throughput and step-time
ratios and their medians (``paired_vs_reference``; the table's "paired" column).  Per
implementation it reports the timed run's wall time (and the engine's set-up within it);
prefill and decode from the engine's per-token timestamps (``record_timestamps``), counted
from the requests' creation: time to first token per request, the decode
window (from the moment every request has its first token to the last token), its output tokens
and throughput, time per output token (per request, its later tokens over their span,
median); the engine's steps (a forward hook, no device sync) split into decode-like (every
request brings at most 16 query tokens, pat's rule) and prefill steps, with the host time from
one step's start to the next.  The engine's own host work per step is timed too (median ms
per call of ``prepare_next_batch`` and ``update_batch``): with CUDA graphs off the engine builds
every request's per-token read indices in Python at each step, which can outweigh the
attention.  For ``paged|pat`` (and ``paged|fi-decode``): its ``stats`` (steps, planned steps,
plans, host seconds deciding and planning, the part of them copying the step's metadata to the
host) and, per decode step, the host time deciding and planning (median, max, and its copy
part), the median as a share of the median decode step.

``paged|fi-decode`` plugs FlashInfer's batch decode wrapper into the same seam as pat
(:func:`register_flashinfer_decode`): the fair kernel comparison inside the engine.

Each run also records the engine thread's resource use per decode step and per call of the
engine's host methods (``usage()``: CPU time, page faults, context switches, the process's CPU
time) and the growth of torch's CUDA allocator counters (``cuda_allocator``): what tells a
slower host step's causes apart (more work, memory given back and faulted in again, sleeping,
other threads, a device-synchronising allocation).  ``--probe`` adds one run per
implementation that waits for the device before each step's ``prepare_next_batch`` and times
the wait (``probe``: the previous step's GPU work still queued then).

The profiled run gives the attention share of a decode step: the time inside the
registered attention function over the model's forward (CUDA events on a GPU, ``perf_counter``
on the CPU), summed over the decode-like steps; it wraps the function under its own name for
that run only, so the timed run is untouched.

Correctness: the first ``--check-tokens`` greedy tokens of every request against the
``--reference`` implementation's (``paged|sdpa``): requests identical and, per differing
request, the first divergence and each run's log-probability of its own token there (the
engine's ``return_logprobs``; a tie in the logits shows as two equal values), plus the largest
log-probability difference over the tokens before any divergence.

Implementations that fail to load or run (``paged|flash_attention_2`` without flash-attn) are
recorded with the reason and skipped.  Writes JSON (``--out``) and prints a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time

import numpy as np

if __package__ in (None, ""):                  # run as a script: the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_name, git_sha, write_result  # noqa: E402

import pat_core  # noqa: E402
from pat_core.inputs import MAX_QO_LEN  # noqa: E402

#: LlamaConfig arguments of the benchmark models (random weights; ``--layers`` cuts layers).
MODELS = {
    # Llama-3.1-8B's shapes
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                    rms_norm_eps=1e-5),
    # a 1B-class GQA model (4:1, head_dim 128)
    "gqa-small": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5),
    # CPU smoke runs
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=8192),
}
WORKLOADS = ("sysprompt", "sampling", "agent", "none")
DTYPES = ("bfloat16", "float16", "float32")
PAT_IMPL = "paged|pat"
FI_IMPL = "paged|fi-decode"


def register_flashinfer_decode(name: str = FI_IMPL):
    """Register FlashInfer's batch decode kernel through pat's engine seam and return it.

    The same :class:`~pat_core.integrations.transformers.PatPagedAttention` steps (one plan
    per engine step from the same CSR page table, the same K/V writes and query buffer, the
    same fallback to ``paged|sdpa`` for prefill and multi-token steps); only
    ``plan_step`` differs: it plans a ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``
    (tensor cores when a KV head serves >= 4 query heads, as in ``bench/compare.py``), so the
    engine's time with it against ``paged|pat`` compares the two kernels and their planning.
    Under the engine's CUDA graphs (``paged|fi-decode+graph``) ``plan_graph_step`` plans
    FlashInfer's CUDA-graph wrapper, one per padded row count (it fixes its batch size)."""
    import flashinfer
    import torch
    from pat_core.integrations.transformers import PatPagedAttention

    class _Runner:
        returns_output = True      # FlashInfer's run allocates its output, as pat's does

        def __init__(self, w, graph=False):
            self.w = w
            self.use_cuda_graph = graph

        def run(self, q, kv, out=None):
            return self.w.run(q, kv, out=out)

    class FlashInferDecode(PatPagedAttention):
        kernel = "FlashInfer decode"

        def plan_step(self, indptr, indices, last, qo_indptr, query, key_states, scaling,
                       cache):
            if qo_indptr is not None:
                raise ValueError("a multi-token step (the decode kernel takes one token per "
                                 "request)")
            if not query.is_cuda:
                raise ValueError("FlashInfer runs on CUDA tensors only")
            hq, hk, d = int(query.shape[1]), int(key_states.shape[1]), int(query.shape[3])
            w = self._wrappers.get((hq, hk, d))
            if w is None:
                ws = torch.zeros(256 << 20, dtype=torch.uint8, device=query.device)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=hq // hk >= 4)
                self._wrappers[(hq, hk, d)] = w
            w.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
                   hq, hk, d, int(cache.block_size), sm_scale=scaling,
                   q_data_type=query.dtype, kv_data_type=cache.key_cache[0].dtype)
            return _Runner(w)

        def plan_graph_step(self, indptr, indices, last, qo_indptr, cache, io, rows):
            # FlashInfer's CUDA-graph decode wrapper fixes its batch size: one wrapper per
            # padded row count (one per engine graph), the batch padded to ``rows`` requests
            # that read one page each (page 0: finite values in rows the engine drops)
            if qo_indptr is not None:
                raise ValueError("a multi-token step (the decode kernel takes one token per "
                                 "request)")
            if self._shape is None:
                raise ValueError("no layer call seen yet")
            hq, hk, d, scaling, q_dtype, device = self._shape
            ps, n = int(cache.block_size), int(indptr.shape[0]) - 1
            pad = rows - n
            if pad < 0:
                raise ValueError(f"{n} requests in {rows} rows")
            indptr = np.concatenate([indptr, indptr[-1] + np.arange(1, pad + 1)]).astype(np.int32)
            indices = np.concatenate([indices, np.zeros(pad, np.int32)]).astype(np.int32)
            last = np.concatenate([last, np.ones(pad, np.int32)]).astype(np.int32)
            stream = io.compute_stream
            # the buffers' zero-fill and the plan's copies on the stream the step runs on
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                w = self._graph_fi.get(rows)
                if w is None:
                    pages = int(io.read_index_storage.shape[-1]) // ps + \
                        int(cache.max_batch_tokens)
                    i32 = dict(dtype=torch.int32, device=device)
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        torch.zeros(64 << 20, dtype=torch.uint8, device=device), "NHD",
                        use_cuda_graph=True, use_tensor_cores=hq // hk >= 4,
                        paged_kv_indptr_buffer=torch.zeros(rows + 1, **i32),
                        paged_kv_indices_buffer=torch.zeros(pages, **i32),
                        paged_kv_last_page_len_buffer=torch.zeros(rows, **i32))
                    self._graph_fi[rows] = w
                w.plan(torch.from_numpy(indptr), torch.from_numpy(indices),
                       torch.from_numpy(last), hq, hk, d, ps, sm_scale=scaling,
                       q_data_type=q_dtype, kv_data_type=cache.key_cache[0].dtype)
            return _Runner(w, graph=True)

    fn = FlashInferDecode(name)
    fn._graph_fi = {}          # padded rows -> FlashInfer's CUDA-graph wrapper
    return fn.register()


# ---------------------------------------------------------------- workloads
def build_workload(kind: str, requests: int, prompt_tokens: int, vocab: int, seed: int, *,
                   suffix=(16, 64), samples: int = 8, templates: int = 4,
                   turns: int = 4) -> tuple:
    """``(prompts, info)``: ``requests`` prompts (lists of token ids in ``[3, vocab)``) of the
    workload ``kind`` (see the module docstring) and a dict describing it (distinct prompts,
    shared tokens, prompt tokens in all).  ``suffix``: ``(lo, hi)`` own tokens per request."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {kind!r}")
    if requests < 1 or prompt_tokens < 1:
        raise ValueError(f"requests and prompt_tokens must be >= 1, got {requests}, "
                         f"{prompt_tokens}")
    lo, hi = suffix
    if not 1 <= lo <= hi:
        raise ValueError(f"suffix must be (lo, hi) with 1 <= lo <= hi, got {suffix}")
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(3, vocab, int(n)).tolist()

    def own():
        return toks(rng.integers(lo, hi + 1))

    if kind == "sysprompt":
        system = toks(prompt_tokens)
        prompts = [system + own() for _ in range(requests)]
        info = dict(shared_prompts=1, shared_tokens=prompt_tokens)
    elif kind == "none":
        prompts = [toks(prompt_tokens) + own() for _ in range(requests)]
        info = dict(shared_prompts=0, shared_tokens=0)
    elif kind == "sampling":
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        distinct = [toks(prompt_tokens) + own() for _ in range(-(-requests // samples))]
        prompts = [p for p in distinct for _ in range(samples)][:requests]
        info = dict(shared_prompts=len(distinct), samples=samples)
    else:
        if templates < 1 or turns < 1:
            raise ValueError(f"templates and turns must be >= 1, got {templates}, {turns}")
        temps = [toks(prompt_tokens) for _ in range(templates)]
        history_len = max(turns, prompt_tokens // 4)
        prompts = []
        s = 0
        while len(prompts) < requests:
            history = toks(history_len)
            for t in range(turns):
                # turn t: the template, the first (t+1)/turns of the history, a new message
                cut = (t + 1) * history_len // turns
                prompts.append(temps[s % templates] + history[:cut] + own())
            s += 1
        prompts = prompts[:requests]
        info = dict(shared_prompts=templates, shared_tokens=prompt_tokens, sessions=s,
                    turns=turns, history_tokens=history_len)
    info.update(requests=len(prompts), prompt_tokens_total=int(sum(map(len, prompts))),
                prompt_tokens_max=int(max(map(len, prompts))))
    return prompts, info


# ---------------------------------------------------------------- model
def build_model(name: str, dtype: str, device: str, layers: int | None = None, seed: int = 0):
    """A ``LlamaForCausalLM`` of ``MODELS[name]`` with random weights, made on ``device`` in
    ``dtype`` (``layers``: keep the first that many layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kw = dict(MODELS[name])
    if layers is not None:
        if not 1 <= layers:
            raise ValueError(f"layers must be >= 1, got {layers}")
        kw["num_hidden_layers"] = int(layers)
    cfg = LlamaConfig(**kw)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))   # initialise in place: no fp32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval(), kw


# ---------------------------------------------------------------- timing helpers
#: usage() fields: the calling thread's CPU seconds, its minor and major page faults, its
#: voluntary and involuntary context switches, and the whole process's CPU seconds
USAGE_FIELDS = ("cpu_s", "minflt", "majflt", "nvcsw", "nivcsw", "process_cpu_s")


def usage() -> tuple:
    """The calling thread's resource counters (``USAGE_FIELDS``; Linux's per-thread
    ``getrusage``, the process's where the platform has none).  A step whose wall time grows
    without its CPU time was asleep (a lock, the GIL, a blocking call); one whose CPU time grows
    with its page faults paid for memory the allocator gave back and took again; process CPU
    beyond the thread's is other threads' work."""
    import resource
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    p = resource.getrusage(resource.RUSAGE_SELF) if who != resource.RUSAGE_SELF else r
    return (r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_majflt, r.ru_nvcsw, r.ru_nivcsw,
            p.ru_utime + p.ru_stime)


def usage_medians(prefix: str, deltas) -> dict:
    """Median per call of each ``usage()`` field's growth (rows of ``deltas``), named
    ``<prefix>_<field>_median`` (seconds as ms)."""
    d = np.asarray(deltas, dtype=float).reshape(-1, len(USAGE_FIELDS))
    out = {}
    for i, f in enumerate(USAGE_FIELDS):
        v = float(np.median(d[:, i])) if d.shape[0] else None
        if f.endswith("_s"):
            f, v = f[:-2] + "_ms", None if v is None else v * 1e3
        out[f"{prefix}_{f}_median"] = v
    return out


class StepRecorder:
    """Forward hooks on the model that note each engine step (one forward): its host start
    time and whether it is decode-like (the engine's ``max_seqlen_q`` <= 16).  With
    ``events=True`` it also times each forward and each call of the attention function
    (:meth:`wrap`) on the device (CUDA events; ``perf_counter`` on the CPU)."""

    def __init__(self, model, events: bool = False, seam=None):
        import torch
        self.seam = seam         # a PatPagedAttention: its host seconds noted at each step
        self.cuda = next(model.parameters()).is_cuda
        self.events = events
        self.steps = []          # dicts: t (host start), decode, fwd (start, end), attn [(s, e)]
        self._torch = torch
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]

    def _mark(self):
        if self.cuda:
            e = self._torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        step = dict(t=time.perf_counter(), decode=int(kwargs.get("max_seqlen_q", 0) or 0)
                    <= MAX_QO_LEN, attn=[], usage=usage())
        if self.seam is not None:
            step["host"] = self._host_counters()
        if self.events:
            step["fwd"] = [self._mark(), None]
        self.steps.append(step)

    def _host_counters(self) -> tuple:
        st = self.seam.stats
        return (st["step_host_s"], st["step_copy_s"], st["layer_host_s"], st["layer_cpu_s"])

    def _post(self, module, args, output):
        if self.events and self.steps:
            self.steps[-1]["fwd"][1] = self._mark()

    def wrap(self, fn):
        """``fn`` with its calls timed into the current step."""
        def timed(*a, **kw):
            start = self._mark()
            out = fn(*a, **kw)
            if self.steps:
                self.steps[-1]["attn"].append((start, self._mark()))
            return out
        return timed

    def remove(self):
        for h in self._handles:
            h.remove()

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self) -> dict:
        """Step counts and host ms from one step's start to the next (decode-like steps);
        with events, the device ms of the forwards and attention calls of decode steps."""
        ts = [s["t"] for s in self.steps]
        gaps = np.diff(ts) * 1e3
        dec_gaps = [g for s, g in zip(self.steps, gaps) if s["decode"]]
        out = dict(steps=len(self.steps),
                   decode_steps=sum(s["decode"] for s in self.steps),
                   decode_step_ms_median=float(np.median(dec_gaps)) if dec_gaps else None)
        # the engine thread's resources from one decode step's start to the next
        use = np.diff(np.array([s["usage"] for s in self.steps], dtype=float), axis=0)
        out.update(usage_medians("step", use[[s["decode"] for s in self.steps[:-1]]]))
        if self.seam is not None and self.steps:
            # a step's host seconds: the counters' growth until the next step starts
            marks = np.array([s["host"] for s in self.steps] + [self._host_counters()])
            per = np.diff(marks, axis=0) * 1e3
            dec = per[[s["decode"] for s in self.steps]]
            if dec.size:
                # attn_host: the host time of the step's attention calls, planning included;
                # a host-bound engine step grows by it, so implementations through the same
                # seam compare by it more steadily than by their throughput
                out.update(host_step_ms_median=float(np.median(dec[:, 0])),
                           host_step_ms_max=float(dec[:, 0].max()),
                           host_copy_ms_median=float(np.median(dec[:, 1])),
                           attn_host_ms_median=float(np.median(dec[:, 2])),
                           # the part of it on the CPU (the rest: asleep, for the GIL or
                           # in a blocking call that yields; a spinning device wait is CPU)
                           attn_cpu_ms_median=float(np.median(dec[:, 3])))
        if self.events:
            if self.cuda:
                self._torch.cuda.synchronize()
            fwd = attn = 0.0
            n = 0
            for s in self.steps:
                if not s["decode"] or s["fwd"][1] is None:
                    continue
                fwd += self._ms(*s["fwd"])
                attn += sum(self._ms(a, b) for a, b in s["attn"])
                n += 1
            out.update(profiled_decode_steps=n,
                       forward_ms_per_decode_step=fwd / n if n else None,
                       attention_ms_per_decode_step=attn / n if n else None,
                       attention_share=attn / fwd if fwd > 0 else None)
        return out


class EngineHostTimer:
    """Times the engine's own work per step while it is installed: transformers 5.17's
    ``ContinuousBatchProcessor.prepare_next_batch`` (scheduling, and the per-token read and
    write indices of every request), ``ModelRunner.compute_batch`` (the forward: eager
    launches, or the step's graph capture or replay; with a seam's engine hook, its planning
    too), ``ModelRunner._capture_graph`` (inside ``compute_batch``: a graph's warm-up forward
    and capture), ``ContinuousBatchingIOs.retrieve_device_outputs`` (the sampled tokens to the
    host: the wait for the step's GPU work) and ``ContinuousBatchProcessor.update_batch`` (the
    tokens back into the requests), each wrapped on its class and restored by
    :meth:`remove`."""

    METHODS = ("prepare_next_batch", "compute_batch", "_capture_graph",
               "retrieve_device_outputs", "update_batch")

    def __init__(self, sync_probe: bool = False):
        from transformers.generation.continuous_batching import (continuous_api,
                                                                 input_outputs, model_runner)
        import torch
        owner = {"prepare_next_batch": continuous_api.ContinuousBatchProcessor,
                 "update_batch": continuous_api.ContinuousBatchProcessor,
                 "compute_batch": model_runner.ModelRunner,
                 "_capture_graph": model_runner.ModelRunner,
                 "retrieve_device_outputs": input_outputs.ContinuousBatchingIOs}
        self._owner = owner
        self.times = {m: [] for m in self.METHODS}
        self.order = []          # method names in call order (which call a capture was in)
        self.usage = {m: [] for m in self.METHODS}
        # sync_probe: wait for the device before each prepare_next_batch and time the wait
        # (the previous step's GPU work still queued then); it removes that overlap, so a
        # run with it measures where the step's time goes, not the throughput
        self.backlog = [] if sync_probe and torch.cuda.is_available() else None
        self._sync = torch.cuda.synchronize
        self._orig = {m: getattr(owner[m], m) for m in self.METHODS}
        for m in self.METHODS:
            setattr(owner[m], m, self._timed(m, self._orig[m]))

    def _timed(self, name, fn):
        times, use = self.times[name], self.usage[name]
        probe = self.backlog if name == "prepare_next_batch" else None
        order = self.order

        def timed(*a, **kw):
            order.append(name)
            if probe is not None:
                t = time.perf_counter()
                self._sync()
                probe.append(time.perf_counter() - t)
            u, t = usage(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times.append(time.perf_counter() - t)
                use.append(np.subtract(usage(), u))
        return timed

    def remove(self):
        for m in self.METHODS:
            setattr(self._owner[m], m, self._orig[m])

    def summary(self) -> dict:
        """Median ms per call of each method (``engine_<method>_ms_median``), the medians of
        its resource use (``usage_medians``, ``engine_<method>_<field>_median``) and, with the
        probe, the median device wait before ``prepare_next_batch`` (``gpu_backlog_ms_median``);
        every call's ms in call order (``engine_calls``: [method, ms]; the medians mix
        prefill, capture and replay steps, the list tells them apart; with CUDA graphs the
        engine's warm-up captures come first, ``compute_batch`` calls with no
        ``prepare_next_batch`` before them)."""
        out = {f"engine_{m.lstrip('_')}_ms_median": float(np.median(ts)) * 1e3 if ts else None
               for m, ts in self.times.items()}
        seen = {m: iter(ts) for m, ts in self.times.items()}
        out["engine_calls"] = [[m.lstrip("_"), round(next(seen[m]) * 1e3, 3)]
                               for m in self.order]
        for m, use in self.usage.items():
            out.update(usage_medians(f"engine_{m.lstrip('_')}", use))
        if self.backlog is not None:
            out["gpu_backlog_ms_median"] = (float(np.median(self.backlog)) * 1e3
                                            if self.backlog else None)
        return out


def token_metrics(outputs: list, t0: float, t1: float) -> dict:
    """Prefill / decode split from the engine's per-token timestamps (``perf_counter``).

    ``setup_s``: from the call to the first request's creation (the engine's manager and
    cache set-up, which differs between implementations: for ``paged|sdpa`` the engine allocates
    and fills a mask buffer of ``max_batch_tokens`` x the cache's tokens, seconds on the CPU at
    its default sizes); the other times count from there."""
    start = min(o.created_time for o in outputs)
    firsts = np.array([o.timestamps[0] for o in outputs]) - start
    lasts = np.array([o.timestamps[-1] for o in outputs]) - start
    n_out = sum(len(o.generated_tokens) for o in outputs)
    all_first = float(firsts.max())                 # every request has its first token
    end = float(lasts.max())
    decode_tokens = int(sum(int((np.asarray(o.timestamps) - start > all_first).sum())
                            for o in outputs))
    decode_s = end - all_first
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1)
            for o in outputs if len(o.timestamps) > 1]
    return dict(wall_s=t1 - t0, setup_s=start - t0, run_s=end, output_tokens=n_out,
                output_tokens_per_s=n_out / end if end > 0 else None,
                ttft_s_median=float(np.median(firsts)), ttft_s_max=all_first,
                decode_window_s=decode_s, decode_tokens=decode_tokens,
                decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None,
                tpot_ms_median=float(np.median(tpot)) * 1e3 if tpot else None)


# ---------------------------------------------------------------- one implementation
#: an implementation name ending in it runs with the engine's CUDA graphs on
GRAPH_SUFFIX = "+graph"


def base_impl(impl: str) -> tuple:
    """``(registered name, CUDA graphs on)`` of an ``--impls`` entry (``GRAPH_SUFFIX``)."""
    if impl.endswith(GRAPH_SUFFIX):
        return impl[:-len(GRAPH_SUFFIX)], True
    return impl, False


def generate(model, impl: str, prompts: list, new_tokens: int, args, *, timestamps=False):
    """``generate_batch`` greedy with block sharing on; the outputs in request order."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    name, graphs = base_impl(impl)
    model.set_attn_implementation(name)
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                  max_batch_tokens=args.max_batch_tokens,
                                  allow_block_sharing=True, use_cuda_graph=graphs,
                                  use_async_batching=False,
                                  return_logprobs=not args.no_logprobs)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb,
                               record_timestamps=timestamps, progress_bar=False)
    if len(out) != len(prompts):
        raise RuntimeError(f"{impl}: generate_batch returned {len(out)} of {len(prompts)} "
                           "requests")
    ordered = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[1]))
    for o in ordered:
        if o.error:
            raise RuntimeError(f"{impl}: request {o.request_id} failed: {o.error}")
    return ordered


def sync(model):
    import torch
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


class GcTimer:
    """Python's garbage collections during a run, per generation: their count and the time they
    took (``gc.callbacks``; removed by :meth:`remove`).  A collection stops whatever thread
    triggered it, the engine's step included, and its cost grows with every tracked object in
    the process (the model, the engine's per-request lists), not with the triggering code."""

    def __init__(self):
        import gc
        self._gc = gc
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            g = int(info["generation"])
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t
            self._t = None

    def remove(self):
        if self._cb in self._gc.callbacks:
            self._gc.callbacks.remove(self._cb)

    def summary(self) -> dict:
        return {"gc_collections": list(self.count),
                "gc_ms": [round(t * 1e3, 3) for t in self.seconds]}


#: torch's CUDA allocator counters a run reports the growth of (cudaMalloc / cudaFree calls;
#: retries: a failed cudaMalloc made it free its cache, synchronising the device, and retry)
ALLOC_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def alloc_counters(model) -> np.ndarray:
    import torch
    if not next(model.parameters()).is_cuda:
        return np.zeros(len(ALLOC_COUNTERS), dtype=np.int64)
    st = torch.cuda.memory_stats()
    return np.array([st.get(k, 0) for k in ALLOC_COUNTERS], dtype=np.int64)


def timed_run(model, impl: str, prompts: list, args, pat_fn=None,
              sync_probe: bool = False) -> tuple:
    """``(row, outputs)``: one timed ``generate_batch`` of ``impl`` (``pat_fn``: its
    PatPagedAttention when it runs through pat's seam, for its counters; ``sync_probe``:
    :class:`EngineHostTimer`'s device-wait probe)."""
    if pat_fn is not None:
        pat_fn.reset_stats()
    rec = StepRecorder(model, seam=pat_fn)
    host = EngineHostTimer(sync_probe)
    gct = GcTimer()
    alloc0 = alloc_counters(model)
    try:
        sync(model)
        t0 = time.perf_counter()
        outs = generate(model, impl, prompts, args.new_tokens, args, timestamps=True)
        sync(model)
        t1 = time.perf_counter()
    finally:
        rec.remove()
        host.remove()
        gct.remove()
    alloc = dict(zip(ALLOC_COUNTERS, (alloc_counters(model) - alloc0).tolist()))
    row = dict(impl=impl, status="ok", **token_metrics(outs, t0, t1), **rec.summary(),
               **host.summary(), **gct.summary(), cuda_allocator=alloc)
    if pat_fn is not None:
        s = dict(pat_fn.stats)
        row["seam_stats"] = s
        row["seam_fallback_reasons"] = dict(pat_fn.fallback_reasons)
        if s["pat_steps"]:
            row["host_plan_ms_per_step_mean"] = s["step_host_s"] / s["pat_steps"] * 1e3
            step_ms = row["decode_step_ms_median"]
            if step_ms and row.get("host_step_ms_median") is not None:
                row["host_plan_share"] = row["host_step_ms_median"] / step_ms
    return row, outs


#: what a probe run (``--probe``) reports
PROBE_KEYS = ("gpu_backlog_ms_median", "decode_step_ms_median",
              "engine_prepare_next_batch_ms_median", "engine_prepare_next_batch_cpu_ms_median",
              "attn_host_ms_median", "attn_cpu_ms_median")


def probe_run(model, impl: str, prompts: list, args, pat_fn=None) -> dict:
    """One more run of ``impl`` that waits for the device before each step's
    ``prepare_next_batch`` and times the wait: how much of the previous step's GPU work was
    still queued when the engine's host work for the next began (``PROBE_KEYS``)."""
    row, _ = timed_run(model, impl, prompts, args, pat_fn, sync_probe=True)
    return {k: row.get(k) for k in PROBE_KEYS}


def profile_run(model, impl: str, prompts: list, args) -> dict:
    """Device time of the forward and of the attention calls per decode step (a run of
    ``--profile-tokens`` with the attention function wrapped under its own name)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    fn = ALL_ATTENTION_FUNCTIONS[impl]
    prof = StepRecorder(model, events=True)
    AttentionInterface.register(impl, prof.wrap(fn))
    try:
        generate(model, impl, prompts, args.profile_tokens, args)
        sync(model)
    finally:
        AttentionInterface.register(impl, fn)
        prof.remove()
    p = prof.summary()
    return {k: p[k] for k in ("profiled_decode_steps", "forward_ms_per_decode_step",
                              "attention_ms_per_decode_step", "attention_share")}


def median_row(runs: list) -> dict:
    """The repeat with the median decode throughput (the lower middle one of an even count),
    with every repeat's throughput and median decode step listed."""
    order = sorted(runs, key=lambda r: r["decode_tokens_per_s"] or 0.0)
    row = dict(order[(len(order) - 1) // 2])
    row["repeats"] = len(runs)
    row["repeat_decode_tokens_per_s"] = [r["decode_tokens_per_s"] for r in runs]
    row["repeat_decode_step_ms_median"] = [r["decode_step_ms_median"] for r in runs]
    if "attn_host_ms_median" in row:
        row["repeat_attn_host_ms_median"] = [r.get("attn_host_ms_median") for r in runs]
        row["repeat_attn_cpu_ms_median"] = [r.get("attn_cpu_ms_median") for r in runs]
    if "gc_ms" in row:
        row["repeat_gc_ms"] = [r.get("gc_ms") for r in runs]
        row["repeat_gc_collections"] = [r.get("gc_collections") for r in runs]
    return row


def paired_ratios(rows: dict, ref: str) -> dict:
    """Per implementation (other than ``ref``), its timed runs against ``ref``'s of the same
    round: decode throughput over the reference's, and the reference's median decode step
    over its own, each round's value and the median.  Runs of one round are minutes apart at
    most, so these ratios carry less of the drift between rounds than the medians do."""
    base = rows.get(ref)
    if not isinstance(base, list):
        return {}
    out = {}
    for impl, runs in rows.items():
        if impl == ref or not isinstance(runs, list):
            continue
        tput = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for a, b in zip(runs, base)
                if a["decode_tokens_per_s"] and b["decode_tokens_per_s"]]
        step = [b["decode_step_ms_median"] / a["decode_step_ms_median"]
                for a, b in zip(runs, base)
                if a["decode_step_ms_median"] and b["decode_step_ms_median"]]
        out[impl] = dict(reference=ref, decode_tokens_per_s=tput,
                         decode_tokens_per_s_median=float(np.median(tput)) if tput else None,
                         decode_step=step,
                         decode_step_median=float(np.median(step)) if step else None)
    return out


def compare_tokens(ref: list, got: list, check: int, limit: int = 20) -> dict:
    """Requests whose first ``check`` tokens equal the reference's; the first ``limit``
    divergences (request, index, both tokens, both log-probabilities when recorded)."""
    same, divs, lp_diff = 0, [], 0.0
    for r, (a, b) in enumerate(zip(ref, got)):
        ta, tb = list(a.generated_tokens[:check]), list(b.generated_tokens[:check])
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if k is None and len(ta) == len(tb):
            same += 1
        upto = len(ta) if k is None else k
        if a.logprobs and b.logprobs and upto:
            lp_diff = max(lp_diff, float(np.max(np.abs(np.asarray(a.logprobs[:upto])
                                                       - np.asarray(b.logprobs[:upto])))))
        if k is not None and len(divs) < limit:
            d = dict(request=r, index=k, ref_token=int(ta[k]), token=int(tb[k]))
            if a.logprobs and b.logprobs:
                d.update(ref_logprob=float(a.logprobs[k]), logprob=float(b.logprobs[k]))
            divs.append(d)
    return dict(requests=len(ref), identical=same, check_tokens=check,
                max_logprob_diff_before_divergence=lp_diff if ref and ref[0].logprobs else None,
                divergences=divs)


# ---------------------------------------------------------------- main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--workload", default="sysprompt", choices=WORKLOADS)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=4096,
                    help="shared prompt (template) tokens; distinct prompts' length for none")
    ap.add_argument("--suffix", default="16,64", help="lo,hi own tokens per request")
    ap.add_argument("--samples", type=int, default=8, help="sampling: copies per prompt")
    ap.add_argument("--templates", type=int, default=4, help="agent: shared templates")
    ap.add_argument("--turns", type=int, default=4, help="agent: turns per session")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="new tokens of the warm-up run (same prompts; 0: none)")
    ap.add_argument("--profile-tokens", type=int, default=16,
                    help="new tokens of the profiled run (attention share; 0: none)")
    ap.add_argument("--probe", action="store_true",
                    help="one more run per implementation that times the device wait before "
                         "each step's host work (the GPU work still queued; see probe_run)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per implementation, interleaved; the median is reported")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--impls", default=f"paged|sdpa {PAT_IMPL}",
                    help="space-separated registered implementations ('paged|pat': pat)")
    ap.add_argument("--reference", default="paged|sdpa", help="tokens are compared with it")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="default: the engine sizes it")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--no-logprobs", action="store_true",
                    help="do not ask the engine for log-probabilities")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    for name in ("requests", "prompt_tokens", "new_tokens", "check_tokens", "block_size",
                 "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_tokens < 0 or args.profile_tokens < 0:
        raise SystemExit("--warmup-tokens and --profile-tokens must be >= 0")
    return args


def print_table(rows: list, correctness: dict, ref: str) -> None:
    base = next((r for r in rows if r["impl"] == ref and r["status"] == "ok"), None)
    print(f"{'impl':<26}{'run s':>8}{'dec tok/s':>11}{'vs ref':>8}{'TPOT ms':>9}"
          f"{'TTFT max s':>11}{'steps':>7}{'dec':>6}{'prep ms':>8}{'attn %':>8}{'plan %':>8}"
          f"{'attn host ms':>13}{'paired':>8}{'same':>9}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['impl']:<26}skipped: {r['reason'][:90]}")
            continue

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        rel = (r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
               if base and r["decode_tokens_per_s"] and base["decode_tokens_per_s"] else None)
        share = r.get("profile", {}).get("attention_share")
        plan = r.get("host_plan_share")
        c = correctness.get(r["impl"])
        print(f"{r['impl']:<26}{r['run_s']:>8.2f}{f(r['decode_tokens_per_s'], '.1f'):>11}"
              f"{f(rel, '.3f'):>8}{f(r['tpot_ms_median'], '.2f'):>9}{r['ttft_s_max']:>11.2f}"
              f"{r['steps']:>7}{r['decode_steps']:>6}"
              f"{f(r.get('engine_prepare_next_batch_ms_median'), '.1f'):>8}"
              f"{f(None if share is None else 100 * share, '.1f'):>8}"
              f"{f(None if plan is None else 100 * plan, '.1f'):>8}"
              f"{f(r.get('attn_host_ms_median'), '.2f'):>13}"
              f"{f(r.get('paired_vs_reference', {}).get('decode_tokens_per_s_median'), '.3f'):>8}"
              f"{(str(c['identical']) + '/' + str(c['requests'])) if c else '-':>9}")


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import AttentionInterface
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lo, hi = (int(x) for x in args.suffix.split(","))
    model, model_cfg = build_model(args.model, args.dtype, device, args.layers, args.seed)
    prompts, info = build_workload(args.workload, args.requests, args.prompt_tokens,
                                   model_cfg["vocab_size"], args.seed + 1, suffix=(lo, hi),
                                   samples=args.samples, templates=args.templates,
                                   turns=args.turns)
    impls = args.impls.split()
    seam_fns = {}          # implementation -> its PatPagedAttention (pat's, or FlashInfer's)
    rows, outputs = {}, {}
    # warm-up per implementation (an implementation that cannot load or run is recorded)
    for impl in impls:
        try:
            name = base_impl(impl)[0]
            if name in (PAT_IMPL, FI_IMPL):
                if name not in seam_fns:
                    if name == PAT_IMPL:
                        from pat_core.integrations.transformers import register_pat
                        seam_fns[name] = register_pat(PAT_IMPL)
                    else:
                        seam_fns[name] = register_flashinfer_decode(FI_IMPL)
                seam_fns[impl] = seam_fns[name]
            elif name not in AttentionInterface().valid_keys():
                raise ValueError(f"{impl!r} is not a registered attention implementation")
            if args.warmup_tokens > 0:
                generate(model, impl, prompts, args.warmup_tokens, args)
            rows[impl] = []
        except Exception as e:
            rows[impl] = dict(impl=impl, status="skipped", reason=f"{type(e).__name__}: {e}")
    # timed runs, the implementations interleaved: a host-bound engine's step time drifts
    # between runs of one process (one implementation's repeats were seen 37% apart), so one
    # run each in a fixed order would credit the drift to an implementation
    # and the order reversed every other round (A B, B A, ...), so a drift within a round
    # favours neither; each round's ratios to the reference are reported beside the medians
    for rep in range(args.repeats):
        for impl in (impls if rep % 2 == 0 else impls[::-1]):
            if isinstance(rows[impl], dict):
                continue
            try:
                row, outs = timed_run(model, impl, prompts, args, seam_fns.get(impl))
                rows[impl].append(row)
                outputs.setdefault(impl, outs)
            except Exception as e:
                rows[impl] = dict(impl=impl, status="skipped",
                                  reason=f"{type(e).__name__}: {e}")
                outputs.pop(impl, None)
    paired = paired_ratios(rows, args.reference)
    for impl in impls:
        if isinstance(rows[impl], list):
            rows[impl] = median_row(rows[impl])
            if impl in paired:
                rows[impl]["paired_vs_reference"] = paired[impl]
            # (a graph replay calls no forward hook: nothing to profile under graphs)
            if args.profile_tokens > 0 and not base_impl(impl)[1]:
                rows[impl]["profile"] = profile_run(model, impl, prompts, args)
            if args.probe:
                rows[impl]["probe"] = probe_run(model, impl, prompts, args, seam_fns.get(impl))
        print(f"{impl}: {rows[impl]['status']}", flush=True)
    rows = [rows[impl] for impl in impls]
    correctness = {}
    if args.reference in outputs:
        check = min(args.check_tokens, args.new_tokens)
        for impl, outs in outputs.items():
            if impl != args.reference:
                correctness[impl] = compare_tokens(outputs[args.reference], outs, check)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    result = dict(
        benchmark="engine_e2e", git_sha=git_sha(),
        command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        device=dict(kind=device, name=dev_name, cpu=cpu_name(), cores=os.cpu_count()),
        versions=dict(python=platform.python_version(), numpy=np.__version__,
                      torch=torch.__version__, transformers=transformers.__version__,
                      pat=pat_core.__version__),
        config=dict(model=args.model, model_config=model_cfg, dtype=args.dtype,
                    workload=args.workload, workload_info=info, new_tokens=args.new_tokens,
                    warmup_tokens=args.warmup_tokens, profile_tokens=args.profile_tokens,
                    block_size=args.block_size, num_blocks=args.num_blocks,
                    max_batch_tokens=args.max_batch_tokens, allow_block_sharing=True,
                    use_cuda_graph=[i for i in impls if base_impl(i)[1]],
                    return_logprobs=not args.no_logprobs,
                    reference=args.reference, seed=args.seed),
        impls=rows, correctness=correctness,
    )
    write_result(args.out, result)
    print_table(rows, correctness, args.reference)
    return result


if __name__ == "__main__":
    main()
