"""Long-KV split (PAT §6): cut CTAs whose KV range is much longer than the rest.

PAT's rule: any CTA whose KV length exceeds the batch's mean CTA KV length is cut into equal
parts no longer than the mean, so the last CTAs to finish are not orders of magnitude longer
than the others.  When the batch has too few CTAs to fill the GPU (one 100k-token request, a
handful of long requests), the mean is no help; like FlashInfer's split-KV we then also cap the
part length at the work per SM (``total tokens x kv heads / num_sms``), never below
``min_part`` tokens so parts stay long enough to hide their merge.

Parts are multiples of 16 tokens (the smallest KV tile) except the last one.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .packers import Packs


def split_threshold(kv_len: np.ndarray, num_kv_heads: int, num_sms: int,
                    min_part: int = 256) -> int:
    """Longest KV range a CTA may keep (tokens)."""
    if kv_len.size == 0:
        return 1
    mean = float(kv_len.mean())
    per_sm = float(kv_len.astype(np.int64).sum()) * num_kv_heads / max(num_sms, 1)
    cap = max(float(min_part), per_sm)
    return max(1, int(np.ceil(min(mean, cap))))


def split_long_kv(packs: Packs, threshold: int):
    """Split packs longer than ``threshold`` into equal parts.

    Returns ``(src, kv_start, kv_len)``: int32 ``[C]`` arrays, ``src`` being the pack each CTA
    came from (so requests are ``packs.reqs[packs.req_indptr[src]:...]``).  Parts of one pack
    are consecutive, in token order.
    """
    return _split(packs.kv_start, packs.kv_end, int(threshold))


@njit(cache=True)
def _split(kv_start, kv_end, threshold):
    K = kv_start.shape[0]
    parts = np.empty(K, dtype=np.int64)
    plen = np.empty(K, dtype=np.int64)
    total = 0
    for p in range(K):
        length = kv_end[p] - kv_start[p]
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
