"""The simulator's front door: :func:`simulate` a Plan on a GPU.

Cost of one forward thread block (one CTA, one KV head) with ``t`` KV tiles of ``m x n``, run by
its variant's ``warps`` warps (:func:`pat_core.tiles.kernel_resources`)::

    latency  = block_ns
    bytes    = KV + Q + partial writes                       (see sim.traffic)
    compute  = t * (tile_ns + 4 * m * n * head_dim / sm_flops)   (wg_flops, when set, for
               the Hopper warpgroup tiles of 64 and 128 rows)
    chain    = t * tile_lat_ns / warps
    duration = latency + max(bytes / bandwidth share, compute, chain)

where the bandwidth share comes from the event-driven fluid model of :mod:`sim.timeline`: memory
bandwidth is split between the blocks that are streaming in proportion to the KV bytes each
keeps in flight (its weight: ``min(stages, tiles) * n`` tokens of K and V over
:data:`WEIGHT_BYTES`; where memory is the bottleneck every request waits about as long, so a
block's rate follows what it has in flight), no SM pulling more than ``sm_bandwidth``, the HBM
bytes of all of them together no more than ``hbm_bandwidth`` and their L2 hits (:mod:`sim.l2`:
a page re-read while still in L2) no more than ``l2_bandwidth``; a block streams its shared
prefix's hits before its own pages (all but the hits its KV pipeline has in flight with the
misses that follow), and while DRAM is the bottleneck its hits move no faster than the misses
around them (they queue at the same L2 slices).  Forward blocks of kernels with more than
``SMEM_OPT_IN_BYTES`` of shared memory and of kernels with less never share an SM
(:func:`sim.occupancy.smem_class`).  These three rules were measured block by block
(``bench/lab/block_timeline.py``, bench/NOTES.md: a deep tree's one-warp leaves wait for
the SMs of its 16x64 root blocks to empty; the root blocks, with four times the loads in flight,
finish first; the quick-start batch's ``query`` blocks that hit in L2 take 94% as long as those
that miss); :data:`INFLIGHT_WEIGHTS`, :data:`SMEM_CLASSES` and :data:`HITS_QUEUE` switch each
off for ablations.  (With every SM busy and equal blocks this is the
simple rule "an SM's share is ``hbm_bandwidth / num_sms``, split between its resident blocks";
the fluid form also gets the tail and small batches right.)  A merge block (``MERGE_WARPS``
(request, head) pairs) costs ``block_ns`` latency, its
partial reads and output writes, and ``merge_slot_ns`` per slot of its longest pair.

``chain`` is the block's latency chain: each KV tile is a run of dependent steps (page ids, then
the K and V loads, then the MMAs and the softmax) that the block's warps share, so a one-warp
block (such as the former short-KV ``16x32`` layout) runs them in series and cannot finish in less than
``block_ns + t * tile_lat_ns`` however little it moves (ncu, bench/NOTES.md: such a
block takes ~9 us from start to end on an H100 at 3.9% warp occupancy).  It binds only on short
steps of few, narrow blocks; ``tile_lat_ns = 0`` (files without it) turns it off, and the
packaged constants have it off: refit with it (``sim fit --latency-chain``) it took 1.2 us
(H100) and 0.75 us (H200), too little to move a one-wave step's order of pat and query, while
the larger values that do (2.6-3.4 us, in graph-only refits) put more held-out pat/query pairs
in the wrong order (bench/NOTES.md).  The time such steps miss stays in the fitted
``graph_start_ns``.

The launches are the CUDA backend's one launch path (:mod:`pat_core.launch`): one forward
launch per tile config the plan uses, tallest tiles first
(:func:`pat_core.launch.forward_launches`, the order of
:func:`pat_core.static_plan.order_tiles`), each launch's work items (CTA x KV head, a CTA's KV
heads adjacent) in plan order; then the merge, whose blocks take only the requests of more
than one partial slot (a request of one slot gets its output from its forward block; see
:mod:`sim.traffic`).  The merge launch is absent when every request has one slot and no
forward launch has more items than resident blocks (:func:`pat_core.launch.merge_needed`;
with more items a block draws a second one and the merge resets the work counters, a launch
of blocks that move nothing).  On a GPU with programmatic dependent launch
(:func:`pat_core.launch.dependent_launch_ok`, sm_90 and later) the forward launches are one
phase, each gated on the one before it (its blocks placed once every block of that one has
been); elsewhere they run one after another in stream order, a phase each.  Every plan is laid
out so, as the backend runs it: a plan marked ``serial`` (the ``cascade`` packer's levels)
too, and its group order does not matter.

Launch ``k`` (forward launches in order, then the merge) reaches the GPU at
``start + (k + 1) * launch``; a launch that waits for another starts ``gap`` after it
finishes.  Every launch is on the caller's stream, so no launch waits for a join of
concurrent branches (``graph_join_ns``, which ``bench/calibrate.py`` measures, stays in the
constants files but prices nothing here).
``start`` is paid once per step, ``launch`` once per launch: a graph replay has a fixed latency
before its first kernel whatever the number of kernels, and each launch adds ~1-2 us (H100:
a graph of one trivial kernel replays in 3-4 us with the L2 flush the calibration timings use,
a pat step of two to three launches in 17-20 us; bench/NOTES.md), so folding
the fixed part into ``launch`` would charge a plan of several small launches that latency
once per launch.  The
timing mode picks ``(start, launch, gap, join)``: ``graph`` (default) uses ``graph_start_ns``/
``graph_launch_ns``/``graph_gap_ns``/``graph_join_ns`` (a CUDA-graph replay: what a serving loop that captures
decode sees), ``eager`` uses ``start_ns``/``launch_ns``/``gap_ns`` and no join (``run()``
called from Python: each launch pays the host's cost, event calls included).
The predicted latency is the end of the last kernel: what CUDA events around ``run()`` (or
around the graph's replay) measure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pat_core.cuda_compile import FwdVariant
from pat_core.gpus import GPUSpec, get_gpu
from pat_core.tiles import _arch_of

from pat_core.launch import (dependent_launch_ok, forward_launches, merge_heads_per_warp,
                             merge_needed)

from .constants import SimConstants, check_timing, load_constants
from .l2 import l2_split, l2_window
from .occupancy import (MERGE_WARPS, config_resources, merge_resources, plan_occupancy,
                        resource_vector, sm_capacity, smem_class)
from .timeline import Launch, Timeline, run_engine
from .traffic import bytes_by_kind, forward_work, merge_work, padding_waste

# a block's bandwidth weight is its KV bytes in flight over this (a 16x64 tile's two stages of
# 64 fp16 tokens at head_dim 128, K and V); a merge block weighs 1
WEIGHT_BYTES = 65536.0
# the timeline's sharing rules (module docstring), each on; False turns one off (ablations)
INFLIGHT_WEIGHTS = True     # bandwidth in proportion to the loads in flight (else equal shares)
SMEM_CLASSES = True         # forward blocks of the two sim.occupancy.smem_class classes apart
HITS_QUEUE = True           # L2 hits no faster than DRAM's level while DRAM is saturated


@dataclass
class Workload:
    """Everything about a plan's thread blocks that does not depend on the constants.

    Made once per (plan, GPU); :func:`predict` then prices it under any constants
    (the calibration fit does that hundreds of times).
    """

    gpu: GPUSpec
    launches: list
    need: np.ndarray          # int64 [configs + 1, 4]: per-config SM resources (last = merge)
    blk_cfg: np.ndarray
    blk_cta: np.ndarray
    blk_head: np.ndarray
    blk_launch: np.ndarray
    blk_bytes: np.ndarray     # all bytes a block moves (HBM + L2)
    blk_l2: np.ndarray        # of which L2 hits (sim.l2)
    blk_lead: np.ndarray      # of those, the hits streamed before the rest (see prepare)
    blk_tiles: np.ndarray     # forward: KV tiles; merge: 0
    blk_flops: np.ndarray     # forward: padded tile flops; merge: 0
    blk_slots: np.ndarray     # merge: slots of the longest pair; forward: 0
    num_phases: int
    l2_window: float = 0.0
    blk_warps: np.ndarray | None = None    # forward: warps of the block's own variant; merge: 0
    blk_stages: np.ndarray | None = None   # forward: its KV pipeline stages; merge: 0
    blk_wg: np.ndarray | None = None       # forward: a warpgroup (wgmma) tile; merge: False
    blk_weight: np.ndarray | None = None   # loads in flight, in WEIGHT_BYTES (merge: 1)
    cfg_class: np.ndarray | None = None    # int [configs + 2]: sim.occupancy.smem_class (-1: any)


def prepare(plan, gpu=None, l2_window_bytes: float | None = None,
            fused_tiles=None) -> Workload:
    """Lay out ``plan``'s thread blocks as launches (see module docstring).

    ``gpu``: spec or name to simulate (default: the GPU the plan was made for).
    ``l2_window_bytes``: L2 reuse window (default :func:`sim.l2.l2_window` of the GPU; ``0``
    turns L2 hits off).
    ``fused_tiles``: the ``(m, n)`` tiles of a fused launch (graph-safe mode's fused pull
    launch: every tile in one kernel): the plan's items all go to that one launch, and every
    block takes the largest threads, registers per thread and shared memory of those tiles,
    so an item of a small tile runs at the fused block's residency (its own warps and
    stages otherwise).
    """
    gpu = get_gpu(gpu if gpu is not None else plan.gpu)
    occ = plan_occupancy(plan, gpu)
    T = plan.tile_configs.shape[0]
    need = np.zeros((T + 1, 4), dtype=np.int64)   # tile configs, then the merge
    for k, o in enumerate(occ):
        r = o.resources
        need[k] = resource_vector(r.threads, r.registers, r.smem)
    if fused_tiles is not None:
        res = [config_resources(int(m), int(n), plan.head_dim, plan.kv_dtype, gpu)
               for m, n in fused_tiles]
        need[:T] = resource_vector(max(r.threads for r in res), max(r.registers for r in res),
                                   max(r.smem for r in res))
    mr = merge_resources()
    need[T] = resource_vector(mr.threads, mr.registers, mr.smem)
    # which forward blocks may share an SM (the merge's share with any)
    cfg_class = np.full(T + 1, -1, dtype=np.int64)
    for k in range(T):
        cfg_class[k] = smem_class(int(need[k, 0]))
    cap = sm_capacity(gpu)
    for k, o in enumerate(occ):
        if np.any(need[k] > cap):
            raise ValueError(f"tile {o.m}x{o.n} needs {need[k].tolist()} (smem, registers, "
                             f"threads, slots) but a {gpu.name} SM offers {cap.tolist()}")

    w = forward_work(plan)
    hk = plan.num_kv_heads
    fwd = forward_launches(plan)
    fused = fused_tiles is not None
    chained = not fused and len(fwd) >= 2 and dependent_launch_ok(gpu)
    launches, cfg, cta, head, lau, byt, til, flo, slo = [], [], [], [], [], [], [], [], []
    # each block runs its own variant's code: its warps and stages
    cfg_warps = np.array([o.resources.threads // 32 for o in occ], dtype=np.float64)
    # ... and whether it is a warpgroup (wgmma) tile, which wg_flops prices when set
    arch = _arch_of(gpu)
    cfg_wg = np.array([FwdVariant.make(o.m, o.n, plan.head_dim, plan.kv_dtype, arch=arch).warpgroup
                       for o in occ], dtype=bool)
    pos = 0
    for i, (k, (m, n), ctas) in enumerate(fwd):
        idx = np.repeat(ctas, hk)                            # a CTA's KV heads adjacent
        hh = np.tile(np.arange(hk, dtype=np.int32), ctas.shape[0])
        if fused and launches:                  # the one fused launch takes these items too
            launches[0].end = pos + idx.shape[0]
        else:
            launches.append(Launch(name="forward fused" if fused else f"forward {m}x{n}",
                                   kind="forward", config=k, begin=pos,
                                   end=pos + idx.shape[0], issue_ns=0.0,
                                   phase=0 if chained or fused else i,
                                   gate=i - 1 if chained and i > 0 else -1))
        cfg.append(np.full(idx.shape[0], k, np.int32))
        cta.append(idx.astype(np.int32))
        head.append(hh)
        lau.append(np.full(idx.shape[0], len(launches) - 1, np.int32))
        byt.append(w.bytes[idx])
        til.append(w.tiles[idx].astype(np.float64))
        flo.append(w.flops[idx])
        slo.append(np.zeros(idx.shape[0]))
        pos += idx.shape[0]
    nf_launch = len(cta)                          # forward launches' arrays come first
    fwd_phases = 1 if chained or fused else len(fwd)
    # the merge: blocks for the requests of more than one slot; where there are none but a
    # forward block drew a second item, a launch of blocks that only reset the work counters
    mw = merge_work(plan)
    m_bytes, m_read, m_slots = mw.bytes, mw.read_bytes_per_block, mw.max_slots
    if m_bytes.shape[0] == 0 and merge_needed(plan, [o.ctas_per_sm for o in occ],
                                              gpu.num_sms):
        pairs = plan.num_qo_tokens * plan.num_qo_heads // merge_heads_per_warp(plan,
                                                                              gpu.num_sms)
        nreset = max(1, -(-pairs // MERGE_WARPS))
        m_bytes = m_read = np.zeros(nreset)
        m_slots = np.zeros(nreset, np.int64)
    nm = m_bytes.shape[0]
    if nm:
        launches.append(Launch(name="merge", kind="merge", config=-1, begin=pos, end=pos + nm,
                               issue_ns=0.0, phase=fwd_phases))
        cfg.append(np.full(nm, T, np.int32))
        cta.append(np.arange(nm, dtype=np.int32))
        head.append(np.full(nm, -1, np.int32))
        lau.append(np.full(nm, len(launches) - 1, np.int32))
        byt.append(m_bytes)
        til.append(np.zeros(nm))
        flo.append(np.zeros(nm))
        slo.append(m_slots.astype(np.float64))
    window = l2_window(gpu) if l2_window_bytes is None else float(l2_window_bytes)
    f_cta = np.concatenate(cta[:nf_launch]) if nf_launch else np.zeros(0, np.int32)
    f_head = np.concatenate(head[:nf_launch]) if nf_launch else np.zeros(0, np.int32)
    f_other = (w.q_bytes + w.partial_write_bytes)[f_cta.astype(np.int64)]
    # room a resident forward block takes, in SMs: 1 / (blocks of its config one SM holds)
    per_sm = (cap[None, :] // np.maximum(need, 1)).min(axis=1)
    f_cfg = np.concatenate(cfg[:nf_launch]) if nf_launch else np.zeros(0, np.int32)
    f_weight = 1.0 / np.maximum(per_sm[f_cfg], 1)
    blk_l2 = l2_split(plan, f_cta, f_head, f_other, m_read, window,
                      blk_weight=f_weight, capacity=float(gpu.num_sms))
    # A block's hits come first (a shared prefix precedes a request's own pages) and stream
    # before its misses, except the last `stages` KV tiles' worth (the `stages - 1` tiles its
    # pipeline has loading plus the one it computes on): those overlap the misses behind them
    # (a short block's hits and misses all move together).  Merge blocks: one mix.
    stages = np.array([o.resources.stages for o in occ], dtype=np.float64)
    fc = f_cta.astype(np.int64)
    f_tile = plan.cta_tile[fc].astype(np.int64)                 # each forward block's variant
    f_stages = stages[f_tile]
    tok = w.kv_bytes / np.maximum(w.kv_len, 1)                  # KV bytes per token
    tile_bytes = w.n[fc] * tok[fc]                              # KV bytes of one of its tiles
    inflight = f_stages * tile_bytes
    blk_lead = np.zeros(blk_l2.shape[0])
    nf = f_cta.shape[0]
    blk_lead[:nf] = np.maximum(blk_l2[:nf] - inflight, 0.0)
    # Bandwidth weight: the KV bytes a block keeps in flight, its pipeline's stages of tiles (no
    # more than it has).  Where the memory system is the bottleneck every request waits about as
    # long, so blocks move bytes in proportion to what they have in flight (Little's law): a
    # one-warp, one-stage block of one tile gets a quarter of what a 16x64 block of two stages
    # gets (measured: bench/lab/block_timeline.py, bench/NOTES.md).
    weight = np.ones(blk_l2.shape[0])
    weight[:nf] = np.minimum(f_stages, np.maximum(w.tiles[fc], 1)) * tile_bytes / WEIGHT_BYTES
    return Workload(gpu=gpu, launches=launches, need=need, blk_cfg=np.concatenate(cfg),
                    blk_cta=np.concatenate(cta), blk_head=np.concatenate(head),
                    blk_launch=np.concatenate(lau), blk_bytes=np.concatenate(byt),
                    blk_l2=blk_l2, blk_lead=blk_lead, blk_tiles=np.concatenate(til),
                    blk_flops=np.concatenate(flo), blk_slots=np.concatenate(slo),
                    num_phases=fwd_phases + (1 if nm else 0), l2_window=window,
                    blk_warps=np.concatenate([cfg_warps[f_tile], np.zeros(nm)]),
                    blk_stages=np.concatenate([f_stages, np.zeros(nm)]),
                    blk_wg=np.concatenate([cfg_wg[f_tile], np.zeros(nm, dtype=bool)]),
                    blk_weight=weight, cfg_class=cfg_class)


def block_costs(wl: Workload, c: SimConstants) -> tuple:
    """``(latency, compute)`` (ns) of every block of ``wl`` under constants ``c``."""
    latency = np.full(wl.blk_cfg.shape[0], float(c.block_ns))
    flops = np.full(wl.blk_cfg.shape[0], float(c.sm_flops))
    if c.wg_flops > 0 and wl.blk_wg is not None:   # the warpgroup tiles at their own rate
        flops[wl.blk_wg] = float(c.wg_flops)
    compute = wl.blk_tiles * c.tile_ns + wl.blk_flops / flops + wl.blk_slots * c.merge_slot_ns
    if c.tile_lat_ns > 0 and wl.blk_warps is not None:
        # the latency chain: a forward block cannot end before block_ns + t * tile_lat_ns / warps
        # (its warps share each tile's dependent loads, MMAs and softmax; one warp runs them all
        # in series).  compute runs beside the stream, so flooring it floors the block's duration
        fwd = wl.blk_tiles > 0
        chain = wl.blk_tiles * float(c.tile_lat_ns) / np.maximum(wl.blk_warps, 1.0)
        compute = np.where(fwd, np.maximum(compute, chain), compute)
    return latency, compute


def run_timeline(wl: Workload, c: SimConstants, timing: str = "graph") -> Timeline:
    """Price ``wl`` under constants ``c`` in timing mode ``timing`` and run the timeline."""
    launch_ns, gap_ns = c.launch_costs(timing)
    start_ns = c.start_cost(timing)
    latency, compute = block_costs(wl, c)
    ptr = np.array([ln.begin for ln in wl.launches] + [wl.launches[-1].end], dtype=np.int64)
    issue = start_ns + (np.arange(len(wl.launches), dtype=np.float64) + 1.0) * launch_ns
    phase = np.array([ln.phase for ln in wl.launches], dtype=np.int32)
    gate = np.array([ln.gate for ln in wl.launches], dtype=np.int32)
    # every launch is on the caller's stream (no fork, so no join): a phase opens gap_ns after
    # the one before it ends
    gaps = np.full(wl.num_phases, gap_ns)
    sm, lane, start, end, ps, pe = run_engine(
        wl.gpu.num_sms, sm_capacity(wl.gpu), wl.need, wl.blk_cfg, latency, wl.blk_bytes, compute,
        ptr, issue, phase, wl.num_phases, gaps, c.sm_bandwidth, c.hbm_bandwidth,
        blk_l2=wl.blk_l2, l2_bw=c.l2_bandwidth, blk_lead=wl.blk_lead, stream_gate=gate,
        blk_weight=wl.blk_weight if INFLIGHT_WEIGHTS else None,
        cfg_class=wl.cfg_class if SMEM_CLASSES else None, hits_queue=HITS_QUEUE)
    launches = [Launch(ln.name, ln.kind, ln.config, ln.begin, ln.end, float(issue[i]), ln.phase,
                       ln.gate) for i, ln in enumerate(wl.launches)]
    return Timeline(num_sms=wl.gpu.num_sms, launches=launches, block_launch=wl.blk_launch,
                    block_cta=wl.blk_cta, block_head=wl.blk_head, block_sm=sm, block_lane=lane,
                    block_start=start, block_end=end, phase_start=ps, phase_end=pe)


def predict(wl: Workload, c: SimConstants, timing: str = "graph") -> float:
    """Predicted latency (ns) of a prepared workload in timing mode ``timing``."""
    return run_timeline(wl, c, timing).makespan


def bytes_by_level(wl: Workload) -> dict:
    """Bytes of a prepared workload by where they are served: ``hbm``, ``l2`` and ``total``
    (``total`` equals ``Plan.stats()["total_bytes"]``)."""
    total = int(round(float(wl.blk_bytes.sum())))
    l2 = int(round(float(wl.blk_l2.sum())))
    return {"hbm": total - l2, "l2": l2, "total": total}


@dataclass
class SimResult:
    """What :func:`simulate` reports.  Times in ns, fractions in ``[0, 1]``."""

    plan: object
    gpu: GPUSpec
    constants: SimConstants
    timeline: Timeline
    bytes: dict               # by kind: kv, q, partial_write, partial_read, out, total
    bytes_level: dict         # by where served: hbm, l2, total (== bytes["total"])
    occupancy: list           # ConfigOccupancy per tile config
    waste: dict               # padding waste: rows, columns, total
    latency_ns: float
    forward_ns: float         # end of the last forward block
    merge_ns: float           # merge kernel span (its first block's start to the end)
    bubble: float             # idle SM-time share between the first block's start and the end
    forward_bubble: float     # the same over the forward kernels only
    timing: str = "graph"
    extra: dict = field(default_factory=dict)

    @property
    def latency_us(self) -> float:
        return self.latency_ns / 1e3

    @property
    def num_blocks(self) -> int:
        return self.timeline.num_blocks

    def summary_row(self, method: str | None = None) -> dict:
        st = self.plan.stats()
        return {
            "method": method or self.plan.packer,
            "ctas": st["num_ctas"],
            "blocks": int(self.timeline.blocks_of("forward").sum()),
            "launches": len(self.timeline.launches),
            "tiles": st["tiles"],
            "kv_bytes": self.bytes["kv"],
            "total_bytes": self.bytes["total"],
            "hbm_bytes": self.bytes_level["hbm"],
            "l2_bytes": self.bytes_level["l2"],
            "timing": self.timing,
            "predicted_us": round(self.latency_us, 3),
            "forward_us": round(self.forward_ns / 1e3, 3),
            "merge_us": round(self.merge_ns / 1e3, 3),
            "bubble_pct": round(100 * self.bubble, 2),
            "forward_bubble_pct": round(100 * self.forward_bubble, 2),
            "waste_pct": round(100 * self.waste["total"], 2),
        }

    def as_dict(self) -> dict:
        return {
            "packer": self.plan.packer, "gpu": self.gpu.name,
            "num_sms": self.gpu.num_sms, "constants": self.constants.as_dict(),
            "constants_source": self.constants.source,
            "latency_us": self.latency_us, "forward_us": self.forward_ns / 1e3,
            "merge_us": self.merge_ns / 1e3, "bubble": self.bubble,
            "forward_bubble": self.forward_bubble, "waste": self.waste, "bytes": self.bytes,
            "bytes_level": self.bytes_level, "timing": self.timing,
            "stats": self.plan.stats(), "occupancy": [o.as_dict() for o in self.occupancy],
            "num_blocks": self.num_blocks,
        }


def _idle_share(tl: Timeline, mask, t0: float, t1: float) -> float:
    span = t1 - t0
    if span <= 0:
        return 0.0
    return max(0.0, 1.0 - tl.busy_time(mask, t0, t1) / (tl.num_sms * span))


def simulate(plan, gpu=None, constants: SimConstants | str | None = None,
             timing: str = "graph", launch_set=None) -> SimResult:
    """Simulate one decode step of ``plan``.

    Parameters
    ----------
    plan : :class:`pat_core.Plan`.
    gpu : GPU spec or name to simulate (default: the plan's GPU).  A ``dataclasses.replace``
        variant of a known GPU uses that GPU's constants.
    constants : :class:`SimConstants`, a path to a constants JSON file, or ``None`` for
        ``sim/data/<gpu>.json`` (the default estimate when absent).
    timing : ``"graph"`` (default: CUDA-graph replay, in-graph launch gaps) or ``"eager"``
        (``run()`` from Python: the host's cost per launch).
    launch_set : ``None`` (the plain launches: the tiles the plan uses), or graph-safe mode's
        fixed launch set as ``(tiles, fused)``: the ``(m, n)`` tiles a graph-safe wrapper
        launches on every replay (:attr:`pat_core.static_plan.StaticLayout.tiles`, a superset
        of the plan's) and whether they run as one fused launch.  Every tile of the set the
        plan gives no CTA (none when fused) is one more launch, and the merge is launched even
        where the plan alone needs none; each such launch, whose blocks move nothing, costs
        the timing's per-launch time (``graph_launch_ns`` / ``launch_ns``) after the forward
        phase (:func:`idle_launches`).  A fused set runs the plan's items in one launch of
        blocks the size of the set's largest tile (:func:`prepare`'s ``fused_tiles``).
        Measured (bench/NOTES.md): a
        graph-safe replay on the H100 cost 1-2.5 us per idle launch over the plain one (about
        1 us since a block without an item leaves the launch chain without an atomic), and
        the per-launch constant, fitted on plain plans alone, brought the predicted graph-safe
        replays of the development set (one wrapper per part) from 2.0 / 1.6 / 18.7% median
        error (conversation, agent, synthetic) to 0.5 / 2.1 / 6.0%.
    """
    check_timing(timing)
    fused = launch_set is not None and bool(launch_set[1])
    wl = prepare(plan, gpu, fused_tiles=launch_set[0] if fused else None)
    if constants is None or isinstance(constants, str):
        constants = load_constants(wl.gpu, constants)
    tl = run_timeline(wl, constants, timing)
    fwd = tl.blocks_of("forward")
    mrg = ~fwd
    start = float(np.nanmin(tl.block_start))
    end = tl.makespan
    fwd_end = float(np.nanmax(tl.block_end[fwd])) if fwd.any() else start
    fwd_start = float(np.nanmin(tl.block_start[fwd])) if fwd.any() else start
    merge_span = (end - float(np.nanmin(tl.block_start[mrg]))) if mrg.any() else 0.0
    extra = {}
    if launch_set is not None:
        idle = idle_launches(plan, launch_set, has_merge=any(ln.kind == "merge"
                                                             for ln in tl.launches))
        end += idle * constants.launch_costs(timing)[0]     # the step ends that much later
        extra["idle_launches"] = idle
    return SimResult(
        plan=plan, gpu=wl.gpu, constants=constants, timeline=tl,
        bytes=bytes_by_kind(plan), bytes_level=bytes_by_level(wl),
        occupancy=plan_occupancy(plan, wl.gpu), timing=timing,
        waste=padding_waste(plan), latency_ns=end, forward_ns=fwd_end, merge_ns=merge_span,
        bubble=_idle_share(tl, None, start, end),
        forward_bubble=_idle_share(tl, fwd, fwd_start, fwd_end), extra=extra)


def idle_launches(plan, launch_set, has_merge: bool) -> int:
    """Launches of graph-safe mode's fixed ``launch_set`` (``(tiles, fused)``, as
    :func:`simulate` takes it) that move nothing for ``plan``: its tiles without a CTA of the
    plan (none when ``fused``), and the merge when the plan's own launches have none
    (``has_merge`` false).  ``ValueError`` when the set lacks a tile the plan uses."""
    tiles, fused = launch_set
    tiles = {(int(m), int(n)) for m, n in tiles}
    used = {tuple(int(x) for x in plan.tile_configs[k])
            for k in np.unique(plan.cta_tile).tolist()}
    if not used <= tiles:
        raise ValueError(f"launch_set: the plan uses tiles {sorted(used - tiles)} the set "
                         f"{sorted(tiles)} lacks")
    return (0 if fused else len(tiles - used)) + (0 if has_merge else 1)
