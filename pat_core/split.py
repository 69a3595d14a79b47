"""Long-KV split (PAT §6): cut CTAs whose KV range would make them the last to finish.

PAT's rule cuts any CTA longer than the batch's mean CTA KV length into equal parts no longer
than the mean (``rule="mean"``).  Measured on the simulator that rule over-splits batches with
many short leaf CTAs: on ``1,1024_1024,16`` (heads 32:8) the mean is ~47 tokens, every
1024-token chunk of the shared root is cut in 22 parts, and the partial results of each request
(written and read back in fp32) outweigh the KV they were meant to balance.

The default rule (``rule="sm"``) asks the question the split exists for: will this CTA finish
long after the others?  Thread blocks (CTA x KV head) are spread over ``num_sms`` SMs, each
running at least two at a time, so a block's fair share is
``sum(kv_len) x num_kv_heads / (2 x num_sms)`` tokens; a CTA longer than that is a straggler
whatever the mean says, and one shorter than that is not.  (Half an SM's work rather than a
whole one: small batches are latency bound, and on an H100 a 1,4,64_256,1024,64 batch left
most SMs idle while 64 blocks walked 8 tiles each.)  It still
splits one 100k-token request over the SMs (as split-KV does) and leaves a no-sharing batch
that already fills the GPU alone.  Parts are never shorter than ``min_part`` tokens so that
each one's partial write stays small next to its KV.

Parts are multiples of 16 tokens (the smallest KV tile) except the last one.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .packers import Packs

SPLIT_RULES = ("sm", "mean")


def split_threshold(kv_len: np.ndarray, num_kv_heads: int, num_sms: int,
                    min_part: int = 256, rule: str = "sm", share: float = 2.0,
                    weight: np.ndarray | None = None) -> int:
    """Longest KV range a CTA may keep (tokens) under ``rule`` (see module docstring).

    ``weight`` (float ``[K]``, optional): time per token of each pack relative to a 16-row
    tile's; the ``"sm"`` rule then shares out weighted tokens, and :func:`split_long_kv` cuts
    pack ``p`` at ``threshold / weight[p]`` tokens (a slow 128-row CTA is cut shorter).
    """
    if rule not in SPLIT_RULES:
        raise ValueError(f"split must be one of {SPLIT_RULES} (or True/False), got {rule!r}")
    if kv_len.size == 0:
        return 1
    if rule == "mean":
        return max(1, int(np.ceil(kv_len.mean())))
    total = float(kv_len.astype(np.int64).sum()) if weight is None else \
        float((kv_len.astype(np.float64) * weight).sum())
    per_sm = total * num_kv_heads / max(share * num_sms, 1)
    return max(1, int(np.ceil(max(float(min_part), per_sm))))


# The "sm" rule's resident blocks per SM: the default, and the share used when every pack the
# default would cut holds at most SHORT_ROWS query rows (see auto_split_share).
DEFAULT_SPLIT_SHARE = 2.0
SHORT_ROWS_SPLIT_SHARE = 3.0
SHORT_ROWS = 16


def auto_split_share(kv_len: np.ndarray, rows: np.ndarray, num_kv_heads: int, num_sms: int,
                     min_part: int = 256) -> float:
    """The ``share`` of the ``"sm"`` rule when the planner's tuning leaves it open.

    ``kv_len``, ``rows``: int ``[K]``, each pack's KV tokens and query rows (requests x group).
    Finer parts shorten the tail of a step whose long CTAs do not divide evenly over the SMs
    (each pack is cut into whole parts, so the CTA count overshoots the target), and cost one
    partial result per part and row.  When every pack the default share would cut has at most
    16 rows (long private requests: decode steps of a chat trace), a part's partials are a few KB
    against MBs of KV: share 3 measured faster than 2 on 14 of 20 real-trace steps at 32:8 (by
    up to 6%) and within 0.6% on the others, and 1% faster in geometric mean on a second
    sample of 17 steps, 15 of them not used for the choice (H100, bench/NOTES.md round 10).  When a cut pack has more rows (a long
    prefix shared by 16 requests at group 4 has 64), its partials and merge grow with every
    part, and share 2 measured best (the 16k-token prefixes: share 3 was 16-26% slower)."""
    kv_len = np.asarray(kv_len)
    if kv_len.size == 0:
        return DEFAULT_SPLIT_SHARE
    thr = split_threshold(kv_len, num_kv_heads, num_sms, min_part=min_part,
                          share=DEFAULT_SPLIT_SHARE)
    cut = kv_len > thr
    if cut.any() and bool((np.asarray(rows)[cut] <= SHORT_ROWS).all()):
        return SHORT_ROWS_SPLIT_SHARE
    return DEFAULT_SPLIT_SHARE


def split_long_kv(packs: Packs, threshold: int, weight: np.ndarray | None = None,
                  min_part: int = 16):
    """Split packs longer than ``threshold`` (divided by ``weight[p]`` when given, never below
    ``min_part``) into equal parts.

    Returns ``(src, kv_start, kv_len)``: int32 ``[C]`` arrays, ``src`` being the pack each CTA
    came from (so requests are ``packs.reqs[packs.req_indptr[src]:...]``).  Parts of one pack
    are consecutive, in token order.
    """
    thr = np.full(packs.kv_start.shape[0], int(threshold), dtype=np.int64)
    if weight is not None:
        thr = np.maximum(np.ceil(int(threshold) / np.asarray(weight, dtype=np.float64)),
                         min(int(min_part), int(threshold))).astype(np.int64)
    return _split(packs.kv_start, packs.kv_end, thr)


@njit(cache=True)
def _split(kv_start, kv_end, thresholds):
    K = kv_start.shape[0]
    parts = np.empty(K, dtype=np.int64)
    plen = np.empty(K, dtype=np.int64)
    total = 0
    for p in range(K):
        length = kv_end[p] - kv_start[p]
        threshold = thresholds[p]
        k = max(1, (length + threshold - 1) // threshold)
        pl = (length + k - 1) // k
        if k > 1:
            pl = (pl + 15) // 16 * 16          # parts are whole 16-token tiles but the last
        k = (length + pl - 1) // pl
        parts[p] = k
        plen[p] = pl
        total += k
    src = np.empty(total, dtype=np.int32)
    start = np.empty(total, dtype=np.int32)
    ln = np.empty(total, dtype=np.int32)
    i = 0
    for p in range(K):
        for k in range(parts[p]):
            s = kv_start[p] + k * plen[p]
            e = min(s + plen[p], kv_end[p])
            src[i] = p
            start[i] = s
            ln[i] = e - s
            i += 1
    return src, start, ln
