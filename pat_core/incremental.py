"""Incremental planning: the sorted request order and adjacent LCPs of the next decode step
from the last step's, without sorting the batch again.

A fresh plan sorts the requests by their page rows (:func:`pat_core.forest.sort_requests`:
lexicographic on page ids, a row that is a prefix of another first, then by length, then by
row index) and takes the token LCP of each adjacent pair; the forest, the packs and the plan
follow deterministically from ``(order, lcp, seq_lens, table)``.  So a step that reproduces
exactly that order and those LCPs makes exactly the fresh plan.  :func:`_next_order` does it
from the last step's:

1. **match rows** (:func:`_match_rows`): new row ``i`` continues old row ``j`` when ``j``'s
   pages are a prefix of ``i``'s and ``i`` is no shorter; a two-pointer walk with a short
   look-ahead matches rows of an engine's batch that keeps its order as requests leave
   (removed rows skipped, joiners unmatched); the same pass writes the new masked table.
2. a matched row that grew keeps its place among the others only when no other row shared its
   last token (its forest node held it alone: they differ at a page both list, and growing
   changes neither that page nor the order); any other grown row is taken out and inserted
   again, as is every unmatched row;
3. **merge** the kept rows (old order) with the inserted ones (sorted by the same key) and take
   each adjacent pair's LCP from the last step where both rows were kept and adjacent (a kept
   row that grew held its last token alone, so that LCP is decided at a page both rows list,
   which did not change), else compare the two rows;
4. ties: identical rows sort by row index.  The matching walk is monotone (a later new row
   continues a later old row), so kept identical rows keep their index order; an inserted one
   is placed by the key with the row index last.

Everything runs in compiled loops: O(block-table entries) to match and mask the table (a
fresh plan reads them all too), O(batch) for the rest plus the rows compared.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# how many old rows the matching walk looks ahead for a new row's predecessor (rows that left
# between two steps, in an engine that keeps its batch in order)
LOOKAHEAD = 8


@njit(cache=True, nogil=True)
def _continues(raw, i, new_len, old_tbl, j, old_npages, old_len):
    """Whether new row ``i`` of ``raw`` (its masked copy) continues old row ``j`` (old pages
    a prefix, no shorter)."""
    k = old_npages[j]
    if new_len[i] < old_len[j] or k > raw.shape[1]:
        return False
    if k > 0 and raw[i, k - 1] != old_tbl[j, k - 1]:     # the private last page: fast miss
        return False
    d = 0
    for c in range(k - 1):               # no early exit: the loop vectorises
        d |= raw[i, c] ^ old_tbl[j, c]
    return d == 0


@njit(cache=True, nogil=True)
def _match_rows(raw, new_len, new_npages, width, old_tbl, old_npages, old_len, lookahead):
    """``(tbl, match, bad, same, changed, added)``: the new masked table (int32
    ``[B, width]``, ``-1`` past each row's pages), the old row each new row continues (int64
    ``[B]``, ``-1``: none), ``bad`` (``True`` when a used entry is negative or past int32: the
    caller re-plans from scratch, which reports it), ``same`` (every row continues the old row
    of its index, and no row left), ``changed`` (int64 ``[k]``: with ``same``, the rows whose
    length changed) and ``added`` (the tokens they added)."""
    B = raw.shape[0]
    Bo = old_tbl.shape[0]
    tbl = np.empty((B, width), dtype=np.int32)
    match = np.full(B, -1, dtype=np.int64)
    bad = False
    j = 0
    same = B == Bo
    n_changed = 0
    added = 0
    for i in range(B):
        # one pass over the caller's row: mask it, then compare the copy (still in cache)
        k = new_npages[i]
        for c in range(width):
            if c < k:
                v = raw[i, c]
                if v < 0 or v > 2147483647:
                    bad = True
                tbl[i, c] = v
            else:
                tbl[i, c] = -1
        for d in range(lookahead):
            if j + d >= Bo:
                break
            if _continues(tbl, i, new_len, old_tbl, j + d, old_npages, old_len):
                match[i] = j + d
                j = j + d + 1
                break
        if match[i] != i:
            same = False
        elif new_len[i] != old_len[i]:
            n_changed += 1
            added += new_len[i] - old_len[i]
    changed = np.empty(0, dtype=np.int64)
    if bad:
        return tbl, match, bad, False, changed, 0
    if same:
        changed = np.empty(n_changed, dtype=np.int64)
        k = 0
        for i in range(B):
            if new_len[i] != old_len[i]:
                changed[k] = i
                k += 1
    return tbl, match, bad, same, changed, added


@njit(cache=True, nogil=True)
def _cmp(tbl, npages, lens, a, b):
    """Sign of the sort key of row ``a`` against row ``b`` (:func:`sort_requests`' order, row
    index last)."""
    m = min(npages[a], npages[b])
    for c in range(m):
        x = tbl[a, c]
        y = tbl[b, c]
        if x != y:
            return -1 if x < y else 1
    if npages[a] != npages[b]:
        return -1 if npages[a] < npages[b] else 1
    if lens[a] != lens[b]:
        return -1 if lens[a] < lens[b] else 1
    if a != b:
        return -1 if a < b else 1
    return 0


@njit(cache=True, nogil=True)
def _lcp_pair(tbl, npages, lens, a, b, page_size):
    """Token LCP of rows ``a`` and ``b`` (:func:`pat_core.forest._adjacent_lcp`'s rule)."""
    m = min(npages[a], npages[b])
    k = 0
    while k < m and tbl[a, k] == tbl[b, k]:
        k += 1
    return min(k * page_size, lens[a], lens[b])


@njit(cache=True, nogil=True)
def _sort_rows(rows, tbl, npages, lens):
    """``rows`` sorted by :func:`_cmp` (bottom-up merge sort)."""
    n = rows.shape[0]
    a = rows.copy()
    b = np.empty(n, dtype=np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if _cmp(tbl, npages, lens, a[j], a[i]) < 0:
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < hi:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    return a


@njit(cache=True, nogil=True)
def _next_order(tbl, npages, lens, match, old_order, old_lcp, old_len, old_own, page_size):
    """Steps 2-4 of the module docstring.  ``old_own`` (bool ``[B_old]``): the old row's last
    token was its own (its node held only it).  Returns ``(order, lcp, kept)``: int32 ``[B]``
    each, as :func:`pat_core.forest.sort_requests` and ``_adjacent_lcp`` would give, and how
    many rows kept their place."""
    B = tbl.shape[0]
    Bo = old_order.shape[0]
    new_of = np.full(Bo, -1, dtype=np.int64)        # old row -> new row, for kept rows
    for i in range(B):
        j = match[i]
        if j >= 0:
            if lens[i] != old_len[j] and not old_own[j]:
                continue                            # grew from a shared last token: re-insert
            new_of[j] = i
    old_pos = np.full(B, -1, dtype=np.int64)        # new row -> its old sorted position
    kept = np.empty(B, dtype=np.int64)
    nk = 0
    for p in range(Bo):
        i = new_of[old_order[p]]
        if i >= 0:
            kept[nk] = i
            old_pos[i] = p
            nk += 1
    kept = kept[:nk]
    ins = np.empty(B - nk, dtype=np.int64)
    ni = 0
    for i in range(B):
        if old_pos[i] < 0:
            ins[ni] = i
            ni += 1
    ins = _sort_rows(ins, tbl, npages, lens)
    # place each inserted row by binary search among the kept ones (a linear merge would
    # compare every kept row, each over its shared prefix)
    order = np.empty(B, dtype=np.int64)
    a, k = 0, 0
    for b in range(ni):
        lo, hi = a, nk
        while lo < hi:
            mid = (lo + hi) // 2
            if _cmp(tbl, npages, lens, kept[mid], ins[b]) < 0:
                lo = mid + 1
            else:
                hi = mid
        while a < lo:
            order[k] = kept[a]
            a += 1
            k += 1
        order[k] = ins[b]
        k += 1
    while a < nk:
        order[k] = kept[a]
        a += 1
        k += 1
    lcp = np.zeros(B, dtype=np.int32)
    for p in range(B - 1):
        x = order[p]
        y = order[p + 1]
        px = old_pos[x]
        py = old_pos[y]
        if px >= 0 and py == px + 1:
            # adjacent before, both kept: a kept row that grew held its last token alone, so
            # the old LCP is below its old length, decided at a page both rows list
            lcp[p] = old_lcp[px]
        else:
            lcp[p] = _lcp_pair(tbl, npages, lens, x, y, page_size)
    return order.astype(np.int32), lcp, nk
