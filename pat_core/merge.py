"""Merging partial attention states with the log-sum-exp rule (PAT §7, cascade inference).

An *attention state* of one query head over a set of keys ``K`` is ``(o, lse)``: the softmax-
weighted average of the values, ``o = sum_k exp(s_k) v_k / sum_k exp(s_k)``, and the natural-log
sum of exponentials, ``lse = log sum_k exp(s_k)``.  Two states over disjoint key sets combine
into the state over their union:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

The rule is associative and commutative, so partials can merge in any order.  The empty state
(no keys) is ``(0, -inf)``; it is the identity and must not produce NaN.  A NaN in a state (in
``o`` or ``lse``: a NaN or infinity in that state's q, K or V) is not mistaken for an empty one:
it reaches the merged result, as it would in dense attention.
"""
from __future__ import annotations

import numpy as np


def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two states.  ``o_*``: float ``[..., head_dim]``; ``lse_*``: float ``[...]``."""
    o_a, o_b = np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)
    lse_a, lse_b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    mx = np.maximum(lse_a, lse_b)
    safe = np.where(np.isneginf(mx), 0.0, mx)           # both empty: avoid -inf - -inf
    wa = np.exp(lse_a - safe)
    wb = np.exp(lse_b - safe)
    tot = wa + wb
    ok = ~(tot == 0)                                     # NaN is not "empty"
    den = np.where(ok, tot, 1.0)
    o = (wa[..., None] * o_a + wb[..., None] * o_b) / den[..., None]
    lse = np.where(ok, safe + np.log(den), -np.inf)
    return o, lse


def merge_partials(o_partial: np.ndarray, lse_partial: np.ndarray, req_slot_indptr: np.ndarray,
                   out_dtype=np.float32):
    """Combine every request's partial slots (vectorised over requests and heads).

    Parameters
    ----------
    o_partial : float32 ``[num_slots, num_heads, head_dim]``
    lse_partial : float32 ``[num_slots, num_heads]``, natural log, ``-inf`` for empty partials
    req_slot_indptr : int32 ``[batch + 1]``; request ``r`` owns slots ``indptr[r]:indptr[r+1]``
        (each request has at least one slot).

    Returns ``(out [batch, num_heads, head_dim] out_dtype, lse float32 [batch, num_heads])``.
    Arithmetic in fp32, as the merge kernel does.  A request whose slots are all empty gets
    zeros and ``-inf``; a NaN in any of its slots makes its result NaN.
    """
    with np.errstate(invalid="ignore"):
        return _merge_partials(o_partial, lse_partial, req_slot_indptr, out_dtype)


def _merge_partials(o_partial, lse_partial, req_slot_indptr, out_dtype):
    starts = req_slot_indptr[:-1].astype(np.int64)
    lse = lse_partial.astype(np.float32)
    mx = np.maximum.reduceat(lse, starts, axis=0)                        # [B, H]
    safe = np.where(np.isneginf(mx), np.float32(0), mx)
    counts = np.diff(req_slot_indptr)
    w = np.exp(lse - np.repeat(safe, counts, axis=0))                      # [S, H]
    den = np.add.reduceat(w, starts, axis=0)
    num = np.add.reduceat(w[..., None] * o_partial.astype(np.float32), starts, axis=0)
    # den == 0 only when every slot is empty (lse = -inf); a NaN den (a NaN lse or NaN weights)
    # is not empty and must come out as NaN, not as the empty state
    ok = ~(den == 0)
    out = np.where(ok[..., None], num / np.where(ok, den, 1)[..., None], 0).astype(out_dtype)
    lse_out = np.where(ok, safe + np.log(np.where(ok, den, 1)), -np.inf).astype(np.float32)
    return out, lse_out
