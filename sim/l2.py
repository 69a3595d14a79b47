"""L2 reuse: which of a plan's bytes come from HBM and which hit in L2.

A KV page (one KV head's slice of it) read by several thread blocks is fetched from HBM by the
first of them; blocks that read it again while it is still in L2 are served by L2.  The model
walks the forward thread blocks in dispatch order (launch groups in plan order, then
``blockIdx.x``, whose KV heads are adjacent: the kernels' default ``head_minor`` grid) and keeps,
for every (page, KV head), the *insertion clock* of its last read: the number of bytes that had
entered L2 (HBM reads and partial-result writes) before that read.  A read is an L2 hit when
fewer than ``window`` bytes have entered L2 since the page was last read; otherwise it is an HBM
read, and its bytes enter L2.  So a page read by ``k`` blocks running at about the same time
costs HBM once and L2 ``k - 1`` times, and a page re-read after more than ``window`` bytes of
other traffic costs HBM again.

``window`` defaults to half of the GPU's L2 (:data:`L2_WINDOW_FRACTION`): the L2 of the A100,
H100 and H200 is split into two partitions and its replacement is not exact LRU, so a line does
not survive a full L2 worth of newer data.  It is an estimate, not a fitted constant (it sets
which bytes are hits, not how fast they move, and the fit would otherwise have to redo this pass
for every trial).

Other traffic: query rows, partial writes and output writes are charged to HBM.  The merge
kernel's partial reads hit L2 in the share of partial bytes written within the last ``window``
bytes before the forward kernels ended (all merge blocks get the same share).

The split is a function of the plan, its dispatch order and ``window`` only (no timing
constants), so it is computed once per prepared workload.  Per block, ``hbm + l2`` equals the
block's bytes in :mod:`sim.traffic`, so the totals still equal ``Plan.stats()["total_bytes"]``.
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
def _kv_hits(blk_cta, blk_head, blk_other, kv_start, kv_len, page_indptr, pages, page_size,
             num_kv_heads, tok_bytes, num_pages, window):
    """Per forward block: KV bytes served by L2, and the insertion clock after the block.

    ``blk_other``: float64 [N] bytes a block adds to L2 besides its KV misses (query rows,
    partial writes).  Returns ``(l2 int64 [N], clock_after float64 [N])``.
    """
    N = blk_cta.shape[0]
    last = np.full(num_pages * num_kv_heads, -1.0)
    seen = np.zeros(num_pages * num_kv_heads, dtype=np.bool_)
    l2 = np.zeros(N, dtype=np.int64)
    clock_after = np.zeros(N)
    clock = 0.0
    for b in range(N):
        c = blk_cta[b]
        h = blk_head[b]
        s = kv_start[c]
        e = s + kv_len[c]
        first = s // page_size
        miss = 0
        hit = 0
        for j in range(page_indptr[c], page_indptr[c + 1]):
            pos = first + (j - page_indptr[c])
            lo = max(s, pos * page_size)
            hi = min(e, (pos + 1) * page_size)
            nbytes = (hi - lo) * tok_bytes
            key = pages[j] * num_kv_heads + h
            if seen[key] and clock - last[key] <= window:
                hit += nbytes
            else:
                miss += nbytes
            seen[key] = True
            last[key] = clock
        l2[b] = hit
        clock += miss + blk_other[b]
        clock_after[b] = clock
    return l2, clock_after


def l2_split(plan, blk_cta, blk_head, fwd_other, merge_read, window: float):
    """L2-hit bytes of every thread block of ``plan`` in dispatch order.

    Parameters
    ----------
    plan : :class:`pat_core.Plan`.
    blk_cta, blk_head : int [F] forward blocks in dispatch order: Plan CTA and KV head.
    fwd_other : float64 [F] non-KV bytes of each forward block (query rows + partial writes).
    merge_read : float64 [M] partial-read bytes of each merge block.
    window : reuse window in bytes (see module docstring); ``0`` makes every byte an HBM byte.

    Returns ``float64 [F + M]``: L2 bytes per block (forward blocks first, then merge blocks).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    blk_cta = np.ascontiguousarray(blk_cta, dtype=np.int64)
    blk_head = np.ascontiguousarray(blk_head, dtype=np.int64)
    fwd_other = np.ascontiguousarray(fwd_other, dtype=np.float64)
    merge_read = np.asarray(merge_read, dtype=np.float64)
    if blk_cta.shape != blk_head.shape or blk_cta.shape != fwd_other.shape:
        raise ValueError("blk_cta, blk_head and fwd_other must have the same length")
    b = DTYPE_BYTES[dtype_name(plan.kv_dtype)]
    tok_bytes = 2 * plan.head_dim * b
    num_pages = int(plan.cta_pages.max()) + 1 if plan.cta_pages.size else 1
    if blk_cta.size:
        l2_fwd, clock_after = _kv_hits(
            blk_cta, blk_head, fwd_other, plan.cta_kv_start.astype(np.int64),
            plan.cta_kv_len.astype(np.int64), plan.cta_page_indptr.astype(np.int64),
            plan.cta_pages.astype(np.int64), int(plan.page_size), int(plan.num_kv_heads),
            int(tok_bytes), num_pages, float(window))
    else:
        l2_fwd, clock_after = np.zeros(0, np.int64), np.zeros(0)
    # merge: share of partial bytes written within the last `window` bytes of insertions
    pw = _partial_write_bytes(plan, blk_cta)
    share = 0.0
    if pw.sum() > 0 and clock_after.size:
        resident = (clock_after[-1] - clock_after) < window
        share = float(pw[resident].sum() / pw.sum()) if window > 0 else 0.0
    return np.concatenate([l2_fwd.astype(np.float64), np.floor(merge_read * share)])


def _partial_write_bytes(plan, blk_cta) -> np.ndarray:
    from pat_core.plan import PARTIAL_BYTES
    rows = plan.cta_rows().astype(np.int64)
    return (rows[np.asarray(blk_cta, dtype=np.int64)] * (plan.head_dim + 1)
            * PARTIAL_BYTES).astype(np.float64)
