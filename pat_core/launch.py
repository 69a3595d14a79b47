"""How the CUDA backend launches a plan, and the merge kernel's layout rules.

One launch path serves every plan (:mod:`pat_core.cuda_backend`; the simulator,
:func:`sim.model.prepare`, lays out the same launches from the functions here)::

    caller stream ── forward (tallest tile) ─▶ forward (next tile) ─▶ ... ─▶ merge ── out [, lse]

* **Forward**: one pull-mode launch per tile config the plan uses (:func:`forward_launches`), in
  launch-set order, tallest tiles first (:func:`pat_core.static_plan.order_tiles`: ``m``
  descending, then ``n`` descending).  A launch's grid is the blocks its kernel keeps resident
  (SMs x blocks per SM) capped at its work items (CTA x KV head; :func:`launch_grid`); block
  ``b`` takes item ``b`` first and draws further items from the launch's work counter, a tile's
  CTAs in plan order.
* **Chain**: on sm_90 and later (:func:`dependent_launch_ok`) each launch after the first is a
  programmatic dependent of the one before it: its blocks are placed as soon as every block of
  the one before has been, and its last block waits for the launch before it, so the merge, a
  dependent of the last launch, finds every forward launch finished.  On older GPUs the
  launches run one after another in stream order.
* **Direct output**: a request of exactly one partial slot gets its output from the forward
  item that holds all of its KV (no partial written).  The merge combines the other requests'
  partial slots (one warp per (request, query head) pair, or a block per pair:
  :func:`merge_block_per_pair`, :func:`merge_heads_per_warp`) and resets the work counters.
  It is skipped when every request has one slot and no block drew a second item
  (:func:`merge_needed`).
"""
from __future__ import annotations

import numpy as np

# The merge runs one block per (request, query head) pair, its warps splitting the pair's
# partial slots, when there are at most this many pairs per SM and requests average at least
# MERGE_BLOCK_MIN_SLOTS slots; otherwise one warp per pair.
MERGE_BLOCK_MAX_PAIRS_PER_SM = 8
MERGE_BLOCK_MIN_SLOTS = 4
# Warps per SM the merge kernel keeps resident (its launch bounds: 50% occupancy).
MERGE_WARPS_PER_SM = 32


def dependent_launch_ok(gpu) -> bool:
    """Whether ``gpu`` (a GPU spec or name) runs programmatic dependent launches (sm_90 and
    later; before that the CUDA backend's ``griddepcontrol`` instructions are no-ops and a
    dependent launch is an ordinary stream-ordered one)."""
    from .gpus import get_gpu
    from .tiles import _arch_of
    return int(_arch_of(get_gpu(gpu))[3:]) >= 90


def forward_launches(plan) -> list:
    """``[(k, (m, n), ctas), ...]``: the forward launches of ``plan``, in launch order.

    One per tile config ``k`` (an index into ``plan.tile_configs``) that has CTAs, tallest
    tiles first (:func:`pat_core.static_plan.order_tiles`); ``ctas`` (int64) are the plan's
    CTAs of that tile in plan order, the order the launch's blocks draw them as work items
    (each ``num_kv_heads`` items, a CTA's KV heads adjacent)."""
    from .static_plan import order_tiles
    tile = plan.cta_tile.astype(np.int64)
    index = {(int(m), int(n)): k for k, (m, n) in enumerate(plan.tile_configs.tolist())}
    used = {tuple(plan.tile_configs[k]) for k in np.unique(tile).tolist()}
    out = []
    for m, n in order_tiles(used):
        k = index[(m, n)]
        out.append((k, (m, n), np.flatnonzero(tile == k)))
    return out


def launch_grid(items: int, blocks_per_sm: int, num_sms: int) -> int:
    """Blocks of one forward launch of ``items`` work items: the blocks the kernel keeps
    resident (``blocks_per_sm`` on each of ``num_sms`` SMs, at least one), at most one per
    item."""
    return max(1, min(int(items), max(1, int(blocks_per_sm)) * int(num_sms)))


def merge_needed(plan, blocks_per_sm, num_sms: int) -> bool:
    """Whether the backend launches the merge after ``plan``'s forward launches: some request
    has more than one partial slot, or some forward launch has more items than blocks (a block
    drew a second item, and the merge resets the work counters).  ``blocks_per_sm``: resident
    blocks per SM of each tile config's kernel (indexable by the tile index ``k``)."""
    if plan.num_slots > plan.batch_size:
        return True
    hk = plan.num_kv_heads
    items = [(len(ctas) * hk, blocks_per_sm[k]) for k, _, ctas in forward_launches(plan)]
    return merge_needed_for(plan, [n for n, _ in items],
                            [launch_grid(n, b, num_sms) for n, b in items])


def merge_needed_for(plan, items, grids) -> bool:
    """:func:`merge_needed` from the forward launches' work items and grids (int sequences of
    equal length), for a caller that has counted them (the CUDA backend, from its pack)."""
    if plan.num_slots > plan.batch_size:        # (per token row alike: same requests)
        return True
    return any(n > g for n, g in zip(items, grids))


def merge_block_per_pair(plan, num_sms: int) -> bool:
    """Whether the merge kernel gives each (request, query head) pair a whole block.

    One warp per pair leaves the GPU nearly idle when pairs are few and each has many slots:
    on ``1,16_16384,16`` (heads 32:8, 512 pairs of 33 slots) that merge took 18 us on an H100
    (ncu; 4 warps per SM, each walking 33 slots).  A block per pair puts four warps on the same
    pair's slots.  With many pairs (or few slots each) a warp per pair already fills the SMs and
    the block's barrier and idle warps would only cost.

    A batch-invariant plan (``plan.batch_invariant``) always takes a warp per pair: the block
    splits a pair's slots over its warps and adds their sums in another order, and which
    layout runs must not depend on the rest of the batch."""
    if plan.batch_invariant:
        return False
    pairs = plan.num_qo_tokens * plan.num_qo_heads       # (query token, head): batch x heads
    if pairs == 0:                                       # with one token per request
        return False
    mean_slots = plan.num_partial_rows / max(plan.num_qo_tokens, 1)
    return pairs <= MERGE_BLOCK_MAX_PAIRS_PER_SM * num_sms and mean_slots >= MERGE_BLOCK_MIN_SLOTS


def merge_heads_per_warp(plan, num_sms: int) -> int:
    """Query heads of one request a merge warp takes together in warp mode: 1, 2 or 4.

    A warp per (request, head) pair keeps one pair's few KB in flight, and the merge of a
    large batch is bound by that: on ``1,1024_1024,16`` (heads 32:8, 32768 pairs of 2 slots)
    the merge moved 42 MB in 24.5 us on an H100 (ncu: 45% of DRAM bandwidth, 50% occupancy, about
    8 waves of warps).  A warp taking NH heads at once has NH times the loads in flight (its
    rounds hold 8 / NH slots per head).  Worth it only when the pairs are more than the resident
    warps (else the warps already run in one wave, and fewer slots per round means more
    rounds): NH = the largest of 4, 2 that divides num_qo_heads and is at most pairs / resident
    warps."""
    pairs = plan.num_qo_tokens * plan.num_qo_heads       # (query token, head) pairs
    waves = pairs / max(MERGE_WARPS_PER_SM * num_sms, 1)
    for nh in (4, 2):
        if plan.num_qo_heads % nh == 0 and waves >= nh:
            return nh
    return 1
