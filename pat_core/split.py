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
    length = (packs.kv_end - packs.kv_start).astype(np.int64)
    parts = np.maximum(1, -(-length // threshold))
    part_len = -(-length // parts)
    part_len = np.where(parts > 1, -(-part_len // 16) * 16, part_len)
    parts = -(-length // part_len)
    src = np.repeat(np.arange(packs.num_packs, dtype=np.int32), parts)
    first = np.zeros(packs.num_packs + 1, dtype=np.int64)
    np.cumsum(parts, out=first[1:])
    k = np.arange(src.shape[0], dtype=np.int64) - first[src]
    start = packs.kv_start[src].astype(np.int64) + k * part_len[src]
    end = np.minimum(start + part_len[src], packs.kv_end[src])
    return src, start.astype(np.int32), (end - start).astype(np.int32)
