"""Long-KV split (PAT §6): cut CTAs whose KV range would make them the last to finish.

PAT's rule cuts any CTA longer than the batch's mean CTA KV length into equal parts no longer
than the mean (``rule="mean"``).  Measured on the simulator that rule over-splits batches with
many short leaf CTAs: on ``1,1024_1024,16`` (heads 32:8) the mean is ~47 tokens, every
1024-token chunk of the shared root is cut in 22 parts, and the partial results of each request
(written and read back in fp32) outweigh the KV they were meant to balance.

The default rule (``rule="sm"``) asks the question the split exists for: will this CTA finish
long after the others?  Thread blocks (CTA x KV head) are spread over ``num_sms`` SMs, each
running ``share`` of them at a time, so a block's fair share is
``sum(kv_len) x num_kv_heads / (share x num_sms)`` tokens; a CTA
longer than that is a straggler whatever the mean says, and one shorter than that is not.  The
share depends on what would be cut (:func:`auto_split_share`): 2 by default, 3 for long
private requests of few rows, and one block per SM, without overshooting the SMs, where a cut
CTA holds many query rows, whose partial results grow with every part.  It still
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


# The "sm" rule's resident blocks per SM: the default, the share used when every pack the
# default would cut holds at most SHORT_ROWS query rows, and the most used when one of them
# holds more (see auto_split_share).
DEFAULT_SPLIT_SHARE = 2.0
SHORT_ROWS_SPLIT_SHARE = 3.0
MANY_ROWS_SPLIT_SHARE = 1.0
SHORT_ROWS = 16


def one_wave_share(kv_len: np.ndarray, num_kv_heads: int, num_sms: int, min_part: int = 256,
                   share: float = MANY_ROWS_SPLIT_SHARE) -> float:
    """The largest share of the form ``share * 0.97**i`` whose cut packs, split, make no more
    thread blocks (parts x KV heads) than ``num_sms``: one block per SM, and never a few SMs
    with two.  Each pack is cut into whole parts, so the plain rule can overshoot: the 16k-token
    prefix of ``1,16_16384,16`` (32:8) at share 1 is cut into 17 parts, 136 blocks on 132 SMs,
    and four SMs then run two of the longest blocks (bench/NOTES.md, round 5: slower than share
    2; round 17: 16 parts, 128 blocks, 7% faster than share 2).  Only the cut CTAs are counted
    (the uncut ones, leaves say, share the SMs with them), by tokens: the ``split_by="work"``
    weights are not applied here.  Where even one part per cut pack would make more blocks than
    SMs, the share falls until nothing is cut."""
    kv_len = np.asarray(kv_len).astype(np.int64)
    s = float(share)
    for _ in range(200):
        thr = split_threshold(kv_len, num_kv_heads, num_sms, min_part=min_part, share=s)
        cut = kv_len > thr
        parts, _ = _part_layout(kv_len[cut], np.full(int(cut.sum()), thr, dtype=np.int64))
        if int(parts.sum()) * num_kv_heads <= num_sms:
            break
        s *= 0.97
    return s


def auto_split_share(kv_len: np.ndarray, rows: np.ndarray, num_kv_heads: int, num_sms: int,
                     min_part: int = 256) -> float:
    """The ``share`` of the ``"sm"`` rule when the planner's tuning leaves it open.

    ``kv_len``, ``rows``: int ``[K]``, each pack's KV tokens and query rows (requests x group).
    Finer parts shorten the tail of a step whose long CTAs do not divide evenly over the SMs
    (each pack is cut into whole parts, so the CTA count overshoots the target), and cost one
    partial result per part and row.  Which packs the default share (2) would cut decides:

    * none: share 2 (nothing is cut either way);
    * all of at most 16 rows (long private requests: decode steps of a chat trace): a part's
      partials are a few KB against MBs of KV; share 3 measured faster than 2 on 14 of 20
      real-trace steps at 32:8 (by up to 6%) and within 0.6% on the others, and 1% faster in
      geometric mean on a second sample of 17 steps, 15 of them not used for the choice (H100,
      bench/NOTES.md round 10);
    * one with more rows (a prefix shared by 16 requests at group 4 has 64): its partials and
      merge grow with every part, so one block per SM (:func:`one_wave_share`, share 1 at
      most).  Measured against share 2 on every development and long-prefix configuration whose
      plan it changes (H100, round 17, ``kernel_lab --cases one-wave``): faster on 14 of 17 by
      1.2-16% (geometric mean over all 17: 0.953), slower on three by 1.3-3.1%
      (``1,2,8,128_512,128,256,32`` and ``1,2,4,8,16,32,64_...`` at 32:8, ``1,32_16384,16`` at
      16:8).  On an H200 faster on 12 of 17 (geometric mean 0.962), up to 9% slower on the
      long prefixes, where one warpgroup block per SM does not keep up with its bandwidth.
    """
    kv_len = np.asarray(kv_len)
    if kv_len.size == 0:
        return DEFAULT_SPLIT_SHARE
    thr = split_threshold(kv_len, num_kv_heads, num_sms, min_part=min_part,
                          share=DEFAULT_SPLIT_SHARE)
    cut = kv_len > thr
    if not cut.any():
        return DEFAULT_SPLIT_SHARE
    if bool((np.asarray(rows)[cut] <= SHORT_ROWS).all()):
        return SHORT_ROWS_SPLIT_SHARE
    return one_wave_share(kv_len, num_kv_heads, num_sms, min_part=min_part)


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
def _part_layout(length, thresholds):
    """``(parts, plen)``: int64 ``[K]``, how many parts each of ``length`` (int ``[K]`` tokens)
    is cut into at ``thresholds`` (int64 ``[K]``), and their length (the last part may be
    shorter).  The one rule :func:`split_long_kv` cuts by and :func:`one_wave_share` counts by."""
    K = length.shape[0]
    parts = np.empty(K, dtype=np.int64)
    plen = np.empty(K, dtype=np.int64)
    for p in range(K):
        n = length[p]
        threshold = thresholds[p]
        k = max(1, (n + threshold - 1) // threshold)
        pl = (n + k - 1) // k
        if k > 1:
            pl = (pl + 15) // 16 * 16          # parts are whole 16-token tiles but the last
        parts[p] = (n + pl - 1) // pl
        plen[p] = pl
    return parts, plen


@njit(cache=True)
def _split(kv_start, kv_end, thresholds):
    parts, plen = _part_layout((kv_end - kv_start).astype(np.int64), thresholds)
    total = 0
    for p in range(kv_start.shape[0]):
        total += parts[p]
    src = np.empty(total, dtype=np.int32)
    start = np.empty(total, dtype=np.int32)
    ln = np.empty(total, dtype=np.int32)
    i = 0
    for p in range(kv_start.shape[0]):
        for k in range(parts[p]):
            s = kv_start[p] + k * plen[p]
            e = min(s + plen[p], kv_end[p])
            src[i] = p
            start[i] = s
            ln[i] = e - s
            i += 1
    return src, start, ln
