"""Tile-faithful CPU executor: runs a :class:`~pat_core.plan.Plan` the way the GPU kernels do.

Same CTAs, same ``(m, n)`` tiles, same page gathering, same arithmetic contract:

* scores ``s = sm_scale * q . k`` accumulated in fp32 over ``head_dim``;
* online softmax over KV tiles of ``n`` tokens: running max ``m``, running sum ``l`` (fp32),
  fp32 output accumulator rescaled by ``exp(m_old - m_new)`` after each tile;
* the probabilities are rounded to the input dtype (fp16 or bf16) before ``P . V``, as the
  tensor-core kernels feed them to ``mma`` (no rounding for fp32 inputs);
* each CTA writes its fp32 partial ``o / l`` and natural-log ``lse = m + log(l)`` to its slots,
  then :func:`~pat_core.merge.merge_partials` combines each request's slots.  (On the GPU a
  request of one slot gets its output from its CTA directly; merging one slot returns it
  unchanged, so the results are the same.)

Non-finite input propagates as in dense attention: a NaN in ``q``, or a NaN/infinity in a key
or value, makes NaN (or infinite) output and LSE for exactly the rows that read it; a key whose
score is ``-inf`` gets weight 0, and a CTA whose keys all score ``-inf`` writes the empty state
``(0, -inf)``, as the CUDA kernel does.

Each query row is computed by scalar loops of its own (scores, softmax, ``P . V``): its bits
depend on its q row, the CTA's KV range and ``n``, never on the CTA's other rows or their
number (no BLAS call whose code path changes with the row count), as on the GPU, where each
row is an ``mma`` row with its own softmax state.  Batch-invariant plans rely on it
(``tests/test_batch_invariant.py``).

A multi-token plan (``qo_indptr``) runs through its :meth:`~pat_core.plan.Plan.token_view`:
every query token is a row set of its own (``group`` rows), reading the q row and writing the
partial row the view names; in a CTA the view flags, a position at or past a token's causal
limit scores ``-inf`` and its value is not read, so a non-finite value there reaches only the
tokens that may see it.

Padding rows of a tile (``rows < m``) are skipped rather than computed on zeros: they are never
written on the GPU either, so the results are identical and the executor is faster.

:func:`trace_cta` replays one CTA tile by tile and records the softmax state after each tile,
for the tutorials.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .fp8 import as_scale
from .merge import merge_partials
from .plan import KV_ONLY_DTYPES, Plan

_ROUND = {"float32": (0, 0), "float16": (11, -14), "bfloat16": (8, -126)}


@njit(cache=True)
def _round_mantissa(x, bits, min_exp):
    """Round a non-negative float to ``bits`` significant bits (round half to even), with
    subnormals below ``2**min_exp`` as the target format has them.  ``bits == 0``: no rounding."""
    if bits == 0 or x == 0.0:
        return x
    mant, e = math.frexp(x)                # x = mant * 2**e, mant in [0.5, 1)
    if e - 1 < min_exp:                    # subnormal: fixed quantum 2**(min_exp - bits + 1)
        q = math.ldexp(1.0, min_exp - bits + 1)
        return np.float32(np.rint(x / q) * q)
    return np.float32(math.ldexp(np.rint(math.ldexp(mant, bits)), e - bits))


@njit(cache=True)
def _run_ctas(q, kc, vc, cta_req_indptr, cta_req, cta_slot, cta_kv_start, cta_kv_len,
              cta_page_indptr, cta_pages, cta_n, page_size, group, sm_scale, round_bits,
              round_min_exp, cta_kv_limit, cta_causal, o_part, lse_part):
    """Forward pass of every CTA for every KV head, over a plan's :class:`~pat_core.plan.
    TokenView` (``cta_req``: each pair's query token, ``cta_slot``: its partial row).
    ``kc``/``vc``: float32 NHD views ``[num_pages, page_size, num_kv_heads, head_dim]``; ``q``
    float32 ``[N, Hq, d]``; writes ``o_part [num_partial_rows, Hq, d]`` / ``lse_part
    [num_partial_rows, Hq]``.  In a CTA with ``cta_causal`` set, a token scores the positions
    past its ``cta_kv_limit`` (counted from the CTA's start) ``-inf``."""
    C = cta_kv_len.shape[0]
    num_kv_heads = kc.shape[2]
    d = kc.shape[3]
    for c in range(C):
        r0 = cta_req_indptr[c]
        nreq = cta_req_indptr[c + 1] - r0
        rows = nreq * group
        masked = cta_causal[c] != 0
        n = cta_n[c]
        start = cta_kv_start[c]
        end = start + cta_kv_len[c]
        first_page = start // page_size
        pbase = cta_page_indptr[c]
        s = np.empty((rows, n), dtype=np.float32)
        for h in range(num_kv_heads):
            m_run = np.full(rows, -np.inf, dtype=np.float32)
            l_run = np.zeros(rows, dtype=np.float32)
            acc = np.zeros((rows, d), dtype=np.float32)
            for t0 in range(start, end, n):
                t1 = min(t0 + n, end)
                cols = t1 - t0
                # S = scale * Q K^T for this tile (fp32 accumulation); positions at or past a
                # token's causal limit score -inf (weight 0), as the masked kernel does
                for j in range(cols):
                    t = t0 + j
                    page = cta_pages[pbase + t // page_size - first_page]
                    slot = t % page_size
                    for i in range(rows):
                        if masked and t - start >= cta_kv_limit[r0 + i // group]:
                            s[i, j] = -np.inf
                            continue
                        r = cta_req[r0 + i // group]
                        hq = h * group + i % group
                        dot = np.float32(0.0)
                        for x in range(d):
                            dot += q[r, hq, x] * kc[page, slot, h, x]
                        s[i, j] = dot * sm_scale
                # online softmax update, then acc += P V
                for i in range(rows):
                    mx = m_run[i]
                    for j in range(cols):
                        if s[i, j] > mx:
                            mx = s[i, j]
                    # subtract 0 while every score so far is -inf (an infinite key), so
                    # that (-inf) - (-inf) never makes a NaN; a NaN score never wins the
                    # max, its exp is NaN and it reaches l and the output
                    m_use = mx if mx > -np.inf else np.float32(0.0)
                    alpha = np.float32(math.exp(m_run[i] - m_use)) if m_run[i] > -np.inf \
                        else np.float32(0.0)
                    l_run[i] *= alpha
                    for x in range(d):
                        acc[i, x] *= alpha
                    lim = cta_kv_limit[r0 + i // group] if masked else cols + t0 - start
                    for j in range(cols):
                        t = t0 + j
                        if t - start >= lim:
                            # a position this token may not see: no weight, and its value is
                            # not read (a non-finite one must not reach the output)
                            continue
                        p = np.float32(math.exp(s[i, j] - m_use))
                        l_run[i] += p
                        pr = _round_mantissa(p, round_bits, round_min_exp)
                        page = cta_pages[pbase + t // page_size - first_page]
                        slot = t % page_size
                        for x in range(d):
                            acc[i, x] += pr * vc[page, slot, h, x]
                    m_run[i] = mx
            for i in range(rows):
                row = cta_slot[r0 + i // group]
                hq = h * group + i % group
                if l_run[i] == 0.0:           # every key scored -inf: the empty state
                    for x in range(d):
                        o_part[row, hq, x] = 0.0
                    lse_part[row, hq] = -np.inf
                    continue
                inv = np.float32(1.0) / l_run[i]
                for x in range(d):
                    o_part[row, hq, x] = acc[i, x] * inv
                lse_part[row, hq] = m_run[i] + np.float32(math.log(l_run[i])) \
                    if l_run[i] == l_run[i] else np.float32(np.nan)


def _as_f32(x, name):
    from .reference import to_numpy_f32
    return to_numpy_f32(x, name)


def nhd_view(cache: np.ndarray, kv_layout: str) -> np.ndarray:
    """NHD view ``[num_pages, page_size, num_kv_heads, head_dim]`` of a 4-D cache (no copy)."""
    return cache if kv_layout == "NHD" else cache.transpose(0, 2, 1, 3)


def mma_dtype(plan: Plan) -> str:
    """The dtype the tensor cores multiply in for ``plan``: the KV dtype, except for an fp8
    cache, which the kernels widen to the query's dtype before the MMAs."""
    return (plan.q_dtype or "float16") if plan.kv_dtype in KV_ONLY_DTYPES else plan.kv_dtype


def execute_partials(plan: Plan, q, k_cache, v_cache, kv_layout: str = "NHD",
                     input_dtype: str | None = None, k_scale=None, v_scale=None):
    """Run every CTA of ``plan``; return fp32 ``(o_partial [P, Hq, d], lse_partial [P, Hq])``,
    ``P = plan.num_partial_rows`` (one row per slot and query token; ``P`` = the slots with
    one token per request).

    ``q``: ``[plan.num_qo_tokens, num_qo_heads, head_dim]``; caches 4-D in ``kv_layout`` (a
    ``float8_e4m3fn`` cache is decoded exactly to float32).  ``input_dtype`` selects the
    rounding of P before P.V (default: :func:`mma_dtype`).  ``k_scale``/``v_scale``: the fp8
    per-tensor scales (:func:`pat_core.fp8.as_scale`), applied as the kernels do: ``k_scale``
    folded into the softmax scale on the host (one float32), ``v_scale`` multiplied into each
    partial output (the LSE does not depend on it, and the merge is linear in the partials).
    Every partial row holds its CTA's own partial, ready for
    :func:`~pat_core.merge.merge_partials` with ``plan.token_slot_indptr``.
    """
    plan.check_inputs(q, k_cache, v_cache, kv_layout)
    k_scale, v_scale = as_scale(k_scale, "k_scale"), as_scale(v_scale, "v_scale")
    q32 = np.ascontiguousarray(_as_f32(q, "q"))
    kc = nhd_view(_as_f32(k_cache, "k_cache"), kv_layout)
    vc = nhd_view(_as_f32(v_cache, "v_cache"), kv_layout)
    bits, min_exp = _ROUND[input_dtype or mma_dtype(plan)]
    P = plan.num_partial_rows
    o_part = np.full((P, plan.num_qo_heads, plan.head_dim), np.nan, dtype=np.float32)
    lse_part = np.full((P, plan.num_qo_heads), np.nan, dtype=np.float32)
    cta_n = plan.cta_mn()[:, 1].astype(np.int32)
    tv = plan.token_view()          # one token per request: the plan's own arrays
    _run_ctas(q32, kc, vc, tv.cta_req_indptr, tv.cta_req, tv.cta_slot, plan.cta_kv_start,
              plan.cta_kv_len, plan.cta_page_indptr, plan.cta_pages, cta_n, plan.page_size,
              plan.group_size, np.float32(plan.sm_scale * k_scale), bits, min_exp,
              tv.cta_kv_limit, tv.cta_causal, o_part, lse_part)
    if v_scale != 1.0:
        o_part *= np.float32(v_scale)
    return o_part, lse_part


def execute(plan: Plan, q, k_cache, v_cache, kv_layout: str = "NHD", return_lse: bool = False,
            input_dtype: str | None = None, out_dtype=np.float32, k_scale=None, v_scale=None):
    """Forward + merge on the CPU.  Returns ``out [N, Hq, d]`` (``out_dtype``) and, with
    ``return_lse``, float32 ``lse [N, Hq]`` (natural log); ``N = plan.num_qo_tokens``, the
    batch size with one token per request.  Arguments as :func:`execute_partials`."""
    o_part, lse_part = execute_partials(plan, q, k_cache, v_cache, kv_layout, input_dtype,
                                        k_scale, v_scale)
    out, lse = merge_partials(o_part, lse_part, plan.token_slot_indptr, out_dtype=out_dtype)
    return (out, lse) if return_lse else out


def trace_cta(plan: Plan, c: int, q, k_cache, v_cache, kv_head: int = 0,
              kv_layout: str = "NHD", k_scale=None, v_scale=None):
    """Replay CTA ``c`` for one KV head tile by tile in NumPy; a list of dicts, one per tile:
    ``tokens (t0, t1)``, ``scores [rows, cols]`` (``-inf`` past a query token's causal
    limit), ``m``, ``l`` ``[rows]``, ``o`` ``[rows, d]`` (the normalised running output
    ``acc / l`` after that tile; NaN for a row that has seen no key yet).  Scales as
    :func:`execute_partials`."""
    k_scale, v_scale = as_scale(k_scale, "k_scale"), as_scale(v_scale, "v_scale")
    q32 = _as_f32(q, "q")
    kc = nhd_view(_as_f32(k_cache, "k_cache"), kv_layout) * np.float32(k_scale)
    vc = nhd_view(_as_f32(v_cache, "v_cache"), kv_layout) * np.float32(v_scale)
    g, ps = plan.group_size, plan.page_size
    n = int(plan.cta_mn()[c, 1])
    start, end = int(plan.cta_kv_start[c]), int(plan.cta_kv_start[c] + plan.cta_kv_len[c])
    pages = plan.cta_pages[plan.cta_page_indptr[c]:plan.cta_page_indptr[c + 1]]
    tv = plan.token_view()
    pairs = slice(tv.cta_req_indptr[c], tv.cta_req_indptr[c + 1])
    qrows = np.stack([q32[r, kv_head * g + j] for r in tv.cta_req[pairs] for j in range(g)])
    # each row's first unseen position (its token's causal limit)
    row_limit = start + np.repeat(tv.cta_kv_limit[pairs].astype(np.int64), g)
    m = np.full(qrows.shape[0], -np.inf, dtype=np.float32)
    l = np.zeros(qrows.shape[0], dtype=np.float32)
    acc = np.zeros((qrows.shape[0], plan.head_dim), dtype=np.float32)
    out = []
    for t0 in range(start, end, n):
        t1 = min(t0 + n, end)
        toks = np.arange(t0, t1)
        pg = pages[toks // ps - start // ps]
        k = kc[pg, toks % ps, kv_head]
        v = vc[pg, toks % ps, kv_head]
        s = (qrows @ k.T) * np.float32(plan.sm_scale)
        s = np.where(toks[None, :] >= row_limit[:, None], np.float32(-np.inf), s)
        m_new = np.maximum(m, s.max(axis=1))
        m_use = np.where(np.isneginf(m_new), np.float32(0), m_new)   # rows fully masked so far
        alpha = np.where(np.isneginf(m), 0.0, np.exp(m - m_use)).astype(np.float32)
        p = np.exp(s - m_use[:, None]).astype(np.float32)
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ v
        m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            o = acc / l[:, None]
        out.append(dict(tokens=(t0, t1), scores=s, m=m.copy(), l=l.copy(), o=o))
    return out
