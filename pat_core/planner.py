"""The planner: block table -> forest -> packs -> long-KV split -> tiles -> :class:`Plan`.

:class:`Planner` runs that chain and keeps the last step so that the next decode step costs
little (``Planner.last_path`` says what a call did):

* ``"reuse"``: the same pages and lengths again return the same Plan object;
* ``"lengths"``: the same rows, and the rows that grew (into pages the table already lists or
  new ones) each held their last token alone: the packing is kept, only those rows' leaf packs
  get longer, and the split, tiles and layout run again;
* ``"rows"``: rows left, joined, moved or grew from a shared last token: the sorted request
  order and LCPs are updated (:mod:`pat_core.incremental`), the forest is built from them
  without sorting, and packed again;
* ``"full"``: the first step, most rows new, or input the checks must report.
* ``"invariant"``: a batch-invariant plan (``batch_invariant=True``, :func:`invariant_plan`),
  always planned from scratch.

Every path gives the Plan a fresh planner gives for the same step, array for array
(``tests/test_incremental_plan.py``).
"""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
from numba import njit

from .forest import PrefixForest
from .fp8 import FLOAT32_MAX
from .gpus import get_gpu
from .incremental import LOOKAHEAD, _match_rows, _next_order
from .inputs import (INT32_MAX, BlockTable, _check_seq_lens, as_block_table, check_heads,
                     check_qo_indptr, check_size)
from .packers import (PACKERS, Packs, chunk_packs, narrow_packing, narrow_wins, pack,
                      request_packing, request_share, request_wins)
from .plan import DTYPE_BYTES, KV_ONLY_DTYPES, Plan, dtype_name, token_slot_indptr
from .sorting import stable_argsort
from .split import (INVARIANT_CHUNK_TOKENS, LOADED_LATENCY, SPLIT_RULES, _MAX_CANDIDATE,
                    _choose_threshold_nb, _left, _price_constants, _split_parts, auto_split_share,
                    invariant_chunk, split_long_kv, split_threshold)
from .tiles import TileSelector
from .tuning import Tuning, _tuning_key, merge_min_part  # noqa: F401  (Tuning: re-exported)


@njit(cache=True, nogil=True)
def _layout(req_indptr, reqs, src, kv_start, kv_len, order, table, page_size, batch):
    """:func:`_layout_parts`, called from Python (compiled code calls ``_layout_parts``: a
    cached function that is both an entry point and a callee can hand Python arrays it
    cannot read)."""
    return _layout_parts(req_indptr, reqs, src, kv_start, kv_len, order, table, page_size,
                         batch)


@njit(cache=True, nogil=True)
def _layout_parts(req_indptr, reqs, src, kv_start, kv_len, order, table, page_size, batch):
    """Per-CTA arrays in launch order: requests, slots, pages (one pass, no temporaries).

    ``src [C]`` pack of each CTA, ``order [C]`` launch order.  Slots are numbered request by
    request (request ``r`` owns ``req_slot_indptr[r]:req_slot_indptr[r+1]``), in CTA order.
    """
    C = order.shape[0]
    req_ptr = np.zeros(C + 1, dtype=np.int32)
    page_ptr = np.zeros(C + 1, dtype=np.int32)
    per_req = np.zeros(batch + 1, dtype=np.int32)
    for i in range(C):
        c = order[i]
        p = src[c]
        req_ptr[i + 1] = req_ptr[i] + req_indptr[p + 1] - req_indptr[p]
        first = kv_start[c] // page_size
        last = (kv_start[c] + kv_len[c] - 1) // page_size
        page_ptr[i + 1] = page_ptr[i] + last - first + 1
        for k in range(req_indptr[p], req_indptr[p + 1]):
            per_req[reqs[k] + 1] += 1
    for r in range(batch):
        per_req[r + 1] += per_req[r]
    req_slot_indptr = per_req.copy()
    cta_req = np.empty(req_ptr[C], dtype=np.int32)
    cta_slot = np.empty(req_ptr[C], dtype=np.int32)
    pages = np.empty(page_ptr[C], dtype=np.int32)
    nxt = per_req[:batch].copy()
    for i in range(C):
        c = order[i]
        p = src[c]
        j = req_ptr[i]
        for k in range(req_indptr[p], req_indptr[p + 1]):
            r = reqs[k]
            cta_req[j] = r
            cta_slot[j] = nxt[r]
            nxt[r] += 1
            j += 1
        rep = reqs[req_indptr[p]]          # any member: they agree on the shared range
        first = kv_start[c] // page_size
        n = page_ptr[i + 1] - page_ptr[i]
        pages[page_ptr[i]:page_ptr[i] + n] = table[rep, first:first + n]
    return req_ptr, cta_req, cta_slot, page_ptr, pages, req_slot_indptr


@njit(cache=True, nogil=True)
def _lexsort_nb(keys):
    """``np.lexsort`` of the rows of int64 ``keys [k, C]`` (last row primary), by stable
    sorts from the least significant key."""
    order = np.argsort(keys[0], kind="mergesort")
    for j in range(1, keys.shape[0]):
        order = order[np.argsort(keys[j][order], kind="mergesort")]
    return order


@njit(cache=True, nogil=True)
def _tail_nb(req_indptr, kv_start, kv_end, level, thr, pack_rows, m_values, bounds, fid, cfg_m,
             order_mode, page_size):
    """Split, tile and order the packs in one pass (what :func:`assemble_plan` does with NumPy
    calls, same results).  ``pack_rows``: int64 ``[K]``, each pack's query rows.
    ``order_mode``: 0 ``"tile"``, 1 ``"work"``, 2 ``"shared"``, 3 cascade.  Returns the split CTAs (``src``, ``kv_start``, ``kv_len``, int32 ``[C]``), the
    launch order (int32 ``[C]``), the used configs (bool ``[F]``), each CTA's tile index in
    launch order, the groups (``group_indptr``, ``group_tile``) and the plan's page-entry and
    (CTA, request) pair counts (int64, for the int32 check)."""
    K = kv_start.shape[0]
    src, start, ln = _split_parts(kv_start, kv_end, np.full(K, thr, dtype=np.int64))
    C = src.shape[0]
    F = cfg_m.shape[0]
    nreq = np.empty(C, dtype=np.int64)
    f = np.empty(C, dtype=np.int64)
    used = np.zeros(F, dtype=np.bool_)
    n_pages = 0
    n_pairs = 0
    for i in range(C):
        p = src[i]
        nreq[i] = req_indptr[p + 1] - req_indptr[p]
        f[i] = fid[_left(m_values, pack_rows[p]), _left(bounds, np.int64(ln[i]))]
        used[f[i]] = True
        n_pages += (np.int64(start[i]) + ln[i] - 1) // page_size - start[i] // page_size + 1
        n_pairs += nreq[i]
    rank = np.empty(F, dtype=np.int64)
    T = 0
    for u in range(F):
        rank[u] = T
        if used[u]:
            T += 1
    tile_idx = np.empty(C, dtype=np.int64)
    for i in range(C):
        tile_idx[i] = rank[f[i]]
    if order_mode == 3:
        gkey = np.empty(C, dtype=np.int64)
        for i in range(C):
            gkey[i] = np.int64(level[src[i]]) * T + tile_idx[i]
        order = stable_argsort(gkey)
    elif order_mode == 0:
        gkey = tile_idx
        order = stable_argsort(gkey)
    else:
        # rank tile groups by their largest CTA's work (rows x tokens) or request count
        gwork = np.zeros(T, dtype=np.int64)
        for i in range(C):
            w = cfg_m[f[i]] * np.int64(ln[i]) if order_mode == 1 else nreq[i]
            if w > gwork[tile_idx[i]]:
                gwork[tile_idx[i]] = w
        grank = np.empty(T, dtype=np.int64)
        go = np.argsort(-gwork, kind="mergesort")
        for r in range(T):
            grank[go[r]] = r
        gkey = np.empty(C, dtype=np.int64)
        for i in range(C):
            gkey[i] = grank[tile_idx[i]]
        if order_mode == 1:
            # one stable sort of (group rank, longest first): kv_len < 2^31 fits the low bits
            key = np.empty(C, dtype=np.int64)
            for i in range(C):
                key[i] = (gkey[i] << 32) | (np.int64(2147483648) - ln[i])
            order = stable_argsort(key)
        else:
            keys = np.empty((3, C), dtype=np.int64)
            for i in range(C):
                keys[0, i] = -np.int64(ln[i])
                keys[1, i] = -nreq[i]
                keys[2, i] = gkey[i]
            order = _lexsort_nb(keys)
    order32 = order.astype(np.int32)
    ng = 1
    for i in range(1, C):
        if gkey[order[i]] != gkey[order[i - 1]]:
            ng += 1
    group_indptr = np.empty(ng + 1, dtype=np.int32)
    group_tile = np.empty(ng, dtype=np.int32)
    cta_tile = np.empty(C, dtype=np.int32)
    g = 0
    for i in range(C):
        cta_tile[i] = tile_idx[order[i]]
        if i == 0 or gkey[order[i]] != gkey[order[i - 1]]:
            group_indptr[g] = i
            group_tile[g] = cta_tile[i]
            g += 1
    group_indptr[ng] = C
    return (src, start, ln, order32, used, cta_tile, group_indptr, group_tile, n_pages,
            n_pairs)


def _grown(packs: Packs, which: np.ndarray, end: np.ndarray) -> Packs:
    """``packs`` with packs ``which`` (int ``[k]``) ending at ``end`` (int ``[k]``): a new
    ``kv_end``, the other arrays shared (no step writes them in place)."""
    kv_end = packs.kv_end.copy()
    kv_end[which] = end
    return Packs(req_indptr=packs.req_indptr, reqs=packs.reqs, kv_start=packs.kv_start,
                 kv_end=kv_end, level=packs.level, leaf_pack=packs.leaf_pack, rows=packs.rows)


@njit(cache=True, nogil=True)
def _tail_layout_nb(req_indptr, reqs, kv_start, kv_end, level, thr, pack_rows, m_values, bounds,
                    fid, cfg_m, order_mode, table, page_size, batch):
    """:func:`_tail_nb` then :func:`_layout` in one call: the plan's arrays in launch order.
    Returns ``(used, cta_tile, group_indptr, group_tile, cta_kv_start, cta_kv_len,
    cta_req_indptr, cta_req, cta_slot, cta_page_indptr, cta_pages, req_slot_indptr, n_pages,
    n_pairs)``; past int32 (``max(n_pages, n_pairs) > 2^31 - 1``) the layout arrays are empty
    and the caller refuses the batch.  (The entry point of :func:`_tail_layout_parts`, which
    compiled code calls: see :func:`_layout`.)"""
    return _tail_layout_parts(req_indptr, reqs, kv_start, kv_end, level, thr, pack_rows,
                              m_values, bounds, fid, cfg_m, order_mode, table, page_size, batch)


@njit(cache=True, nogil=True)
def _sm_plan_nb(req_indptr, reqs, kv_start, kv_end, level, group, rows, num_kv_heads, num_sms,
                min_part, head_dim, kv_bytes, m_values, bounds, fid, cfg_slot, cfg_inflight,
                bandwidth, latency, max_rows, cfg_m, order_mode, table, page_size, batch):
    """The default split rule's plan arrays in one call (one dispatch per step, no Python in
    between): :func:`pat_core.split._choose_threshold_nb`'s threshold and most rows, then
    :func:`_tail_layout_parts` at that threshold.  ``rows``: int64 ``[K]`` each pack's query
    rows, or empty (requests x ``group``).  Returns ``(thr, most, arrays)`` with ``arrays``
    :func:`_tail_layout_nb`'s tuple; where a pack has more than ``max_rows`` rows (the caller
    refuses it) the layout is not run and ``arrays`` holds empty arrays."""
    thr, most = _choose_threshold_nb(req_indptr, kv_start, kv_end, group, rows, num_kv_heads,
                                     num_sms, min_part, head_dim, kv_bytes, m_values, bounds,
                                     fid, cfg_slot, cfg_inflight, bandwidth, latency)
    K = kv_start.shape[0]
    if rows.shape[0] == K:
        pack_rows = rows
    else:
        pack_rows = np.empty(K, dtype=np.int64)
        for p in range(K):
            pack_rows[p] = np.int64(req_indptr[p + 1] - req_indptr[p]) * group
    if most > max_rows:
        e = np.empty(0, dtype=np.int32)
        return thr, most, (np.zeros(cfg_m.shape[0], dtype=np.bool_), e, e, e, e, e, e, e, e, e,
                           e, e, np.int64(0), np.int64(0))
    return thr, most, _tail_layout_parts(req_indptr, reqs, kv_start, kv_end, level, thr,
                                         pack_rows, m_values, bounds, fid, cfg_m, order_mode,
                                         table, page_size, batch)


@njit(cache=True, nogil=True)
def _tail_layout_parts(req_indptr, reqs, kv_start, kv_end, level, thr, pack_rows, m_values,
                       bounds, fid, cfg_m, order_mode, table, page_size, batch):
    """:func:`_tail_layout_nb`'s body (compiled callers call this one)."""
    (src, start, ln, order, used, cta_tile, group_indptr, group_tile, n_pages,
     n_pairs) = _tail_nb(req_indptr, kv_start, kv_end, level, thr, pack_rows, m_values,
                         bounds, fid, cfg_m, order_mode, page_size)
    C = order.shape[0]
    cta_kv_start = np.empty(C, dtype=np.int32)
    cta_kv_len = np.empty(C, dtype=np.int32)
    for i in range(C):
        cta_kv_start[i] = start[order[i]]
        cta_kv_len[i] = ln[order[i]]
    if max(n_pages, n_pairs) > INT32_MAX:
        e = np.empty(0, dtype=np.int32)
        return (used, cta_tile, group_indptr, group_tile, cta_kv_start, cta_kv_len, e, e, e,
                e, e, e, n_pages, n_pairs)
    req_ptr, cta_req, cta_slot, page_ptr, pages, req_slot_indptr = _layout_parts(
        req_indptr, reqs, src, start, ln, order, table, page_size, batch)
    return (used, cta_tile, group_indptr, group_tile, cta_kv_start, cta_kv_len, req_ptr,
            cta_req, cta_slot, page_ptr, pages, req_slot_indptr, n_pages, n_pairs)


_ORDER_MODE = {"tile": 0, "work": 1, "shared": 2}


def assemble_plan(bt: BlockTable, packs: Packs, *, num_qo_heads: int, num_kv_heads: int,
                  head_dim: int, sm_scale: float, packer: str, selector: TileSelector,
                  kv_dtype: str, serial: bool = False, split=True,
                  tuning: Tuning | None = None) -> Plan:
    """Split, tile and lay out ``packs`` as a :class:`Plan` (no per-CTA Python: under the
    default split rule one compiled call, :func:`_sm_plan_nb`, chooses the threshold and
    builds every array; the other rules choose it in NumPy, then :func:`_tail_nb` and
    :func:`_layout` run, unless the tuning splits by work).  A pack's query rows are
    :meth:`Packs.pack_rows` (its requests' query tokens x the GQA group).

    Parts are at least ``tuning.min_part`` tokens; under the ``"sm"`` rule a plan that merges
    anyway (more partial slots than requests) is split again with parts down to
    :func:`~pat_core.tuning.merge_min_part`, where that can cut finer (a small step: see
    :class:`~pat_core.tuning.Tuning`), unless the finer parts need a second wave of some
    tile where the coarse ones did not (:func:`second_wave`)."""
    tuning = tuning or Tuning()
    kw = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              sm_scale=sm_scale, packer=packer, selector=selector, kv_dtype=kv_dtype,
              serial=serial, split=split)
    plan = _assemble(bt, packs, tuning=tuning, **kw)
    fine = min(merge_min_part(tuning), tuning.min_part)
    rule = (split if isinstance(split, str) else "sm") if split else None
    # the "mean" rule reads no min_part: nothing to cut again
    if fine < tuning.min_part and rule == "sm" and plan.num_slots > plan.batch_size \
            and packs.kv_start.size:
        length = packs.kv_end - packs.kv_start
        # splitting by tokens, the coarse bound binds only where a part under the largest
        # share tried (split.CANDIDATE_SHARES, or the tuning's own) would be shorter than it
        share = max(_MAX_CANDIDATE, tuning.split_share or 0.0)
        per_sm = float(length.sum()) * num_kv_heads / (share * selector.gpu.num_sms)
        if int(length.max()) > fine and (per_sm < tuning.min_part
                                         or tuning.split_by != "tokens"):
            finer = _assemble(bt, packs, tuning=dataclasses.replace(tuning, min_part=fine),
                              **kw)
            # not where the finer parts need a second wave of some tile and the coarse ones
            # did not (H100, head_dim 256, 1,2_2048,64 at 32:8: 34 CTAs on 16x32 blocks, two
            # per SM, 272 items for 264 slots, 23.9 us against 20.8 for the coarse plan)
            if not second_wave(finer, selector.gpu, kv_dtype) or \
                    second_wave(plan, selector.gpu, kv_dtype):
                plan = finer
    return plan


def second_wave(plan: Plan, gpu, kv_dtype: str) -> bool:
    """Whether some tile of ``plan`` has more work items (its CTAs x KV heads) than the blocks
    its kernel keeps resident on ``gpu`` (blocks per SM x SMs), so its last items wait for a
    second wave.  ``kv_dtype``: the cache's element type (the fp8 kernels' own resources)."""
    from .tiles import resource_dtype, tile_resources
    dtype = resource_dtype(DTYPE_BYTES[kv_dtype])
    counts = np.bincount(plan.cta_tile, minlength=plan.tile_configs.shape[0])
    for (m, n), c in zip(plan.tile_configs.tolist(), counts.tolist()):
        if c == 0:
            continue
        res = tile_resources(m, n, plan.head_dim, dtype, gpu)
        if c * plan.num_kv_heads > max(res.ctas_per_sm(gpu), 1) * gpu.num_sms:
            return True
    return False


def _assemble(bt: BlockTable, packs: Packs, *, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, sm_scale: float, packer: str, selector: TileSelector,
              kv_dtype: str, serial: bool, split, tuning: Tuning) -> Plan:
    """:func:`assemble_plan` at ``tuning.min_part``."""
    group = num_qo_heads // num_kv_heads
    selector = selector.for_step(packs.kv_start.shape[0] * num_kv_heads)
    gpu = selector.gpu
    weight = None
    rule = (split if isinstance(split, str) else "sm") if split else None
    if packer == "cascade":
        serial, mode = True, 3
    else:
        mode = _ORDER_MODE[tuning.order]
    if rule == "sm" and tuning.split_share is None and tuning.split_by == "tokens":
        # the default: share, threshold, rows check, split, tiles and layout in one compiled
        # call (choose_split_threshold_fast's threshold, then what follows below)
        k = _sm_constants(selector, num_kv_heads, head_dim, DTYPE_BYTES[kv_dtype], gpu)
        thr, most, arrays = _sm_plan_nb(
            packs.req_indptr, packs.reqs, packs.kv_start, packs.kv_end, packs.level, group,
            k[0] if packs.rows is None else packs.rows, num_kv_heads, gpu.num_sms,
            int(tuning.min_part), head_dim, DTYPE_BYTES[kv_dtype], *k[1:8], selector.max_rows,
            k[8], mode, bt.table, bt.page_size, bt.batch_size)
        if most > selector.max_rows:
            raise ValueError(f"a CTA has {most} rows; the largest tile has "
                             f"{selector.max_rows}")
        return _plan_of_arrays(bt, arrays, k[9], num_qo_heads=num_qo_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, sm_scale=sm_scale,
                               packer=packer, gpu=gpu, kv_dtype=kv_dtype, serial=serial)
    pack_rows = packs.pack_rows(group)
    # the other rules (a fixed share, split by work, no split): in NumPy
    length = packs.kv_end - packs.kv_start
    rows = pack_rows
    if rows.size and int(rows.max()) > selector.max_rows:
        raise ValueError(f"a CTA has {int(rows.max())} rows; the largest tile has "
                         f"{selector.max_rows}")
    if rule is not None:
        if rule == "sm" and tuning.split_by == "work":
            weight = selector.row_time_weight(rows)
        share = tuning.split_share
        if share is None and rule == "sm":
            share = auto_split_share(length, rows, num_kv_heads, gpu.num_sms,
                                     min_part=tuning.min_part)
        thr = split_threshold(length, num_kv_heads, gpu.num_sms, rule=rule,
                              min_part=tuning.min_part,
                              share=2.0 if share is None else share, weight=weight)
    else:
        thr = int(length.max()) if length.size else 1
    if weight is not None:
        return _assemble_weighted(bt, packs, thr, weight, num_qo_heads=num_qo_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  sm_scale=sm_scale, packer=packer, selector=selector,
                                  kv_dtype=kv_dtype, serial=serial, tuning=tuning)
    m_values, bounds, fid, configs = selector.lookup()
    arrays = _tail_layout_nb(
        packs.req_indptr, packs.reqs, packs.kv_start, packs.kv_end, packs.level, int(thr),
        pack_rows, m_values, bounds, fid, np.ascontiguousarray(configs[:, 0]), mode, bt.table,
        bt.page_size, bt.batch_size)
    return _plan_of_arrays(bt, arrays, configs, num_qo_heads=num_qo_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, sm_scale=sm_scale,
                           packer=packer, gpu=gpu, kv_dtype=kv_dtype, serial=serial)


def _sm_constants(selector: TileSelector, num_kv_heads: int, head_dim: int, kv_bytes: int,
                  gpu) -> tuple:
    """What :func:`_sm_plan_nb` needs of the selector besides the packs, kept on the selector
    per ``(num_kv_heads, head_dim, kv_bytes)`` (one build, then a dict lookup per plan):
    ``(no_rows, m_values, bounds, fid, slot, inflight, bandwidth, latency, cfg_m, configs)``
    -- an empty int64 rows array, :meth:`TileSelector.lookup`'s arrays, the price constants
    (:func:`pat_core.split._price_constants`), the pull model's bandwidth (bytes/ns) and
    loaded latency (ns), the configs' ``m`` (int64 ``[F]``) and the configs (int64
    ``[F, 2]``)."""
    memo = selector.__dict__.setdefault("_sm_memo", {})
    key = (num_kv_heads, head_dim, kv_bytes)
    hit = memo.get(key)
    if hit is None:
        m_values, bounds, fid, configs = selector.lookup()
        slot, inflight = _price_constants(selector, num_kv_heads, head_dim, kv_bytes, gpu)
        hit = memo[key] = (
            np.zeros(0, dtype=np.int64), m_values, bounds, fid, slot, inflight,
            float(gpu.hbm_bandwidth * gpu.achieved_bw_fraction),
            float(gpu.mem_latency_ns * LOADED_LATENCY), np.ascontiguousarray(configs[:, 0]),
            configs)
    return hit


def _plan_of_arrays(bt: BlockTable, arrays: tuple, configs: np.ndarray, *, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, sm_scale: float, packer: str, gpu,
                    kv_dtype: str, serial: bool) -> Plan:
    """The :class:`Plan` of :func:`_tail_layout_nb`'s ``arrays`` (``configs``: int64
    ``[F, 2]``, the selector's configs its ``used`` mask indexes); ``ValueError`` where the
    lists would not fit int32."""
    (used, cta_tile, group_indptr, group_tile, cta_kv_start, cta_kv_len, req_ptr, cta_req,
     cta_slot, page_ptr, pages, req_slot_indptr, n_pages, n_pairs) = arrays
    # the Plan's arrays are int32: refuse a batch whose lists would not fit rather than wrap
    if max(n_pages, n_pairs) > INT32_MAX:
        raise ValueError(f"block_tables: the plan would list {n_pages} page entries and "
                         f"{n_pairs} (CTA, request) pairs; the int32 Plan holds at most 2^31 - 1")
    return Plan(
        batch_size=bt.batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=bt.page_size, sm_scale=float(sm_scale), packer=packer,
        gpu=gpu.name, kv_dtype=kv_dtype, serial=bool(serial),
        tile_configs=configs[used].astype(np.int32), group_indptr=group_indptr,
        group_tile=group_tile, cta_tile=cta_tile, cta_req_indptr=req_ptr, cta_req=cta_req,
        cta_slot=cta_slot, cta_kv_start=cta_kv_start, cta_kv_len=cta_kv_len,
        cta_page_indptr=page_ptr, cta_pages=pages, req_slot_indptr=req_slot_indptr,
        seq_lens=bt.seq_lens.astype(np.int32),
    )


def _assemble_weighted(bt: BlockTable, packs: Packs, thr: int, weight: np.ndarray, *,
                       num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float,
                       packer: str, selector: TileSelector, kv_dtype: str, serial: bool,
                       tuning: Tuning) -> Plan:
    """:func:`assemble_plan` when the split cuts each pack at ``thr / weight[p]`` tokens
    (``split_by="work"``), in NumPy."""
    group = num_qo_heads // num_kv_heads
    gpu = selector.gpu
    src, kv_start, kv_len = split_long_kv(packs, thr, weight, min_part=tuning.min_part)
    nreq = np.diff(packs.req_indptr)[src]
    mn = selector.select(packs.pack_rows(group)[src], kv_len)
    # distinct tile configs, then launch groups (cascade: one group per level and config)
    tkey = mn[:, 0].astype(np.int64) * 65536 + mn[:, 1]
    ukey, tile_idx = np.unique(tkey, return_inverse=True)
    tiles = np.stack([ukey // 65536, ukey % 65536], axis=1).astype(np.int32)
    tile_idx = tile_idx.reshape(-1).astype(np.int32)
    if packer == "cascade":
        serial = True
        gkey = packs.level[src].astype(np.int64) * len(tiles) + tile_idx
        order = np.argsort(gkey, kind="stable")
    elif tuning.order in ("work", "shared"):
        # rank tile groups by their largest CTA's work (rows x tokens) or request count,
        # biggest first; inside a group ("work") the longest KV first, so the CTAs that take
        # longest start first, or ("shared") the most requests first, then the longest KV
        work = (mn[:, 0].astype(np.int64) * kv_len if tuning.order == "work"
                else nreq.astype(np.int64))
        gwork = np.zeros(len(tiles), dtype=np.int64)
        np.maximum.at(gwork, tile_idx, work)
        grank = np.empty(len(tiles), dtype=np.int64)
        grank[np.argsort(-gwork, kind="stable")] = np.arange(len(tiles))
        gkey = grank[tile_idx]
        keys = (-kv_len.astype(np.int64), gkey) if tuning.order == "work" else \
            (-kv_len.astype(np.int64), -nreq.astype(np.int64), gkey)
        order = np.lexsort(keys)
    else:
        gkey = tile_idx.astype(np.int64)
        order = np.argsort(gkey, kind="stable")
    order = order.astype(np.int32)
    gkey = gkey[order]
    bounds = np.flatnonzero(np.diff(gkey)) + 1
    group_indptr = np.concatenate(([0], bounds, [gkey.shape[0]])).astype(np.int32)
    tile_idx = tile_idx[order]
    group_tile = tile_idx[group_indptr[:-1]].astype(np.int32)
    B = bt.batch_size
    # the Plan's arrays are int32: refuse a batch whose lists would not fit rather than wrap
    n_pages = int(((kv_start.astype(np.int64) + kv_len - 1) // bt.page_size
                   - kv_start // bt.page_size + 1).sum())
    n_pairs = int(nreq.astype(np.int64).sum())
    if max(n_pages, n_pairs) > np.iinfo(np.int32).max:
        raise ValueError(f"block_tables: the plan would list {n_pages} page entries and "
                         f"{n_pairs} (CTA, request) pairs; the int32 Plan holds at most 2^31 - 1")
    req_ptr, cta_req, cta_slot, page_ptr, pages, req_slot_indptr = _layout(
        packs.req_indptr, packs.reqs, src, kv_start, kv_len, order, bt.table, bt.page_size, B)
    plan = Plan(
        batch_size=B, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=bt.page_size, sm_scale=float(sm_scale), packer=packer, gpu=gpu.name,
        kv_dtype=kv_dtype, serial=bool(serial),
        tile_configs=tiles, group_indptr=group_indptr, group_tile=group_tile,
        cta_tile=tile_idx, cta_req_indptr=req_ptr, cta_req=cta_req, cta_slot=cta_slot,
        cta_kv_start=kv_start[order], cta_kv_len=kv_len[order],
        cta_page_indptr=page_ptr, cta_pages=pages, req_slot_indptr=req_slot_indptr,
        seq_lens=bt.seq_lens.astype(np.int32),
    )
    return plan




# A batch-invariant plan's tile rows: the smallest feasible m of at least this many rows (and
# at least the GQA group).  One tile serves every CTA, so it must hold a shared chunk's
# readers (more rows, fewer CTAs re-reading it) without making private requests' CTAs too
# tall; the simulator's development-set sweep chose it (docs/design.md).
INVARIANT_ROWS = 16


def invariant_tile(selector: TileSelector, group: int) -> tuple:
    """The one ``(m, n)`` of a batch-invariant plan: the smallest feasible ``m`` of at least
    ``max(group, INVARIANT_ROWS)`` rows (the largest where none is), and the ``n`` the
    selector picks for that ``m`` at the default chunk's length
    (:data:`pat_core.split.INVARIANT_CHUNK_TOKENS`, whatever ``Tuning.invariant_chunk`` says).
    A function of the plan's parameters (head_dim, dtype, GPU, group), never of the batch."""
    want = max(int(group), INVARIANT_ROWS)
    ms = [int(m) for m in selector.m_values if m >= want]
    m = ms[0] if ms else selector.max_rows
    return m, selector.pick_n(m, INVARIANT_CHUNK_TOKENS)


def invariant_plan(bt: BlockTable, forest: PrefixForest, *, num_qo_heads: int,
                   num_kv_heads: int, head_dim: int, sm_scale: float, packer: str,
                   selector: TileSelector, kv_dtype: str, serial: bool, tuning: Tuning,
                   chunk: int) -> Plan:
    """The batch-invariant Plan of ``forest`` (:func:`pat_core.packers.chunk_packs`): every
    CTA reads inside one fixed ``chunk`` of absolute KV positions from its start, every CTA
    has the selector's one tile, and no split.  A request's CTAs' token ranges, their order
    (chunk order, hence its partial slots' order) and its tile are functions of its own
    ``seq_len``; the kernels' rows do not depend on each other, so its output and LSE are
    the same bits whatever else is in the batch."""
    group = num_qo_heads // num_kv_heads
    m = int(selector.max_rows)          # the selector holds the one fixed tile
    if tuning.max_rows is not None:
        m = max(group, min(m, int(tuning.max_rows)))
    packs = chunk_packs(forest, chunk, group, m)
    plan = assemble_plan(bt, packs, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, sm_scale=sm_scale, packer=packer,
                         selector=selector, kv_dtype=kv_dtype, serial=serial, split=False,
                         tuning=tuning)
    plan.batch_invariant = True
    plan.extra["chunk"] = int(chunk)
    return plan


def fp8_q_dtype(kv_dtype: str, q_data_type) -> str:
    """The query/output dtype of a plan whose KV cache is ``kv_dtype`` (a canonical name):
    ``q_data_type`` when given, else ``kv_dtype``, except that a KV-cache-only dtype (fp8)
    defaults to ``"float16"`` queries and refuses fp8 ones (``TypeError`` naming
    ``q_data_type``)."""
    if q_data_type is None:
        return "float16" if kv_dtype in KV_ONLY_DTYPES else kv_dtype
    q_dtype = dtype_name(q_data_type, "q_data_type")
    if q_dtype in KV_ONLY_DTYPES:
        raise TypeError(f"q_data_type={q_dtype!r} is a KV-cache-only dtype; queries and the "
                        "output are float16 or bfloat16")
    if kv_dtype in KV_ONLY_DTYPES and q_dtype not in ("float16", "bfloat16"):
        raise TypeError(f"q_data_type={q_dtype!r}: an fp8 KV cache is read by float16 or "
                        "bfloat16 queries")
    return q_dtype


def tile_selector_for(gpu, tuning: Tuning, head_dim: int, kv_data_type="float16",
                      tile=None) -> TileSelector:
    """The tile selector a planner with ``gpu`` (a :class:`~pat_core.gpus.GPUSpec`) and
    ``tuning`` uses (:meth:`Planner.tile_selector`): the tuning's KV-length table or the
    GPU's, the tuning's ``exclude_tiles`` left out, ``tile`` forcing one config; with
    :attr:`TileSelector.busy` set where the GPU has a busy-step table for ``head_dim``.  One
    shared object per configuration for the whole process: treat it as read-only."""
    kv = dtype_name(kv_data_type, "kv_data_type")
    exclude = None if tile is not None else tuning.exclude_tiles
    # one selector per configuration (a full plan asks for it; building one costs 10-25 us)
    key = (gpu, tuning.kv_tile_table, exclude, head_dim, kv,
           None if tile is None else tuple(tile))
    try:
        sel = _SELECTORS.get(key)
    except TypeError:             # an unhashable tile: TileSelector names what is wrong
        sel = key = None
    if sel is not None:
        return sel
    if tuning.kv_tile_table is not None:
        gpu = dataclasses.replace(gpu, kv_tile_table=tuple(tuning.kv_tile_table))
    sel = TileSelector(head_dim, kv, gpu, fixed=tile, exclude=exclude)
    busy = gpu.busy_kv_tile_table(head_dim)
    if busy is not None and tile is None and tuning.kv_tile_table is None:
        # steps that fill the GPU many times over take the busy table (GPUSpec docstring)
        sel.busy = TileSelector(head_dim, kv, dataclasses.replace(gpu, kv_tile_table=busy),
                                exclude=exclude)
        sel.busy_items = int(math.ceil(gpu.busy_items_per_sm * gpu.num_sms))
    if key is not None:
        if len(_SELECTORS) >= 256:
            _SELECTORS.clear()
        _SELECTORS[key] = sel
    return sel


_SELECTORS: dict = {}   # tile_selector_for's selectors by configuration


class Planner:
    """Plans decode batches for one packer and remembers the last one (incremental update,
    module docstring).

    :meth:`plan` reads host arrays only (NumPy arrays, lists or CPU tensors; a device tensor
    is refused with a ``TypeError``) and makes no device call of any kind, so it never waits
    on the GPU: an engine may plan step N+1 on another thread while step N runs.  Its
    compiled loops release the GIL (``nogil``).  One planner serves one caller at a time: it
    keeps the last step's state, so two threads share no planner.

    Parameters
    ----------
    packer : one of ``"pat"``, ``"query"``, ``"node"``, ``"compute"``, ``"cascade"``.
    gpu : GPU spec or name used by the tile solver and the split rule (default ``"h100"``).
    tuning : :class:`Tuning` knobs (default: the measured defaults); ``planner.tuning`` may be
        replaced between plans.
    """

    def __init__(self, packer: str = "pat", gpu="h100", tuning: Tuning | None = None):
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {PACKERS}, got {packer!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a pat_core.planner.Tuning, got {tuning!r}")
        self.packer = packer
        self.gpu = get_gpu(gpu)
        self.tuning = tuning or Tuning()
        self._cache = None
        self.last_path = None   # what the last plan() did (module docstring)

    def plan(self, block_tables, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, sm_scale: float | None = None, kv_data_type="float16",
             q_data_type=None, tile=None, serial: bool = False, split=True,
             batch_invariant: bool = False, qo_indptr=None) -> Plan:
        """Make (or reuse) the Plan of one decode batch.  Arguments as
        :meth:`pat_core.PrefixAttentionWrapper.plan`.

        With ``qo_indptr`` (int ``[batch + 1]``, several query tokens per request) every call
        plans from scratch (``last_path == "full"``) and the next call does too: the
        incremental paths keep one token per request."""
        if not isinstance(batch_invariant, (bool, np.bool_)):
            raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        if batch_invariant and self.packer != "pat":
            raise ValueError(f"batch_invariant=True packs by fixed KV chunks (its own packing); "
                             f"it needs packer='pat', got packer={self.packer!r}")
        if batch_invariant and qo_indptr is not None:
            raise ValueError("qo_indptr with batch_invariant=True is not supported: the "
                             "invariant packing runs one query token per request")
        num_qo_heads, num_kv_heads, head_dim = check_heads(num_qo_heads, num_kv_heads, head_dim)
        page_size = check_size(page_size, "page_size")
        kv_dtype = dtype_name(kv_data_type, "kv_data_type")
        q_dtype = fp8_q_dtype(kv_dtype, q_data_type)
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_dim)
        if isinstance(sm_scale, (bool, np.bool_)):
            raise TypeError(f"sm_scale must be a number, got the bool {sm_scale!r}")
        try:
            sm_scale = float(sm_scale)
        except (TypeError, ValueError):
            raise TypeError(f"sm_scale must be a number, got {sm_scale!r}") from None
        except OverflowError:                   # an int past the float range
            sm_scale = math.inf
        # the kernels take it as a float32, where a larger value is inf (NaN output)
        if not math.isfinite(sm_scale) or sm_scale <= 0 or sm_scale > FLOAT32_MAX:
            raise ValueError(f"sm_scale must be a positive finite number (at most the float32 "
                             f"maximum, 3.4e38), got {sm_scale}")
        if tile is not None:
            if not hasattr(tile, "__iter__"):
                raise TypeError(f"tile must be a pair of ints (m, n), got {tile!r}")
            if len(tuple(tile)) != 2 or not all(isinstance(x, (int, np.integer))
                                                for x in tile):
                raise ValueError(f"tile must be a pair of ints (m, n), got {tile!r}")
        if not (isinstance(split, (bool, np.bool_)) or (isinstance(split, str)
                                                        and split in SPLIT_RULES)):
            raise ValueError(f"split must be True, False or one of {SPLIT_RULES}, got {split!r}")
        if not isinstance(serial, (bool, np.bool_)):
            raise TypeError(f"serial must be a bool, got {serial!r}")
        params = (num_qo_heads, num_kv_heads, head_dim, page_size, float(sm_scale), kv_dtype,
                  q_dtype, None if tile is None else tuple(int(x) for x in tile), bool(serial),
                  split, _tuning_key(self.tuning))
        raw = block_tables
        if hasattr(raw, "numpy") and hasattr(raw, "device") and str(raw.device) == "cpu":
            raw = raw.numpy()                   # CPU tensor: same memory, no copy
        raw = raw if isinstance(raw, np.ndarray) else None
        if batch_invariant:
            return self._plan_invariant(raw if raw is not None else block_tables, seq_lens,
                                        page_size, tile, dict(
                num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                sm_scale=sm_scale, packer=self.packer, kv_dtype=kv_dtype, serial=serial,
                tuning=self.tuning), q_dtype)
        c = self._cache
        if qo_indptr is not None:
            c = self._cache = None     # ragged queries: the full path (docstring)
        if c is not None and raw is not None and c["params"] == params and raw.ndim == 2 \
                and raw.dtype in (np.int32, np.int64):
            step = self._incremental(c, raw, _check_seq_lens(seq_lens, raw.shape[0]))
            if step is not None:
                return step
        bt = as_block_table(raw if raw is not None else block_tables, seq_lens, page_size)
        qo = None if qo_indptr is None else check_qo_indptr(qo_indptr, bt.seq_lens)
        q_rows = 1 if qo is None else int(np.diff(qo).max())
        selector = self.tile_selector(head_dim, kv_dtype, tile)
        group = num_qo_heads // num_kv_heads
        if group > selector.max_rows:
            raise ValueError(
                f"num_qo_heads / num_kv_heads = {group} exceeds the largest tile "
                f"({selector.max_rows} rows for head_dim={head_dim}, {kv_dtype} on "
                f"{self.gpu.name}): the limit is {selector.max_rows}, as one request's query "
                "heads must fit one CTA (the CPU backend runs the same tiles)")
        if group * q_rows > selector.max_rows:
            raise ValueError(
                f"qo_indptr gives a request {q_rows} query tokens: x {group} query heads per "
                f"KV head = {group * q_rows} rows, more than the largest tile's "
                f"{selector.max_rows} (head_dim={head_dim}, {kv_dtype} on {self.gpu.name}); "
                "one request's query rows must fit one CTA")
        kw = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  sm_scale=sm_scale, packer=self.packer, selector=selector, kv_dtype=kv_dtype,
                  serial=serial, split=split, tuning=self.tuning)
        self._cache = None
        q_lens = None if qo is None or q_rows == 1 else np.diff(qo)
        plan = self._plan_forest(bt, PrefixForest(bt), kw, q_dtype, tile, params, q_lens)
        if qo is not None:
            self._cache = None
            # the int32 Plan: refuse partial rows (slots x tokens) past 2^31 - 1, not wrap
            rows = int(np.diff(qo).astype(np.int64) @ np.diff(plan.req_slot_indptr))
            if rows > INT32_MAX:
                raise ValueError(f"qo_indptr: the plan would hold {rows} partial rows (slots x "
                                 "query tokens); the int32 Plan holds at most 2^31 - 1")
            plan.qo_indptr = qo
            plan.token_slot_indptr = token_slot_indptr(qo, plan.req_slot_indptr)
        self.last_path = "full"
        return plan

    def _plan_invariant(self, block_tables, seq_lens, page_size: int, tile, kw: dict,
                        q_dtype: str) -> Plan:
        """The batch-invariant plan (:func:`invariant_plan`), always from scratch: the
        incremental paths reuse packings that depend on the batch."""
        self._cache = None
        bt = as_block_table(block_tables, seq_lens, page_size)
        group = kw["num_qo_heads"] // kw["num_kv_heads"]
        full = self.tile_selector(kw["head_dim"], kw["kv_dtype"])
        if tile is None:
            tile = invariant_tile(full, group)
        selector = self.tile_selector(kw["head_dim"], kw["kv_dtype"], tile)
        if group > selector.max_rows:
            raise ValueError(f"tile={tuple(tile)}: its {selector.max_rows} rows cannot hold "
                             f"one request's {group} query heads (num_qo_heads / "
                             "num_kv_heads)")
        n = int(selector.feasible[0][1])
        chunk = invariant_chunk(bt.page_size, n, self.tuning.invariant_chunk)
        forest = PrefixForest(bt)
        plan = invariant_plan(bt, forest, selector=selector, chunk=chunk, **kw)
        plan.q_dtype = q_dtype
        plan.extra["forest"] = forest
        plan.extra["block_table"] = bt
        self.last_path = "invariant"
        return plan

    def _plan_forest(self, bt: BlockTable, forest: PrefixForest, kw: dict, q_dtype: str, tile,
                     params, q_lens=None) -> Plan:
        """Pack ``forest``, split, tile and lay out; remember the step (the rest of
        :meth:`plan` after the forest).  ``q_lens``: int ``[B]`` query tokens per request
        (``None``: one each); a request is ``q_len x group`` rows of its CTAs."""
        group = kw["num_qo_heads"] // kw["num_kv_heads"]
        one = group if q_lens is None else group * int(q_lens.max())   # a request's most rows
        selector, kv_dtype = kw["selector"], kw["kv_dtype"]
        head_dim = kw["head_dim"]
        max_rows = selector.max_rows
        if self.tuning.max_rows is not None:
            max_rows = max(one, min(max_rows, int(self.tuning.max_rows)))
        packs = pack(forest, self.packer, group, max_rows,
                     head_dim, DTYPE_BYTES[kv_dtype], DTYPE_BYTES[q_dtype],
                     partial_weight=self.tuning.partial_weight, q_lens=q_lens)
        narrow = None
        if self.packer == "pat" and self.tuning.max_rows is None and tile is None:
            packs, narrow = narrow_packing(forest, packs, group, int(selector.m_values[0]),
                                           self.tuning.narrow_share, head_dim,
                                           DTYPE_BYTES[kv_dtype], DTYPE_BYTES[q_dtype],
                                           self.tuning.partial_weight, q_lens=q_lens)
        pat_packs = packs
        plan = assemble_plan(bt, packs, **kw)
        tried, tokens, query = False, None, None
        # the per-request rule where the plan merges: one CTA per request, each writing its
        # request's output (no partials, no merge), is what the rule measured faster
        if self._request_rule(kw, tile) and plan.num_slots > plan.batch_size:
            tried = True
            query, tokens = request_packing(forest, packs, self._request_share(group), group,
                                            head_dim, kw["num_kv_heads"], self.gpu.l2_bytes,
                                            DTYPE_BYTES[kv_dtype], q_lens=q_lens)
            if query is not None:
                alt_plan = assemble_plan(bt, query, **kw)
                if alt_plan.num_slots == alt_plan.batch_size:   # every request one slot
                    packs, plan = query, alt_plan
        plan.q_dtype = q_dtype
        plan.extra["forest"] = forest
        plan.extra["block_table"] = bt
        self._cache = dict(params=params, kw=kw, q_dtype=q_dtype, tile=tile, bt=bt,
                           forest=forest, pat_packs=pat_packs, plan=plan, narrow=narrow,
                           tried=tried, tokens=tokens, query=query)
        return plan

    def _request_rule(self, kw: dict, tile) -> bool:
        """Whether the per-request rule may replace the ``pat`` packing of this plan."""
        return self.packer == "pat" and self.tuning.max_rows is None and tile is None \
            and not kw["serial"]

    def _incremental(self, c: dict, raw: np.ndarray, new_lens: np.ndarray):
        """The plan of a step from the last one's (:mod:`pat_core.incremental`), or ``None``
        where the step must be planned from scratch (too much changed, or input the full path
        must check and report)."""
        old: BlockTable = c["bt"]
        ps = old.page_size
        npages = (new_lens.astype(np.int64) + ps - 1) // ps
        width = int(npages.max())
        if width > raw.shape[1]:
            return None                          # the full path names the short row
        tbl, match, bad, same, changed, added = _match_rows(
            raw, new_lens, npages, width, old.table, old.num_pages, old.seq_lens, LOOKAHEAD)
        if bad:
            return None
        B = new_lens.shape[0]
        nbt = BlockTable(table=tbl, seq_lens=new_lens, num_pages=npages.astype(np.int32),
                         page_size=ps)
        forest: PrefixForest = c["forest"]
        if same:
            if changed.size == 0:
                self.last_path = "reuse"         # the same pages and lengths
                return c["plan"]
            plan = self._length_update(c, nbt, changed, int(added))
            if plan is not None:
                self.last_path = "lengths"
                return plan
        matched = int((match >= 0).sum())
        if matched < B // 2:
            return None                          # most rows are new: sort from scratch
        size = forest.hi - forest.lo
        own = size[forest.req_node] == 1
        order, lcp, _ = _next_order(tbl, nbt.num_pages, new_lens, match, forest.order,
                                    forest.lcp, old.seq_lens, own, ps)
        plan = self._plan_forest(nbt, PrefixForest(nbt, order, lcp), c["kw"], c["q_dtype"],
                                 c["tile"], c["params"])
        plan.version = c["plan"].version + 1
        self.last_path = "rows"
        return plan

    def _request_share(self, group: int) -> float:
        share = self.tuning.request_share
        return request_share(group) if share is None else float(share)

    #: what :meth:`warmup` walks through: every planning path of a serving loop
    WARMUP_PATHS = ("full", "lengths", "reuse", "rows")

    def warmup(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
               kv_data_type="float16", q_data_type=None, table_dtypes=("int32", "int64")) -> list:
        """Load the compiled code every planning path runs, for one configuration, before the
        first step needs it.

        Each compiled function loads once per process and argument types (from the on-disk
        cache, a few milliseconds each; compiled where the cache has none), and the first step
        that takes a path pays for its functions: half a second at the first plan, then several
        milliseconds the first time requests grow, or leave and join.  This plans a small
        serving loop (a fresh plan, requests growing by a token, the same step again, requests
        leaving and joining: :attr:`WARMUP_PATHS`) with a throwaway planner of the same packer,
        GPU and tuning, once per block-table dtype in ``table_dtypes`` (the caller's table is
        read by compiled code, so its integer type selects the code), each as a contiguous
        array and as a view of a wider buffer (an engine's persistent table; the layout
        selects the code too).  This planner's own
        state is untouched: its next plan is planned as if warmup had not run.  Returns the
        plans of the first loop, the last of each path (a caller warming code that runs on
        plans, e.g. the CUDA backend's host side, uses them)."""
        from .workloads import ServingLoop
        ps = check_size(page_size, "page_size")
        last = {}
        runs = [(np.dtype(dt), view) for dt in table_dtypes for view in (False, True)]
        for i, (dt, view) in enumerate(runs):
            p = Planner(self.packer, self.gpu, self.tuning)
            # short private parts (up to three pages, at least 32 tokens) make requests leave
            # and join within a few steps, with steps between where none does; two shared
            # prompts give the forest shared nodes
            loop = ServingLoop(8, 2, 4 * ps, (1, max(3 * ps, 32)), ps, seed=0)
            seen = set()
            for _ in range(64 * ps):
                table, lens = loop.step()
                if view:
                    buf = np.zeros((table.shape[0] + 1, table.shape[1] + 1), dtype=dt)
                    buf[:-1, :-1] = table
                    table = buf[:-1, :-1]
                else:
                    table = table.astype(dt)
                for _again in range(2):          # the second plan of a step: "reuse"
                    plan = p.plan(table, lens, num_qo_heads, num_kv_heads, head_dim, ps,
                                  kv_data_type=kv_data_type, q_data_type=q_data_type)
                    seen.add(p.last_path)
                    if i == 0:
                        last[p.last_path] = plan
                if seen >= set(self.WARMUP_PATHS):
                    break
            else:
                raise RuntimeError(f"warmup: the serving loop took only {sorted(seen)} of "
                                   f"{list(self.WARMUP_PATHS)}")
        return list(last.values())

    def tile_selector(self, head_dim: int, kv_data_type="float16", tile=None) -> TileSelector:
        """The tile selector :meth:`plan` uses for this head_dim and dtype (the GPU's KV-length
        table, or the tuning's; the tuning's ``exclude_tiles`` left out; ``tile`` forces one
        config)."""
        return tile_selector_for(self.gpu, self.tuning, head_dim, kv_data_type, tile)

    def _length_update(self, c: dict, nbt: BlockTable, changed: np.ndarray, added: int):
        """The plan when the rows are the last step's and only ``changed`` rows (int ``[k]``)
        grew, by ``added`` tokens in all, each from a last token of its own (pages it lists
        may be new): the forest keeps its shape, every pack keeps its requests, and only
        those rows' leaf packs get longer
        (in the ``pat`` packing and in the per-request one alike, so the token totals that
        the narrow and per-request rules compare both grow by the tokens added); the
        choices are made again from those totals, then the split, tiles and layout run again.
        ``None`` where the narrow choice flips (the caller packs the forest again)."""
        pat: Packs = c["pat_packs"]
        lp = pat.leaf_pack[changed]
        if np.any(lp < 0):
            return None                       # a request's last token is shared
        grow = nbt.seq_lens[changed]
        narrow = c["narrow"]
        if narrow is not None:
            share = self.tuning.narrow_share
            wide, thin = narrow[0] + added, narrow[1] + added
            if narrow_wins(wide, thin, share) != narrow_wins(narrow[0], narrow[1], share):
                return None                   # the choice flips: pack again
            narrow = (wide, thin)
        forest = copy.copy(c["forest"])
        forest.end = forest.end.copy()
        forest.end[forest.req_node[changed]] = grow
        forest.block_table = nbt
        p, kw = c["plan"], c["kw"]
        pat = _grown(pat, lp, grow)
        plan = assemble_plan(nbt, pat, **kw)
        tried, tokens, query = False, None, None
        if self._request_rule(kw, c["tile"]) and plan.num_slots > plan.batch_size:
            tried = True
            share = self._request_share(p.group_size)
            if not c["tried"]:
                query, tokens = request_packing(forest, pat, share, p.group_size, p.head_dim,
                                                p.num_kv_heads, self.gpu.l2_bytes,
                                                DTYPE_BYTES[p.kv_dtype])
            elif c["tokens"] is not None:     # None stays None: it depends on no length
                tokens = (c["tokens"][0] + added, c["tokens"][1] + added)
                if request_wins(tokens[0], tokens[1], share):
                    query = c["query"]
                    if query is None:
                        query = pack(forest, "query", p.group_size, p.group_size,
                                     p.head_dim, DTYPE_BYTES[p.kv_dtype])
                    else:
                        query = _grown(query, query.leaf_pack[changed], grow)
            if query is not None:
                alt_plan = assemble_plan(nbt, query, **kw)
                if alt_plan.num_slots == alt_plan.batch_size:
                    plan = alt_plan
        plan.version = p.version + 1
        plan.q_dtype = p.q_dtype
        plan.extra["forest"] = forest
        plan.extra["block_table"] = nbt
        c.update(bt=nbt, forest=forest, pat_packs=pat, plan=plan, narrow=narrow, tried=tried,
                 tokens=tokens, query=query)
        return plan
