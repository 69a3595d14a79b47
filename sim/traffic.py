"""Memory traffic and padding waste of a Plan, per thread block and by kind.

One Plan CTA runs as ``num_kv_heads`` thread blocks (adjacent in a 1-D grid).  The thread
block of CTA ``c`` for one KV head moves:

* KV: ``kv_len[c]`` tokens of K and V, ``2 * head_dim * b`` bytes each;
* Q: its ``rows = requests x group`` query rows, ``head_dim * b`` bytes each;
* partial writes: per row an fp32 output and an fp32 LSE, ``4 * (head_dim + 1)`` bytes; or, for
  the rows of a request of one partial slot (the CTA holds all of its KV), the output itself,
  ``head_dim * b`` bytes.

The merge kernel then reads the partial slots of every request of more than one slot back (one
warp per (request, query head)) and writes its output (``head_dim * b`` per pair).  The totals
equal :meth:`pat_core.Plan.stats`.

Padding waste is the share of tile area (query rows x KV columns the tensor cores process) that
carries no data: rows ``rows < m`` of a tile, and the empty columns of a CTA's last KV tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pat_core.plan import DTYPE_BYTES, PARTIAL_BYTES, dtype_name

from .occupancy import MERGE_WARPS


@dataclass
class BlockWork:
    """Work of every forward CTA (per KV head; float64 / int64 arrays of length ``C``)."""

    head_dim: int
    rows: np.ndarray          # query rows
    m: np.ndarray
    n: np.ndarray
    kv_len: np.ndarray
    tiles: np.ndarray         # KV tiles: ceil(kv_len / n)
    kv_bytes: np.ndarray
    q_bytes: np.ndarray
    partial_write_bytes: np.ndarray
    out_bytes: np.ndarray     # output rows of the requests of one slot (0 for the others)

    @property
    def bytes(self) -> np.ndarray:
        return self.kv_bytes + self.q_bytes + self.partial_write_bytes + self.out_bytes

    @property
    def flops(self) -> np.ndarray:
        """Tensor-core flops of the padded tiles: ``Q K^T`` and ``P V``, 2 flop per multiply-add."""
        return 4.0 * self.m * self.n * self.tiles * self.head_dim


def forward_work(plan) -> BlockWork:
    """Per-CTA work of one thread block (one KV head) of ``plan``."""
    b = DTYPE_BYTES[dtype_name(plan.kv_dtype)]
    qb = DTYPE_BYTES[dtype_name(plan.io_dtype)]     # q and output (2 bytes for an fp8 cache)
    d = plan.head_dim
    mn = plan.cta_mn().astype(np.int64)
    rows = plan.cta_rows().astype(np.int64)
    kv_len = plan.cta_kv_len.astype(np.int64)
    tiles = -(-kv_len // mn[:, 1])
    w = BlockWork(head_dim=d, rows=rows, m=mn[:, 0], n=mn[:, 1], kv_len=kv_len, tiles=tiles,
                  kv_bytes=(kv_len * 2 * d * b).astype(np.float64),
                  q_bytes=(rows * d * qb).astype(np.float64),
                  partial_write_bytes=(rows * (d + 1) * PARTIAL_BYTES).astype(np.float64),
                  out_bytes=np.zeros(kv_len.shape[0]))
    if plan.num_ctas:
        # a request of one partial slot gets its output from its CTA (no partial written)
        # (each of its query tokens' rows: the request's q_len x the GQA group)
        single = np.diff(plan.req_slot_indptr)[plan.cta_req] == 1
        tokens = single * plan.q_lens()[plan.cta_req]
        cta_of = np.repeat(np.arange(plan.num_ctas), np.diff(plan.cta_req_indptr))
        direct = np.bincount(cta_of, weights=tokens, minlength=plan.num_ctas) * plan.group_size
        w.out_bytes = direct * d * qb
        w.partial_write_bytes = ((rows - direct) * (d + 1) * PARTIAL_BYTES).astype(np.float64)
    return w


@dataclass
class MergeWork:
    """Work of every merge-kernel thread block (``MERGE_WARPS`` (request, head) pairs each)."""

    bytes: np.ndarray         # partial reads + output writes
    read_bytes_per_block: np.ndarray   # partial reads alone
    max_slots: np.ndarray     # slots of the block's longest pair (its warps run side by side)
    read_bytes: float
    out_bytes: float


def merge_work(plan) -> MergeWork:
    """Blocks of the merge kernel over the requests of more than one slot (a request of one
    slot got its output from its CTA): their pairs ``(query token, h)`` in order (one token
    per request unless the plan has ``qo_indptr``), ``MERGE_WARPS`` to a block.  No blocks
    when every request has one slot."""
    b = DTYPE_BYTES[dtype_name(plan.io_dtype)]      # the output's element size
    d, hq = plan.head_dim, plan.num_qo_heads
    slots = np.diff(plan.token_slot_indptr).astype(np.int64)     # per query token
    slots = slots[slots > 1]                     # one slot: its CTA wrote the output
    pair_slots = np.repeat(slots, hq)
    pair_bytes = pair_slots * (d + 1) * PARTIAL_BYTES + d * b
    nblk = -(-pair_slots.shape[0] // MERGE_WARPS)
    pad = nblk * MERGE_WARPS - pair_slots.shape[0]
    ps = np.concatenate([pair_slots, np.zeros(pad, np.int64)]).reshape(nblk, MERGE_WARPS)
    pb = np.concatenate([pair_bytes, np.zeros(pad, np.int64)]).reshape(nblk, MERGE_WARPS)
    pr = np.concatenate([pair_slots * (d + 1) * PARTIAL_BYTES,
                         np.zeros(pad, np.int64)]).reshape(nblk, MERGE_WARPS)
    read = float((pair_slots * (d + 1) * PARTIAL_BYTES).sum())
    out = float(slots.shape[0] * hq * d * b)
    return MergeWork(bytes=pb.sum(axis=1).astype(np.float64),
                     read_bytes_per_block=pr.sum(axis=1).astype(np.float64),
                     max_slots=ps.max(axis=1),
                     read_bytes=read, out_bytes=out)


def bytes_by_kind(plan) -> dict:
    """Bytes of the whole decode step by kind (HBM and L2 together; :func:`sim.model.
    bytes_by_level` splits them); ``total`` equals ``Plan.stats()["total_bytes"]``."""
    w = forward_work(plan)
    mw = merge_work(plan)
    hk = plan.num_kv_heads
    out = {
        "kv": int(round(w.kv_bytes.sum() * hk)),
        "q": int(round(w.q_bytes.sum() * hk)),
        "partial_write": int(round(w.partial_write_bytes.sum() * hk)),
        "partial_read": int(round(mw.read_bytes)),
        "out": int(round(mw.out_bytes + w.out_bytes.sum() * hk)),
    }
    out["total"] = sum(out.values())
    return out


def padding_waste(plan) -> dict:
    """Share of processed tile area that carries no data.

    ``rows``: area of unused query rows (``m - rows``); ``columns``: area of the empty tail of each
    CTA's last KV tile; ``total``: both (``1 - data / tile area``).  Fractions in ``[0, 1)``.
    """
    w = forward_work(plan)
    area = (w.m * w.n * w.tiles).astype(np.float64)
    total_area = float(area.sum())
    if total_area == 0:
        return {"rows": 0.0, "columns": 0.0, "total": 0.0}
    data = float((w.rows * w.kv_len).sum())
    row_waste = float(((w.m - w.rows) * w.n * w.tiles).sum())
    col_waste = float((w.rows * (w.n * w.tiles - w.kv_len)).sum())
    return {"rows": row_waste / total_area, "columns": col_waste / total_area,
            "total": 1.0 - data / total_area}
