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

import math

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
    and four SMs then run two of the longest blocks (bench/NOTES.md: slower than share
    2; at 16 parts, 128 blocks, 7% faster than share 2).  Only the cut CTAs are counted
    (the uncut ones, leaves say, share the SMs with them), by tokens: the ``split_by="work"``
    weights are not applied here.  Where even one part per cut pack would make more blocks than
    SMs, the share falls until nothing is cut."""
    kv_len = np.asarray(kv_len).astype(np.int64)
    return float(_one_wave_nb(kv_len, float(kv_len.sum()), int(num_kv_heads), int(num_sms),
                              int(min_part), float(share)))


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
      bench/NOTES.md);
    * one with more rows (a prefix shared by 16 requests at group 4 has 64): its partials and
      merge grow with every part, so one block per SM (:func:`one_wave_share`, share 1 at
      most).  Measured against share 2 on every development and long-prefix configuration whose
      plan it changes (H100, ``kernel_lab --cases one-wave``): faster on 14 of 17 by
      1.2-16% (geometric mean over all 17: 0.953), slower on three by 1.3-3.1%
      (``1,2,8,128_512,128,256,32`` and ``1,2,4,8,16,32,64_...`` at 32:8, ``1,32_16384,16`` at
      16:8).  On an H200 faster on 12 of 17 (geometric mean 0.962), up to 9% slower on the
      long prefixes, where one warpgroup block per SM does not keep up with its bandwidth.
    """
    kv_len = np.asarray(kv_len).astype(np.int64)
    if kv_len.size == 0:
        return DEFAULT_SPLIT_SHARE
    return float(_auto_share_nb(kv_len, np.asarray(rows).astype(np.int64), float(kv_len.sum()),
                                int(num_kv_heads), int(num_sms), int(min_part)))


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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def _split(kv_start, kv_end, thresholds):
    return _split_parts(kv_start, kv_end, thresholds)


@njit(cache=True, nogil=True)
def _split_parts(kv_start, kv_end, thresholds):
    """:func:`split_long_kv`'s cut (``_split`` is its entry point from Python; compiled code
    calls this one: a cached function that is both an entry point and another compiled
    function's callee can hand Python arrays it cannot read)."""
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


# ---------------------------------------------------------------------------------------------
# Choosing the share by the time of the pull launch it produces
# ---------------------------------------------------------------------------------------------

# The shares the planner tries when its tuning leaves the share open (one_wave_share is added).
CANDIDATE_SHARES = (2.0, 3.0, 4.0, 6.0)
_MAX_CANDIDATE = max(CANDIDATE_SHARES)    # the lowest threshold of the candidates


@njit(cache=True, nogil=True)
def pull_makespan_ns(item_bytes, item_weight, item_slots, capacity, bandwidth, latency_ns,
                     item_ns):
    """Predicted time (ns) of one pull launch: items drawn in order by the blocks resident on
    the GPU, memory bandwidth shared among the running ones.

    ``item_bytes`` (float64 ``[N]``): bytes each work item moves, in the order blocks draw
    them.  ``item_weight`` (float64 ``[N]``): bytes its block keeps in flight.
    ``item_slots`` (float64 ``[N]``): the share of one SM its block holds (``1 /
    blocks_per_sm`` of its kernel).  ``capacity``: SMs (running items' slots never sum past
    it).  ``bandwidth`` (bytes/ns): what the running items share; ``latency_ns``: memory
    latency under load; ``item_ns``: fixed time per item (its start and partial write).

    An item moves ``weight / latency`` bytes/ns while the running items' in-flight bytes
    together ask less than ``bandwidth``, and its weight's share of ``bandwidth`` once they ask
    more (the simulator's rule, :mod:`sim.timeline`).  Every running item then advances on one
    clock at rate ``g = min(1 / latency, bandwidth / sum(weights))``, needing ``bytes / weight``
    of it, so items finish in the order of their clock targets: a heap gives each event in
    O(log N)."""
    n = item_bytes.shape[0]
    if n == 0:
        return 0.0
    heap = np.empty(n, dtype=np.float64)     # clock value at which the item finishes
    hw = np.empty(n, dtype=np.float64)
    hslot = np.empty(n, dtype=np.float64)
    size = 0
    clock = 0.0
    t = 0.0
    used = 0.0
    wsum = 0.0
    nxt = 0
    while nxt < n or size > 0:
        # start every item that fits (in order: a free block draws the next item only)
        while nxt < n and (size == 0 or used + item_slots[nxt] <= capacity + 1e-9):
            w = max(item_weight[nxt], 1.0)
            v = clock + item_bytes[nxt] / w + item_ns / latency_ns
            s = item_slots[nxt]
            i = size
            size += 1
            while i > 0:
                parent = (i - 1) // 2
                if heap[parent] <= v:
                    break
                heap[i] = heap[parent]
                hw[i] = hw[parent]
                hslot[i] = hslot[parent]
                i = parent
            heap[i] = v
            hw[i] = w
            hslot[i] = s
            used += s
            wsum += w
            nxt += 1
        g = min(1.0 / latency_ns, bandwidth / wsum)
        t += (heap[0] - clock) / g
        clock = heap[0]
        used -= hslot[0]
        wsum -= hw[0]
        size -= 1
        v = heap[size]
        w = hw[size]
        s = hslot[size]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            if c + 1 < size and heap[c + 1] < heap[c]:
                c += 1
            if heap[c] >= v:
                break
            heap[i] = heap[c]
            hw[i] = hw[c]
            hslot[i] = hslot[c]
            i = c
        if size > 0:
            heap[i] = v
            hw[i] = w
            hslot[i] = s
        if size == 0:
            wsum = 0.0
            used = 0.0
    return t


# The pull-launch model's constants, set by hand and judged by the plans they pick on the H100
# development set (bench/NOTES.md, "The split share by the pull launch's time"): a block's memory
# latency under load, in units of the GPU's unloaded latency (its rate is the KV it keeps in
# flight over this: ~34 GB/s for a 16x64 block, the rate the tail of 4_8192 at share 3 implies);
# the fixed time of one work item; and the merge launch's fixed time, paid once when any request
# has more than one partial slot.
LOADED_LATENCY = 1.5
ITEM_NS = 1000.0
MERGE_NS = 2000.0


# The least predicted gain (fraction of the automatic share's time) for which the pull-launch
# model overrides auto_split_share.  The model ranks shares it prices within a few percent of
# each other no better than chance (1,4,16_128,256,1024: shares 3, 4, 6 priced 39.0/40.2/41.3 us,
# measured 40.3/38.2/38.5), so it only overrides where it sees a clear wave-quantisation loss.
MODEL_MARGIN = 0.04


# ---------------------------------------------------------------------------------------------
# The choice, compiled: one call per plan, no Python per candidate or per part
# ---------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _threshold_nb(total, num_kv_heads, num_sms, min_part, share):
    """:func:`split_threshold` (``"sm"`` rule, no weight) from the summed tokens ``total``
    (float), with the same floating-point steps, so both give the same integer."""
    per_sm = total * num_kv_heads / max(share * num_sms, 1.0)
    return max(1, int(math.ceil(max(float(min_part), per_sm))))


@njit(cache=True, nogil=True)
def _parts_of(n, threshold):
    """Parts and part length of ``n`` tokens cut at ``threshold`` (:func:`_part_layout`)."""
    k = max(1, (n + threshold - 1) // threshold)
    pl = (n + k - 1) // k
    if k > 1:
        pl = (pl + 15) // 16 * 16
    return (n + pl - 1) // pl, pl


@njit(cache=True, nogil=True)
def _one_wave_nb(length, total, num_kv_heads, num_sms, min_part, share):
    """:func:`one_wave_share`, compiled."""
    s = share
    for _ in range(200):
        thr = _threshold_nb(total, num_kv_heads, num_sms, min_part, s)
        n = 0
        for p in range(length.shape[0]):
            if length[p] > thr:
                n += _parts_of(length[p], thr)[0]
        if n * num_kv_heads <= num_sms:
            break
        s *= 0.97
    return s


@njit(cache=True, nogil=True)
def _auto_share_nb(length, rows, total, num_kv_heads, num_sms, min_part):
    """:func:`auto_split_share`, compiled (``length`` non-empty)."""
    thr = _threshold_nb(total, num_kv_heads, num_sms, min_part, DEFAULT_SPLIT_SHARE)
    cut = False
    short = True
    for p in range(length.shape[0]):
        if length[p] > thr:
            cut = True
            if rows[p] > SHORT_ROWS:
                short = False
    if not cut:
        return DEFAULT_SPLIT_SHARE
    if short:
        return SHORT_ROWS_SPLIT_SHARE
    return _one_wave_nb(length, total, num_kv_heads, num_sms, min_part, MANY_ROWS_SPLIT_SHARE)


@njit(cache=True, nogil=True)
def _left(sorted_small, x):
    """``np.searchsorted(sorted_small, x, "left")`` for the selector's few entries (a scan is
    cheaper than the call)."""
    k = 0
    while k < sorted_small.shape[0] and sorted_small[k] < x:
        k += 1
    return k


@njit(cache=True, nogil=True)
def _price_items(length, rows, parts, plen, num_kv_heads, head_dim, kv_bytes, m_values,
                 bounds, fid):
    """The work items of the cut that makes ``parts`` parts of ``plen`` tokens of each pack
    (int64 ``[K]``, :func:`_parts_of` at the threshold; ``rows`` int64 ``[K]`` query rows), in
    pack order: ``(nbytes, cfg, merge_rows)``, each part's bytes (its ``num_kv_heads`` blocks
    as one item, float64 ``[N]``), its config in the selector's lookup (int64 ``[N]``), and
    the partial rows the merge reads, and whether any pack is cut (a merge launch)."""
    K = length.shape[0]
    total = 0
    for p in range(K):
        total += parts[p]
    nbytes = np.empty(total, dtype=np.float64)
    cfg = np.empty(total, dtype=np.int64)
    i = 0
    merge = 0
    any_cut = False
    for p in range(K):
        n_p = parts[p]
        pl = plen[p]
        cut = n_p > 1
        if cut:
            any_cut = True
            merge += n_p * rows[p]
        mi = _left(m_values, rows[p])
        extra = rows[p] * head_dim * 4 if cut else 0
        for k in range(n_p):
            tok = pl if k < n_p - 1 else length[p] - (n_p - 1) * pl
            nbytes[i] = float(num_kv_heads * (tok * (head_dim * 2 * kv_bytes) + extra))
            cfg[i] = fid[mi, _left(bounds, tok)]
            i += 1
    return nbytes, cfg, merge, any_cut


@njit(cache=True, nogil=True)
def _merge_ns(merge, any_cut, num_kv_heads, head_dim, bandwidth):
    """The merge launch's predicted time (ns) for ``merge`` partial rows (none unless
    ``any_cut``)."""
    if not any_cut:
        return 0.0
    return MERGE_NS + float(merge) * num_kv_heads * head_dim * 4 / bandwidth


@njit(cache=True, nogil=True)
def _price_floor(nbytes, cfg, merge, any_cut, num_kv_heads, head_dim, cfg_inflight, bandwidth,
                 latency):
    """A lower bound of :func:`_price_nb` for the same items (:func:`_price_items`), in one
    pass with no sort.  In :func:`pull_makespan_ns` an item needs ``bytes / w + ITEM_NS /
    latency`` of the shared clock (``w``: its in-flight bytes, at least 1), and the clock runs
    at ``g <= bandwidth / (sum of the running items' w)``, so every interval lasts at least
    its clock advance times the running ``w`` over ``bandwidth``; summed over the launch, the
    makespan is at least ``sum(bytes + w * ITEM_NS / latency) / bandwidth``, whatever the
    order and the SM slots.  The merge term is the same as the price's."""
    e = 0.0
    for i in range(nbytes.shape[0]):
        e += nbytes[i] + max(cfg_inflight[cfg[i]], 1.0) * (ITEM_NS / latency)
    return e / bandwidth + _merge_ns(merge, any_cut, num_kv_heads, head_dim, bandwidth)


@njit(cache=True, nogil=True)
def _price_of_items(nbytes, cfg, merge, any_cut, num_kv_heads, head_dim, num_sms, cfg_slot,
                    cfg_inflight, bandwidth, latency):
    """:func:`_price_nb` of items from :func:`_price_items`."""
    order = np.argsort(-nbytes, kind="mergesort")
    t = pull_makespan_ns(nbytes[order], cfg_inflight[cfg[order]], cfg_slot[cfg[order]],
                         float(num_sms), bandwidth, latency, ITEM_NS)
    return t + _merge_ns(merge, any_cut, num_kv_heads, head_dim, bandwidth)


@njit(cache=True, nogil=True)
def _price_nb(length, rows, parts, plen, num_kv_heads, head_dim, kv_bytes, num_sms, m_values,
              bounds, fid, cfg_slot, cfg_inflight, bandwidth, latency):
    """Predicted forward + merge time (ns) of the cut that makes ``parts`` parts of ``plen``
    tokens of each pack (int64 ``[K]``, :func:`_parts_of` at the threshold; ``rows`` int64
    ``[K]`` query rows): the pull launch of the parts (:func:`pull_makespan_ns`, longest first,
    a part's ``num_kv_heads`` blocks as one item of their summed bytes, in-flight bytes and SM
    share; each part's tile from the selector's lookup arrays,
    :meth:`pat_core.tiles.TileSelector.lookup`, with that config's SM share and in-flight bytes
    ``cfg_slot``, ``cfg_inflight``, float64 ``[F]``) plus, when a pack is cut,
    :data:`MERGE_NS` and the partial reads.  Beyond the planner's own tile and resource rules
    only :data:`LOADED_LATENCY`, :data:`ITEM_NS` and :data:`MERGE_NS` are the model's."""
    nbytes, cfg, merge, cut = _price_items(length, rows, parts, plen, num_kv_heads, head_dim,
                                           kv_bytes, m_values, bounds, fid)
    return _price_of_items(nbytes, cfg, merge, cut, num_kv_heads, head_dim, num_sms, cfg_slot,
                           cfg_inflight, bandwidth, latency)


# A candidate whose price floor (:func:`_price_floor`) is at least this fraction above the
# override line is not priced: float rounding of the two sums is far below it
FLOOR_SLACK = 1e-9


@njit(cache=True, nogil=True)
def _choose_share_nb(length, rows, num_kv_heads, num_sms, min_part, head_dim, kv_bytes,
                     m_values, bounds, fid, cfg_slot, cfg_inflight, bandwidth, latency):
    """:func:`choose_split_share`'s share, compiled (``length`` int64 ``[K]``, non-empty)."""
    total = 0
    longest = 0
    for p in range(length.shape[0]):
        total += length[p]
        longest = max(longest, length[p])
    ftotal = float(total)
    # the largest candidate share gives the lowest threshold (auto_split_share's and
    # one_wave_share's are at most 3): where it cuts nothing, no candidate does, and the
    # automatic share (2, nothing cut) stands unpriced
    if longest <= _threshold_nb(ftotal, num_kv_heads, num_sms, min_part, _MAX_CANDIDATE):
        return DEFAULT_SPLIT_SHARE
    auto = _auto_share_nb(length, rows, ftotal, num_kv_heads, num_sms, min_part)
    ow = _one_wave_nb(length, ftotal, num_kv_heads, num_sms, min_part, MANY_ROWS_SPLIT_SHARE)
    # the candidates: auto, then the others descending
    cands = np.empty(6, dtype=np.float64)
    nc = 0
    cands[nc] = auto
    nc += 1
    for s in (6.0, 4.0, 3.0, 2.0):
        if s != auto:                  # one_wave_share is at most 1: never one of these
            cands[nc] = s
            nc += 1
    if ow != auto:
        cands[nc] = ow
        nc += 1
    # keep the shares whose cuts differ from every earlier one's
    K = length.shape[0]
    kept_parts = np.empty((nc, K), dtype=np.int64)
    kept_plen = np.empty((nc, K), dtype=np.int64)
    kept_share = np.empty(nc, dtype=np.float64)
    nk = 0
    for c in range(nc):
        thr = _threshold_nb(ftotal, num_kv_heads, num_sms, min_part, cands[c])
        for p in range(K):
            kept_parts[nk, p], kept_plen[nk, p] = _parts_of(length[p], thr)
        dup = False
        for j in range(nk):
            same = True
            for p in range(K):
                if kept_parts[j, p] != kept_parts[nk, p]:
                    same = False
                    break
            if same:
                dup = True
                break
        if not dup:
            kept_share[nk] = cands[c]
            nk += 1
    if nk == 1:
        return auto
    best = 0
    t_auto = 0.0
    t_best = 0.0
    for j in range(nk):
        nbytes, cfg, merge, cut = _price_items(length, rows, kept_parts[j], kept_plen[j],
                                               num_kv_heads, head_dim, kv_bytes, m_values,
                                               bounds, fid)
        if j > 0:
            # a share whose price cannot fall below the override line cannot be returned
            # (were it the cheapest, auto would stand), so its pull launch is not simulated
            floor = _price_floor(nbytes, cfg, merge, cut, num_kv_heads, head_dim, cfg_inflight,
                                 bandwidth, latency)
            if floor * (1.0 - FLOOR_SLACK) >= t_auto * (1.0 - MODEL_MARGIN):
                continue
        t = _price_of_items(nbytes, cfg, merge, cut, num_kv_heads, head_dim, num_sms, cfg_slot,
                            cfg_inflight, bandwidth, latency)
        if j == 0:
            t_auto = t
            t_best = t
        elif t < t_best:
            best = j
            t_best = t
    if t_best < t_auto * (1.0 - MODEL_MARGIN):
        return kept_share[best]
    return auto


@njit(cache=True, nogil=True)
def _choose_threshold_nb(req_indptr, kv_start, kv_end, group, pack_rows, num_kv_heads, num_sms,
                         min_part, head_dim, kv_bytes, m_values, bounds, fid, cfg_slot,
                         cfg_inflight, bandwidth, latency):
    """``(threshold, max_rows)`` of packs given as arrays (``req_indptr [K+1]``, ``kv_start``,
    ``kv_end [K]``): the ``"sm"`` rule's threshold at :func:`_choose_share_nb`'s share, and the
    most query rows of a pack (the caller checks them against the largest tile).  A pack's
    rows: ``pack_rows[p]`` (int64 ``[K]``), or requests x ``group`` when ``pack_rows`` is
    empty."""
    K = kv_start.shape[0]
    length = np.empty(K, dtype=np.int64)
    rows = np.empty(K, dtype=np.int64)
    total = 0
    most = 0
    for p in range(K):
        length[p] = kv_end[p] - kv_start[p]
        if pack_rows.shape[0] == K:
            rows[p] = pack_rows[p]
        else:
            rows[p] = (req_indptr[p + 1] - req_indptr[p]) * group
        total += length[p]
        most = max(most, rows[p])
    if K == 0:
        return 1, 0
    share = _choose_share_nb(length, rows, num_kv_heads, num_sms, min_part, head_dim, kv_bytes,
                             m_values, bounds, fid, cfg_slot, cfg_inflight, bandwidth, latency)
    return _threshold_nb(float(total), num_kv_heads, num_sms, min_part, share), most


_PRICE_MEMO: dict = {}   # (configs, head_dim, kv_bytes, num_kv_heads, gpu) -> (slot, inflight)


def _price_constants(selector, num_kv_heads: int, head_dim: int, kv_bytes: int, gpu):
    """``(slot, inflight)``: float64 ``[F]``, each selectable config's SM share and in-flight
    bytes (:func:`_price_nb`'s rule), kept on the selector (no hashing of the GPU spec
    per plan) and per configuration."""
    own = selector.__dict__.setdefault("_price_memo", {})
    hit = own.get((head_dim, kv_bytes, num_kv_heads))
    if hit is None:
        configs = selector.lookup()[3]
        key = (configs.tobytes(), head_dim, kv_bytes, num_kv_heads, gpu)
        hit = _PRICE_MEMO.get(key)
        if hit is None:
            from .tiles import resource_dtype, tile_resources
            dtype = resource_dtype(kv_bytes)      # the resources of the cache's element size
            slot = np.empty(configs.shape[0])
            inflight = np.empty(configs.shape[0])
            for u, (m, n) in enumerate(configs.tolist()):
                res = tile_resources(m, n, head_dim, dtype, gpu)
                slot[u] = num_kv_heads / max(res.ctas_per_sm(gpu), 1)
                inflight[u] = num_kv_heads * max(res.stages - 1, 1) * n * head_dim * 2 * kv_bytes
            hit = _PRICE_MEMO[key] = (slot, inflight)
        own[(head_dim, kv_bytes, num_kv_heads)] = hit
    return hit


def choose_split_share(length: np.ndarray, rows: np.ndarray, *, num_kv_heads: int,
                       head_dim: int, kv_bytes: int, gpu, selector, min_part: int = 256) -> float:
    """The ``"sm"`` rule's share when the tuning leaves it open: :func:`auto_split_share`'s,
    unless another of :data:`CANDIDATE_SHARES` or :func:`one_wave_share` has a predicted pull
    launch (:func:`_price_nb`: :func:`pull_makespan_ns` of the parts plus the merge) at least
    :data:`MODEL_MARGIN` cheaper; then the cheapest.  Shares that cut exactly as an earlier one
    are priced once; nothing is priced when every share cuts alike.  ``length``, ``rows``: int
    ``[K]``, each pack's KV tokens and query rows.  One compiled call; the tests keep the
    obvious NumPy version as its reference."""
    length = np.asarray(length).astype(np.int64)
    rows = np.asarray(rows).astype(np.int64)
    if length.size == 0:
        return DEFAULT_SPLIT_SHARE
    m_values, bounds, fid, _ = selector.lookup()
    slot, inflight = _price_constants(selector, num_kv_heads, head_dim, kv_bytes, gpu)
    return float(_choose_share_nb(
        length, rows, int(num_kv_heads), int(gpu.num_sms), int(min_part), int(head_dim),
        int(kv_bytes), m_values, bounds, fid, slot, inflight,
        float(gpu.hbm_bandwidth * gpu.achieved_bw_fraction),
        float(gpu.mem_latency_ns * LOADED_LATENCY)))


def choose_split_threshold_fast(req_indptr: np.ndarray, kv_start: np.ndarray,
                                kv_end: np.ndarray, group: int, *, num_kv_heads: int,
                                head_dim: int, kv_bytes: int, gpu, selector,
                                min_part: int = 256, rows=None) -> tuple:
    """``(threshold, max_rows)``: :func:`split_threshold` (``"sm"``) at
    :func:`choose_split_share`'s share for packs given as arrays (``req_indptr`` int
    ``[K+1]``, ``kv_start``, ``kv_end`` int ``[K]``; ``group`` query rows per request, or
    ``rows`` int ``[K]`` each pack's query rows (multi-token queries)), and the most query
    rows of a pack (the planner runs the same compiled choice inside its one per-step call,
    :func:`pat_core.planner._sm_plan_nb`)."""
    m_values, bounds, fid, _ = selector.lookup()
    slot, inflight = _price_constants(selector, num_kv_heads, head_dim, kv_bytes, gpu)
    pack_rows = (np.zeros(0, dtype=np.int64) if rows is None
                 else np.asarray(rows, dtype=np.int64))
    thr, most = _choose_threshold_nb(
        req_indptr, kv_start, kv_end, int(group), pack_rows, int(num_kv_heads),
        int(gpu.num_sms),
        int(min_part), int(head_dim), int(kv_bytes), m_values, bounds, fid, slot, inflight,
        float(gpu.hbm_bandwidth * gpu.achieved_bw_fraction),
        float(gpu.mem_latency_ns * LOADED_LATENCY))
    return int(thr), int(most)


# Batch-invariant plans (``plan(..., batch_invariant=True)``) replace the split by fixed KV
# chunks of about this many tokens (rounded up to a multiple of the page size and of the tile's
# n).  A request of L tokens has ceil(L / C) partials.  Measured over the development set (H200,
# graph replay, heads 32:8, head_dim 128; docs/design.md): 256 / 512 / 1024 / 2048 tokens cost
# 1.24 / 1.16 / 1.15 / 1.17x the default plans' time in geometric mean.  Shorter chunks share
# more of a prefix that ends mid-chunk and spread a long request over more SMs; longer ones
# write fewer partials.
INVARIANT_CHUNK_TOKENS = 1024


def invariant_chunk(page_size: int, n: int, tokens: int | None = None) -> int:
    """Tokens of the fixed KV chunk of a batch-invariant plan: the smallest multiple of both
    ``page_size`` and the tile's ``n`` that is at least ``tokens`` (default
    :data:`INVARIANT_CHUNK_TOKENS`).  A function of the plan's parameters only, never of
    the batch."""
    tokens = INVARIANT_CHUNK_TOKENS if tokens is None else tokens
    if not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise ValueError(f"invariant_chunk must be a positive int, got {tokens!r}")
    unit = math.lcm(int(page_size), int(n))
    return unit * max(1, -(-int(tokens) // unit))
