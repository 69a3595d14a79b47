"""Launch policy: whether a plan's forward CTAs go out in one fused launch.

One rule, read by the CUDA backend (:class:`pat_core.cuda_backend.CudaBackend`) and by the
simulator (:func:`sim.model.prepare`), so that the simulator prices the launch the GPU runs.

``"streams"``: one launch per tile group, groups on pooled streams.  ``"fused"``: every forward
CTA in one launch, each block running its CTA's variant with the largest variant's threads,
registers and shared memory.  ``"auto"`` (the default): fused when the plan is not serial and has two
or more tile variants, no CTA longer than ``max_kv_len`` tokens, and at most ``max_blocks_per_sm``
thread blocks (CTAs x KV heads) per SM, and no more blocks than the fused kernel holds resident
at once (:func:`fused_ctas_per_sm`): such a step is bound by launch latency and the tail of the
slowest group, not by occupancy, which the fused block costs the small tiles.  The residency
bound matters when the fused block is large: on ``1,16_16384,16`` (heads 32:8) 256 blocks of
64x64 and 128 of 16x16 fused into 384 blocks of the 64x64 block's size, two resident per SM, so
the step ran in two waves (ncu, H100: 56 us for the fused forward launch).  With long CTAs the step
lasts hundreds of microseconds and the launches do not matter: on decode steps of a real chat
trace (12k-token prompts, 10-45 requests) the fused launch measured 5-14% slower than the
streams (``bench/results/trace_replay_h100/``).

A plan with a finisher phase (``plan.finish_from >= 0``, :mod:`pat_core.fold`) is never fused:
its finishers fold only after every other CTA has finished, so its two phases are two rounds of
launches, the second dependent on the first where :func:`finisher_launch_dependent` says so
(with several launches, a chain: :func:`finisher_chain`).

One-tile CTAs (:func:`one_tile_split`, ablations, off by default): the one-tile tail of a 16-row
launch group (tree leaves of a page or two) can run in a launch of its own, with a layout made
for it or in the piped kernel.
"""
from __future__ import annotations

import os

LAUNCH_MODES = ("auto", "fused", "streams")
# The merge runs one block per (request, query head) pair, its warps splitting the pair's
# partial slots, when there are at most this many pairs per SM and requests average at least
# MERGE_BLOCK_MIN_SLOTS slots; otherwise one warp per pair.
MERGE_BLOCK_MAX_PAIRS_PER_SM = 8
MERGE_BLOCK_MIN_SLOTS = 4
# Warps per SM the merge kernel keeps resident (its launch bounds: 50% occupancy).
MERGE_WARPS_PER_SM = 32
FUSED_MAX_BLOCKS_PER_SM = 4
FUSED_MAX_KV_LEN = 2048


def fused_ctas_per_sm(plan) -> int:
    """Resident blocks per SM of the fused kernel for ``plan``: each block takes the largest
    threads, registers and shared memory of the plan's tile variants
    (:func:`pat_core.tiles.kernel_resources`, on the GPU the plan was made for)."""
    from .gpus import get_gpu
    from .tiles import TileResources, kernel_resources
    gpu = get_gpu(plan.gpu)
    rs = [kernel_resources(int(m), int(n), plan.head_dim, plan.kv_dtype, gpu)
          for m, n in {tuple(plan.tile_configs[int(k)]) for k in plan.group_tile}]
    rs = [r for r in rs if r is not None]
    if not rs:
        return 0
    big = TileResources(m=0, n=0, threads=max(r.threads for r in rs),
                        registers=max(r.registers for r in rs), smem=max(r.smem for r in rs),
                        source="fused")
    return big.ctas_per_sm(gpu)


def dependent_launch_ok(gpu) -> bool:
    """Whether ``gpu`` (a GPU spec or name) runs programmatic dependent launches (sm_90 and
    later; before that the CUDA backend's ``griddepcontrol`` instructions are no-ops and a
    dependent launch is an ordinary stream-ordered one)."""
    from .gpus import get_gpu
    from .tiles import _arch_of
    return int(_arch_of(get_gpu(gpu))[3:]) >= 90


def finisher_launch_dependent(plan, gpu, fwd_chain: str = "pdl") -> bool:
    """Whether ``plan``'s finisher phase runs on ``gpu`` (a GPU spec or name) behind its first
    phase as programmatic dependent launches (the finishers may start while the first phase runs
    and wait for it only before they fold), as the CUDA backend launches it by default
    (``CudaBackend.finish_launch`` "pdl"), on an sm_90 or later GPU: either both phases are one
    tile group each (the finishers' one launch depends on the first phase's one launch), or,
    with ``fwd_chain`` not ``"fork"``, the first phase's launches are a chain
    (:func:`finisher_chain`) and the finisher launches follow it, each a dependent of the launch
    before it.  Otherwise a plan with a first phase starts its finishers after that phase."""
    if fwd_chain not in FWD_CHAIN_MODES:
        raise ValueError(f"fwd_chain must be one of {FWD_CHAIN_MODES}, got {fwd_chain!r}")
    if plan.finish_from < 1 or not dependent_launch_ok(gpu):
        return False
    return (plan.finish_from == 1 and plan.num_groups == 2) or finisher_chain(plan, gpu,
                                                                              fwd_chain)


def finisher_chain(plan, gpu, fwd_chain: str = "pdl") -> bool:
    """Whether ``plan``'s finisher phase goes behind a chain (``fwd_chain`` "pdl" or "pdl-plan"
    on an sm_90 or later GPU): a first phase and more than two live tile groups in all.  The
    first phase's launches are chained as :func:`forward_chained` chains a plan's forward
    launches (longest first under "pdl"), then the finisher groups' launches in plan order, each
    a programmatic dependent of the launch before it: a finisher folds only after its ``pdl_wait``
    (the launch before it has finished, and with it every earlier one), so the whole chain has
    ended before any fold.  Measured against forking the first phase and starting the finishers
    after it: bench/NOTES.md, round 23."""
    if fwd_chain not in FWD_CHAIN_MODES:
        raise ValueError(f"fwd_chain must be one of {FWD_CHAIN_MODES}, got {fwd_chain!r}")
    if fwd_chain == "fork" or plan.finish_from < 1 or plan.serial:
        return False
    live = sum(1 for _, _, b, e in plan.groups() if e > b)
    return live > 2 and dependent_launch_ok(gpu)


# How a plan's forward launches (two or more tile groups, no finisher phase) are enqueued.
# "pdl" (the default): on the caller's stream, longest first (chain_order), each a programmatic
# dependent of the one before it, so its blocks are placed as soon as every block of the one
# before it is; the last block of each waits for the launch before it (cuda_src/pat_common.cuh
# chain_exit), so the merge, a dependent of the last, waits for them all.  "pdl-plan": the same
# in the plan's group order.  "fork" (an ablation): concurrently on pool streams forked from the
# caller's stream and joined before the merge.  On an H100 the chain was 0-15% faster on every
# multi-launch sharing batch of the development set (bench/NOTES.md, round 21): the fork and
# join cost up to 6 us of a CUDA graph's replay, and the replay started the forked launches in
# either order.
FWD_CHAIN_MODES = ("pdl", "pdl-plan", "fork")
# Files measured before the chain existed (no "fwd_chain" field) ran the forked launches.
FWD_CHAIN_BEFORE = "fork"


def default_fwd_chain() -> str:
    """The CUDA backend's ``fwd_chain`` unless set otherwise: env ``PAT_FWD_CHAIN``, else
    ``"pdl"``.  The benchmarks record it next to their timings."""
    return os.environ.get("PAT_FWD_CHAIN", "pdl")


def chain_order(spans) -> list:
    """Order of chained launches: ``spans[i] = (longest CTA's KV tokens, tile rows)`` of launch
    ``i``; longest first, then more rows, then the given order.  A long CTA placed first cannot
    become the step's tail behind a launch of short ones: the later launches' blocks fill the
    SMs around it."""
    return sorted(range(len(spans)), key=lambda i: (-int(spans[i][0]), -int(spans[i][1]), i))


def forward_chained(plan, gpu, mode: str = "pdl", fused: bool = False,
                    serial: bool | None = None) -> bool:
    """Whether ``plan``'s forward launches run as a chain on ``gpu`` under ``mode`` (see
    FWD_CHAIN_MODES): two or more tile groups with CTAs, not serial (``serial``: default
    ``plan.serial``), not fused, no finisher phase, an sm_90 or later GPU."""
    if mode not in FWD_CHAIN_MODES:
        raise ValueError(f"fwd_chain must be one of {FWD_CHAIN_MODES}, got {mode!r}")
    serial = plan.serial if serial is None else serial
    if mode == "fork" or serial or fused or plan.finish_from >= 0:
        return False
    live = sum(1 for _, _, b, e in plan.groups() if e > b)
    return live >= 2 and dependent_launch_ok(gpu)


def group_spans(plan) -> list:
    """``[(longest CTA's KV tokens, tile rows), ...]`` per tile group of ``plan`` (0 tokens for
    an empty group): what :func:`chain_order` sorts."""
    return [(int(plan.cta_kv_len[b:e].max()) if e > b else 0, m)
            for _, (m, _n), b, e in plan.groups()]


def use_fused_launch(plan, num_sms: int, mode: str = "auto",
                     max_blocks_per_sm: int = FUSED_MAX_BLOCKS_PER_SM,
                     max_kv_len: int = FUSED_MAX_KV_LEN) -> bool:
    """Whether ``plan``'s forward CTAs run in one launch under ``mode`` on ``num_sms`` SMs."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch_mode must be one of {LAUNCH_MODES}, got {mode!r}")
    if plan.num_ctas == 0 or plan.finish_from >= 0:
        return False
    if mode == "fused":
        return True
    if mode == "streams" or plan.serial or len(set(plan.group_tile.tolist())) < 2:
        return False                # serial plans keep their order; one variant, one launch
    if int(plan.cta_kv_len.max()) > max_kv_len:
        return False
    per_sm = min(max_blocks_per_sm, fused_ctas_per_sm(plan))
    return plan.num_ctas * plan.num_kv_heads <= per_sm * num_sms


def merge_block_per_pair(plan, num_sms: int) -> bool:
    """Whether the merge kernel gives each (request, query head) pair a whole block.

    One warp per pair leaves the GPU nearly idle when pairs are few and each has many slots:
    on ``1,16_16384,16`` (heads 32:8, 512 pairs of 33 slots) that merge took 18 us on an H100
    (ncu; 4 warps per SM, each walking 33 slots).  A block per pair puts four warps on the same
    pair's slots.  With many pairs (or few slots each) a warp per pair already fills the SMs and
    the block's barrier and idle warps would only cost."""
    pairs = plan.batch_size * plan.num_qo_heads
    if pairs == 0:
        return False
    mean_slots = plan.num_slots / max(plan.batch_size, 1)
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
    pairs = plan.batch_size * plan.num_qo_heads
    waves = pairs / max(MERGE_WARPS_PER_SM * num_sms, 1)
    for nh in (4, 2):
        if plan.num_qo_heads % nh == 0 and waves >= nh:
            return nh
    return 1


# One-tile CTAs (KV length <= n) of a 16-row launch group.  "off" (the backend's default): they
# stay in their group's launch.  Two ablations, both measured slower on an H100 (bench/NOTES.md,
# round 7): "split" gives the group's one-tile tail a launch of its own in the one-tile layout
# (pat_core.cuda_compile.ONE_TILE_LAYOUTS); "piped" sends it to the piped kernel (resident
# blocks, a producer warp gathering items for consumer warps).  "piped-all" sends whole eligible
# groups there (a test mode: the kernel's multi-tile fallback runs).
ONE_TILE_MODES = ("off", "split", "piped", "piped-all")


def piped_blocks_per_sm(plan, n: int) -> int:
    """Resident blocks per SM of the piped variant of 16 x ``n`` tiles for ``plan``'s GPU."""
    from .gpus import get_gpu
    from .tiles import piped_resources
    gpu = get_gpu(plan.gpu)
    return max(1, piped_resources(n, plan.head_dim, plan.kv_dtype, gpu).ctas_per_sm(gpu))


def one_tile_split(plan, b: int, e: int, num_sms: int, mode: str = "off") -> tuple:
    """``(s, kind, grid)``: CTAs ``b .. s - 1`` of the launch group ``[b, e)`` run in the
    group's usual launch, CTAs ``s .. e - 1`` in a launch of ``kind`` ("one-tile": the one-tile
    layout, one block per item; "piped": the piped kernel) with ``grid`` blocks; ``s == e``:
    nothing split off.  The split-off CTAs are the group's one-tile CTAs after its last longer
    one (a group is ordered longest first, so they are its tail).  Eligible groups: 16 rows and
    an n with a one-tile layout ("split") or a piped layout ("piped", "piped-all")."""
    from .cuda_compile import ONE_TILE_LAYOUTS, PIPED_LAYOUTS
    if mode not in ONE_TILE_MODES:
        raise ValueError(f"one_tile must be one of {ONE_TILE_MODES}, got {mode!r}")
    if mode == "off" or e <= b:
        return e, None, 0
    m, n = (int(x) for x in plan.tile_configs[int(plan.cta_tile[b])])
    piped = mode.startswith("piped")
    if m != 16 or (n not in PIPED_LAYOUTS if piped else (m, n) not in ONE_TILE_LAYOUTS):
        return e, None, 0
    hk = plan.num_kv_heads
    if mode == "piped-all":
        s = b
    else:
        longer = (plan.cta_kv_len[b:e] > n).nonzero()[0]
        s = b + (int(longer[-1]) + 1 if len(longer) else 0)
        if s == e:
            return e, None, 0
    if not piped:
        return s, "one-tile", (e - s) * hk
    return s, "piped", min((e - s) * hk, piped_blocks_per_sm(plan, n) * num_sms)
