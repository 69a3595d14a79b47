"""L2 reuse: which of a plan's bytes come from HBM and which hit in L2.

A KV page (one KV head's slice of it) read by several thread blocks is fetched from HBM by the
first of them; blocks that read it again while it is still in L2 are served by L2.

Blocks run side by side, and each reads its pages in order over its whole life, so the model
replays the reads *interleaved*: forward thread blocks enter in dispatch order (the forward
launches in launch order, each launch's work items in plan order, a CTA's KV heads adjacent)
while the GPU has room for them (each block takes ``1 / ctas_per_sm`` of an
SM, ``num_sms`` SMs in all), and every resident block reads its next page in turn.  A block
leaves after its last page and the next one enters.  For every (page, KV head) the model keeps
the *insertion clock* of its last read: the number of bytes that had entered L2 (HBM reads and
partial-result writes) before that read.  A read is an L2 hit when fewer than ``window`` bytes
have entered L2 since the page was last read; otherwise it is an HBM read, and its bytes enter
L2.  So a prefix read by ``k`` resident blocks at about the same time costs HBM once and L2
``k - 1`` times, however long it is; a page re-read after more than ``window`` bytes of other
traffic costs HBM again.  (Replaying whole blocks one after another instead would call a 2048-token
prefix of 32 KV heads, 32 MB, evicted before the next request reads it, while on the GPU 200-odd
blocks read it together.)

``window`` defaults to half of the GPU's L2 (:data:`L2_WINDOW_FRACTION`): the L2 of the A100,
H100 and H200 is split into two partitions and its replacement is not exact LRU, so a line does
not survive a full L2 worth of newer data.  It is an estimate, not a fitted constant (it sets
which bytes are hits, not how fast they move, and the fit would otherwise have to redo this pass
for every trial).

Other traffic: query rows, partial writes and output writes are charged to HBM.  The merge
kernel's partial reads hit L2 in the share of partial bytes written within the last ``window``
bytes before the forward kernels ended (all merge blocks get the same share).

The split is a function of the plan, its dispatch order, the blocks' occupancy and ``window``
only (no timing constants), so it is computed once per prepared workload.  Per block,
``hbm + l2`` equals the block's bytes in :mod:`sim.traffic`, so the totals still equal
``Plan.stats()["total_bytes"]``.  A block's hits come first in its reads (a shared prefix
precedes a request's own pages); :mod:`sim.timeline` streams them before the rest, except
those its KV pipeline has in flight with the misses that follow (:func:`sim.model.prepare`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from pat_core.gpus import get_gpu
from pat_core.plan import DTYPE_BYTES, dtype_name

L2_WINDOW_FRACTION = 0.5


def l2_window(gpu) -> float:
    """Reuse window in bytes of ``gpu``: ``l2_bytes * L2_WINDOW_FRACTION``."""
    return float(get_gpu(gpu).l2_bytes) * L2_WINDOW_FRACTION


@njit(cache=True)
def _kv_hits(blk_cta, blk_head, blk_other, blk_weight, capacity, kv_start, kv_len, page_indptr,
             pages, page_size, num_kv_heads, tok_bytes, num_pages, window):
    """Per forward block: KV bytes served by L2, and the insertion clock when the block ends.

    ``blk_other``: float64 [N] bytes a block adds to L2 besides its KV misses (query rows,
    partial writes), counted when it ends.  ``blk_weight``: float64 [N] share of the GPU's room
    a block takes while resident; blocks enter in order while the resident weights sum to at
    most ``capacity`` (one block always may).  Returns ``(l2 int64 [N], clock_after float64
    [N])``.
    """
    N = blk_cta.shape[0]
    last = np.full(num_pages * num_kv_heads, -1.0)
    seen = np.zeros(num_pages * num_kv_heads, dtype=np.bool_)
    l2 = np.zeros(N, dtype=np.int64)
    clock_after = np.zeros(N)
    clock = 0.0
    active = np.empty(N, dtype=np.int64)     # resident blocks, in the order they entered
    nxt_page = np.zeros(N, dtype=np.int64)
    nact = 0
    used = 0.0
    nxt = 0
    done = 0
    while done < N:
        while nxt < N and (nact == 0 or used + blk_weight[nxt] <= capacity * (1.0 + 1e-12)):
            active[nact] = nxt
            nxt_page[nxt] = page_indptr[blk_cta[nxt]]
            used += blk_weight[nxt]
            nact += 1
            nxt += 1
        # one round: every resident block reads its next page; finished blocks leave
        kept = 0
        for i in range(nact):
            b = active[i]
            c = blk_cta[b]
            j = nxt_page[b]
            if j < page_indptr[c + 1]:
                s = kv_start[c]
                e = s + kv_len[c]
                pos = s // page_size + (j - page_indptr[c])
                nbytes = (min(e, (pos + 1) * page_size) - max(s, pos * page_size)) * tok_bytes
                key = pages[j] * num_kv_heads + blk_head[b]
                if seen[key] and clock - last[key] < window:
                    l2[b] += nbytes
                else:
                    clock += nbytes
                seen[key] = True
                last[key] = clock
                nxt_page[b] = j + 1
            if nxt_page[b] >= page_indptr[c + 1]:
                clock += blk_other[b]
                clock_after[b] = clock
                used -= blk_weight[b]
                done += 1
            else:
                active[kept] = b
                kept += 1
        nact = kept
        if nact == 0:
            used = 0.0                          # no drift from the float sums
    return l2, clock_after


def l2_split(plan, blk_cta, blk_head, fwd_other, merge_read, window: float,
             blk_weight=None, capacity: float = 1.0):
    """L2-hit bytes of every thread block of ``plan`` in dispatch order.

    Parameters
    ----------
    plan : :class:`pat_core.Plan`.
    blk_cta, blk_head : int [F] forward blocks in dispatch order: Plan CTA and KV head.
    fwd_other : float64 [F] non-KV bytes of each forward block (query rows + partial writes).
    merge_read : float64 [M] partial-read bytes of each merge block.
    window : reuse window in bytes (see module docstring); ``0`` makes every byte an HBM byte.
    blk_weight : float64 [F] room each forward block takes while resident, in SMs
        (``1 / ctas_per_sm`` of its config); default 1 each.
    capacity : room of the GPU in the same unit (``num_sms``).  With the defaults one block is
        resident at a time: whole blocks replayed one after another.

    Returns ``float64 [F + M]``: L2 bytes per block (forward blocks first, then merge blocks).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    blk_cta = np.ascontiguousarray(blk_cta, dtype=np.int64)
    blk_head = np.ascontiguousarray(blk_head, dtype=np.int64)
    fwd_other = np.ascontiguousarray(fwd_other, dtype=np.float64)
    merge_read = np.asarray(merge_read, dtype=np.float64)
    blk_weight = (np.ones(blk_cta.shape[0]) if blk_weight is None
                  else np.ascontiguousarray(blk_weight, dtype=np.float64))
    if blk_cta.shape != blk_head.shape or blk_cta.shape != fwd_other.shape \
            or blk_cta.shape != blk_weight.shape:
        raise ValueError("blk_cta, blk_head, fwd_other and blk_weight must have the same length")
    if not capacity > 0 or np.any(blk_weight < 0):
        raise ValueError(f"capacity must be positive and blk_weight >= 0, got capacity "
                         f"{capacity}")
    b = DTYPE_BYTES[dtype_name(plan.kv_dtype)]
    tok_bytes = 2 * plan.head_dim * b
    num_pages = int(plan.cta_pages.max()) + 1 if plan.cta_pages.size else 1
    if blk_cta.size:
        l2_fwd, clock_after = _kv_hits(
            blk_cta, blk_head, fwd_other, blk_weight, float(capacity),
            plan.cta_kv_start.astype(np.int64),
            plan.cta_kv_len.astype(np.int64), plan.cta_page_indptr.astype(np.int64),
            plan.cta_pages.astype(np.int64), int(plan.page_size), int(plan.num_kv_heads),
            int(tok_bytes), num_pages, float(window))
    else:
        l2_fwd, clock_after = np.zeros(0, np.int64), np.zeros(0)
    # merge: share of partial bytes written within the last `window` bytes of insertions before
    # the forward blocks ended (the last to end need not be the last dispatched)
    pw = _partial_write_bytes(plan, blk_cta)
    share = 0.0
    if pw.sum() > 0 and clock_after.size:
        resident = (clock_after.max() - clock_after) < window
        share = float(pw[resident].sum() / pw.sum()) if window > 0 else 0.0
    return np.concatenate([l2_fwd.astype(np.float64), np.floor(merge_read * share)])


def _partial_write_bytes(plan, blk_cta) -> np.ndarray:
    from pat_core.plan import PARTIAL_BYTES
    rows = plan.cta_rows().astype(np.int64)
    return (rows[np.asarray(blk_cta, dtype=np.int64)] * (plan.head_dim + 1)
            * PARTIAL_BYTES).astype(np.float64)
