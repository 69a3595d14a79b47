"""Event-driven timeline: thread blocks on SMs, streams, phases and shared DRAM bandwidth.

What it models
--------------
* **Dispatch.** Each launch is a stream of thread blocks in launch order (for a forward launch:
  its work items in the order its blocks draw them, a CTA's KV heads adjacent).  A launch
  becomes visible to the GPU at its host issue time.  Like the hardware block scheduler, blocks
  of one launch are placed in order (a block that does not fit holds back the rest of its
  launch), while a later launch of the same phase may fill the SMs the earlier one cannot use.  A block goes to the SM with the
  fewest resident blocks among those with enough free shared memory, registers, threads and CTA
  slots (breadth-first, as the hardware spreads a grid).
* **Phases.** Launches carry a phase number.  A phase starts ``gap_ns`` after every block of the
  previous phase has finished (a kernel waiting on another, through stream order or an event).
  The chained forward launches share phase 0 and the merge kernel is phase 1; forward launches
  that run one after another in stream order (no programmatic dependent launch) are a phase
  each.  A launch may also be *gated* on an earlier launch of its phase: none
  of its blocks is placed before all of the gate's are (a programmatic dependent launch, whose
  blocks are placed once every block of the launch it depends on has been: the chained forward
  launches of :mod:`pat_core.launch`); the phase ends after every block of its launches.
* **A block's life.** ``latency`` (time the KV pipeline cannot hide: query load, first tile in
  flight, partial write), then *streaming*: it moves its ``bytes`` while computing; it ends when
  both the bytes are moved and ``compute`` time has passed since streaming began (the kernel
  double-buffers, so compute and loads overlap).
* **Placement classes.** A block config may carry a class (0 or 1; -1: any): a block is not
  placed on an SM that holds a block of the other class (measured: forward kernels with and
  without a raised shared-memory limit never share an SM; :func:`sim.occupancy.smem_class`).
* **Bandwidth.** Memory is shared as a fluid between streaming blocks in proportion to their
  weights (the loads each keeps in flight: the memory system serves outstanding requests, and
  where it is the bottleneck each waits about as long, so a block's rate follows what it has in
  flight; with equal weights this is max-min fair), under three caps: one SM pulls at most
  ``sm_bw`` (its blocks split it); the blocks streaming from HBM together at most ``hbm_bw``;
  the blocks streaming L2 hits (see :mod:`sim.l2`) together at most ``l2_bw``.  A block
  streams its *leading* L2 hits first (a shared prefix precedes a request's own pages;
  :func:`sim.model.prepare` leads with all hits but what the KV pipeline keeps in flight), then
  the rest as a fixed mix of HBM bytes and remaining hits.  So blocks that start together read
  the shared part from L2 (at L2 speed unless DRAM is already the bottleneck, see below) and
  then meet at the HBM cap, rather than spreading the hits over their whole life.  The blocks of one SM move at one common
  level: the lowest that the caps of the pools they draw on allow (each pool's level solved on
  its own, so where the two caps bind on different SMs the split is not exactly max-min fair:
  bandwidth one pool's SMs leave unused is not handed to the other's).  With ``hits_queue``, an
  SM streaming L2 hits moves no faster than DRAM's level while DRAM is the bottleneck (the hits
  wait in the same L2 queues as the misses), though its hits cost no DRAM bandwidth.  A level is
  per unit of weight: a block moves ``weight x level``.  So a lone block cannot use the whole
  GPU, a full GPU cannot exceed DRAM bandwidth, and L2 hits cost no DRAM bandwidth.

The engine is a Numba loop over events (a block starting, finishing its latency, its bytes or its
compute; a launch arriving; a phase opening).  Per event it touches every SM once (and sorts the
streaming SMs' caps to solve each pool's level), so a plan of tens of thousands of blocks
simulates in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

_INF = np.inf


@njit(cache=True)
def _recompute_sm(x, res, state, timer_end, vfin, max_res):
    tmin = _INF
    vmin = _INF
    for lane in range(max_res):
        b = res[x, lane]
        if b < 0:
            continue
        s = state[b]
        if s == 1 or s == 3:
            if timer_end[b] < tmin:
                tmin = timer_end[b]
        elif s == 2:
            if vfin[b] < vmin:
                vmin = vfin[b]
    return tmin, vmin


@njit(cache=True)
def _fair_level(ntr, wsum, dsum, num_sms, sm_bw, cap_bw, cbuf, dbuf):
    """The level (rate per unit of in-flight weight) at which one capped pool runs out.

    A block of weight ``w`` (its loads in flight, see :func:`run_engine`) on SM ``x`` moves at
    ``w * min(c_x, L)``, ``c_x = sm_bw / wsum_x`` the most the SM allows per unit
    (``wsum_x``: the weight of its streaming blocks).  A block draws on the pool with a share of
    its weight: all of it for the L2 while it streams its leading hits; while it streams the rest,
    its HBM share for DRAM and the remaining hits' share for the L2; ``dsum[x]`` is that share
    summed over SM ``x``.  ``L`` (returned; ``inf`` when the pool is not the limit) makes the
    demand ``sum_x dsum_x * min(c_x, L)`` equal ``cap_bw``: raise ``L`` through the SMs' caps in
    increasing order, each SM whose cap is passed saturating there.  With every weight 1 this is
    the plain rule ``sum_x min(sm_bw, k_x * L) = cap_bw`` (``k_x`` streaming
    blocks on SM ``x``).
    """
    n = 0
    full = 0.0
    total = 0.0
    for x in range(num_sms):
        if ntr[x] > 0 and dsum[x] > 0.0:
            c = sm_bw / wsum[x]
            cbuf[n] = c
            dbuf[n] = dsum[x]
            full += dsum[x] * c
            total += dsum[x]
            n += 1
    if n == 0 or full <= cap_bw * (1.0 + 1e-12):
        return _INF
    order = np.argsort(cbuf[:n])
    sat_bw = 0.0          # demand of the SMs saturated at their cap
    weight = total        # pool share of the blocks on unsaturated SMs
    for i in order:
        L = (cap_bw - sat_bw) / weight
        if L <= cbuf[i]:
            return L
        sat_bw += dbuf[i] * cbuf[i]
        weight -= dbuf[i]
    return _INF


@njit(cache=True)
def _start_stream(b, x, V, blk_bytes, blk_lead, blk_w, hshare, seg, vfin, hsum, lsum, wsum):
    """Block ``b`` on SM ``x`` starts streaming: its leading L2 hits, else its mixed rest.
    ``V[x]`` counts bytes per unit of weight, so block ``b`` is done at ``bytes / w``."""
    wsum[x] += blk_w[b]
    if blk_lead[b] > 0.0:
        seg[b] = 0
        vfin[b] = V[x] + blk_lead[b] / blk_w[b]
        lsum[x] += blk_w[b]
    else:
        _start_rest(b, x, V, blk_bytes, blk_lead, blk_w, hshare, seg, vfin, hsum, lsum)


@njit(cache=True)
def _start_rest(b, x, V, blk_bytes, blk_lead, blk_w, hshare, seg, vfin, hsum, lsum):
    seg[b] = 1
    vfin[b] = V[x] + (blk_bytes[b] - blk_lead[b]) / blk_w[b]
    hsum[x] += blk_w[b] * hshare[b]
    lsum[x] += blk_w[b] * (1.0 - hshare[b])


@njit(cache=True)
def _finish_block(b, x, lane, t, state, blk_end, blk_cfg, need, free, nres, res, remaining,
                  blk_phase, cfg_class, ncls):
    state[b] = 4
    blk_end[b] = t
    k = blk_cfg[b]
    for j in range(4):
        free[x, j] += need[k, j]
    nres[x] -= 1
    if cfg_class[k] >= 0:
        ncls[x, cfg_class[k]] -= 1
    res[x, lane] = -1
    remaining[blk_phase[b]] -= 1


@njit(cache=True)
def _simulate(num_sms, cap, need, blk_cfg, blk_latency, blk_bytes, blk_l2, blk_lead, blk_compute,
              stream_ptr, stream_ready, stream_phase, stream_gate, num_phases,
              phase_gap, sm_bw, hbm_bw, l2_bw, blk_w, cfg_class, hits_queue):
    N = blk_cfg.shape[0]
    S = stream_ready.shape[0]
    max_res = cap[3]
    blk_sm = np.full(N, -1, dtype=np.int32)
    blk_lane = np.full(N, -1, dtype=np.int32)
    blk_start = np.full(N, np.nan)
    blk_end = np.full(N, np.nan)
    phase_start = np.full(num_phases, np.nan)
    phase_end = np.full(num_phases, np.nan)
    # 0 pending, 1 latency, 2 streaming, 3 compute, 4 done
    state = np.zeros(N, dtype=np.int8)
    seg = np.zeros(N, dtype=np.int8)        # while streaming: 0 its leading hits, 1 the rest
    hshare = np.ones(N)                     # HBM share of the rest of each block's bytes
    for b in range(N):
        rest = blk_bytes[b] - blk_lead[b]
        if rest > 0.0:
            hshare[b] = (blk_bytes[b] - blk_l2[b]) / rest
    timer_end = np.zeros(N)
    vfin = np.zeros(N)
    sstart = np.zeros(N)
    free = np.empty((num_sms, 4), dtype=np.int64)
    for x in range(num_sms):
        for j in range(4):
            free[x, j] = cap[j]
    res = np.full((num_sms, max_res), -1, dtype=np.int64)
    nres = np.zeros(num_sms, dtype=np.int64)
    ncls = np.zeros((num_sms, 2), dtype=np.int64)   # resident blocks of each class (0, 1)
    ntr = np.zeros(num_sms, dtype=np.int64)
    V = np.zeros(num_sms)
    tmin = np.full(num_sms, _INF)
    vmin = np.full(num_sms, _INF)
    rate = np.zeros(num_sms)                # per unit of weight: a block moves w * rate
    cbuf = np.zeros(num_sms)
    dbuf = np.zeros(num_sms)
    wsum = np.zeros(num_sms)                # weight summed over an SM's streaming blocks
    hsum = np.zeros(num_sms)                # HBM share of that weight
    lsum = np.zeros(num_sms)                # L2 share, likewise
    head = stream_ptr[:-1].copy()
    remaining = np.zeros(num_phases, dtype=np.int64)
    blk_phase = np.empty(N, dtype=np.int32)
    for s in range(S):
        remaining[stream_phase[s]] += stream_ptr[s + 1] - stream_ptr[s]
        for b in range(stream_ptr[s], stream_ptr[s + 1]):
            blk_phase[b] = stream_phase[s]
    cur = 0
    release = 0.0
    while cur < num_phases and remaining[cur] == 0:
        phase_start[cur] = 0.0
        phase_end[cur] = 0.0
        cur += 1
    t = 0.0
    done = 0
    status = 0
    while done < N:
        # ---- dispatch pending blocks of the open phase
        if cur < num_phases and release <= t:
            for s in range(S):
                if stream_phase[s] != cur or stream_ready[s] > t:
                    continue
                g = stream_gate[s]
                if g >= 0 and head[g] < stream_ptr[g + 1]:
                    continue            # its gate launch still has blocks to place
                while head[s] < stream_ptr[s + 1]:
                    b = head[s]
                    k = blk_cfg[b]
                    kc = cfg_class[k]
                    best = -1
                    bestn = max_res + 1
                    for x in range(num_sms):
                        if nres[x] < bestn and free[x, 0] >= need[k, 0] and \
                                free[x, 1] >= need[k, 1] and free[x, 2] >= need[k, 2] and \
                                free[x, 3] >= need[k, 3] and \
                                (kc < 0 or ncls[x, 1 - kc] == 0):
                            best = x
                            bestn = nres[x]
                    if best < 0:
                        break
                    lane = 0
                    while res[best, lane] >= 0:
                        lane += 1
                    res[best, lane] = b
                    nres[best] += 1
                    if kc >= 0:
                        ncls[best, kc] += 1
                    for j in range(4):
                        free[best, j] -= need[k, j]
                    blk_sm[b] = best
                    blk_lane[b] = lane
                    blk_start[b] = t
                    if np.isnan(phase_start[cur]):
                        phase_start[cur] = t
                    if blk_latency[b] > 0:
                        state[b] = 1
                        timer_end[b] = t + blk_latency[b]
                        if timer_end[b] < tmin[best]:
                            tmin[best] = timer_end[b]
                    else:
                        state[b] = 2
                        sstart[b] = t
                        ntr[best] += 1
                        _start_stream(b, best, V, blk_bytes, blk_lead, blk_w, hshare, seg,
                                      vfin, hsum, lsum, wsum)
                        if vfin[b] < vmin[best]:
                            vmin[best] = vfin[b]
                    head[s] += 1
        # ---- next event
        Lh = _fair_level(ntr, wsum, hsum, num_sms, sm_bw, hbm_bw, cbuf, dbuf)
        Ll = _fair_level(ntr, wsum, lsum, num_sms, sm_bw, l2_bw, cbuf, dbuf)
        tn = _INF
        for x in range(num_sms):
            if tmin[x] < tn:
                tn = tmin[x]
            if ntr[x] > 0:
                # an SM's blocks share one level: the lowest cap among the pools they draw on
                L = _INF
                if hsum[x] > 1e-12:
                    L = Lh
                if lsum[x] > 1e-12 and Ll < L:
                    L = Ll
                if hits_queue and Lh < L:
                    L = Lh
                rate[x] = min(sm_bw / wsum[x], L)
                te = t + (vmin[x] - V[x]) / rate[x]
                if te < tn:
                    tn = te
        if cur < num_phases:
            if release > t:
                if release < tn:
                    tn = release
            else:
                for s in range(S):
                    if stream_phase[s] == cur and head[s] < stream_ptr[s + 1] and \
                            stream_ready[s] > t and stream_ready[s] < tn:
                        tn = stream_ready[s]
        if tn == _INF:
            status = 1          # nothing can ever run: a block fits no SM
            break
        if tn < t:
            tn = t
        dt = tn - t
        for x in range(num_sms):
            if ntr[x] > 0:
                V[x] += rate[x] * dt
        t = tn
        eps_t = 1e-9 * t + 1e-9
        # ---- state changes at time t
        for x in range(num_sms):
            eps_v = 1e-9 * V[x] + 1e-6
            if not (tmin[x] <= t + eps_t or (ntr[x] > 0 and vmin[x] - V[x] <= eps_v)):
                continue
            for lane in range(max_res):
                b = res[x, lane]
                if b < 0:
                    continue
                finish = False
                if state[b] == 1 and timer_end[b] <= t + eps_t:
                    state[b] = 2
                    sstart[b] = t
                    ntr[x] += 1
                    _start_stream(b, x, V, blk_bytes, blk_lead, blk_w, hshare, seg, vfin, hsum,
                                  lsum, wsum)
                elif state[b] == 2 and seg[b] == 0 and vfin[b] - V[x] <= eps_v and \
                        blk_bytes[b] - blk_lead[b] > 0.0:
                    lsum[x] -= blk_w[b]         # leading hits done: the rest follows
                    _start_rest(b, x, V, blk_bytes, blk_lead, blk_w, hshare, seg, vfin, hsum,
                                lsum)
                elif state[b] == 2 and vfin[b] - V[x] <= eps_v:
                    ntr[x] -= 1
                    wsum[x] -= blk_w[b]
                    if seg[b] == 0:
                        lsum[x] -= blk_w[b]
                    else:
                        hsum[x] -= blk_w[b] * hshare[b]
                        lsum[x] -= blk_w[b] * (1.0 - hshare[b])
                    if ntr[x] == 0:
                        wsum[x] = 0.0
                        hsum[x] = 0.0
                        lsum[x] = 0.0
                    if sstart[b] + blk_compute[b] > t + eps_t:
                        state[b] = 3
                        timer_end[b] = sstart[b] + blk_compute[b]
                    else:
                        finish = True
                elif state[b] == 3 and timer_end[b] <= t + eps_t:
                    finish = True
                if finish:
                    _finish_block(b, x, lane, t, state, blk_end, blk_cfg, need, free, nres,
                                  res, remaining, blk_phase, cfg_class, ncls)
                    done += 1
            tmin[x], vmin[x] = _recompute_sm(x, res, state, timer_end, vfin, max_res)
        while cur < num_phases and remaining[cur] == 0:
            phase_end[cur] = t
            cur += 1
            if cur < num_phases:
                release = t + phase_gap[cur]
    return status, blk_sm, blk_lane, blk_start, blk_end, phase_start, phase_end


@dataclass
class Launch:
    """One kernel launch: its blocks (rows of the block arrays), host issue time and phase."""

    name: str                 # "forward 16x64" or "merge"
    kind: str                 # "forward" or "merge"
    config: int               # tile config index (-1 for the merge kernel)
    begin: int
    end: int
    issue_ns: float
    phase: int
    gate: int = -1            # a launch whose blocks are all placed before any of this one's
    #                           (-1: none)


@dataclass
class Timeline:
    """Where and when every thread block ran.  Times in ns from the first launch's issue."""

    num_sms: int
    launches: list
    block_launch: np.ndarray  # int32 [N]: launch index of each block
    block_cta: np.ndarray     # int32 [N]: Plan CTA (forward) or merge block index
    block_head: np.ndarray    # int32 [N]: KV head (forward) or -1
    block_sm: np.ndarray
    block_lane: np.ndarray    # resident slot on its SM (0 .. max_ctas_per_sm - 1), for drawing
    block_start: np.ndarray
    block_end: np.ndarray
    phase_start: np.ndarray
    phase_end: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.block_sm.shape[0])

    @property
    def makespan(self) -> float:
        return float(np.nanmax(self.block_end)) if self.num_blocks else 0.0

    def blocks_of(self, kind: str) -> np.ndarray:
        """Boolean mask of the blocks of ``kind`` (``"forward"`` or ``"merge"``) launches."""
        kinds = np.array([ln.kind == kind for ln in self.launches], dtype=bool)
        return kinds[self.block_launch]

    def busy_time(self, mask=None, t0: float | None = None, t1: float | None = None) -> float:
        """SM-time (ns summed over SMs) during which an SM holds at least one block of ``mask``,
        within ``[t0, t1]``."""
        if mask is None:
            mask = np.ones(self.num_blocks, dtype=bool)
        sm, s, e = self.block_sm[mask], self.block_start[mask], self.block_end[mask]
        if t0 is not None:
            s = np.maximum(s, t0)
        if t1 is not None:
            e = np.minimum(e, t1)
        keep = e > s
        sm, s, e = sm[keep], s[keep], e[keep]
        order = np.lexsort((s, sm))
        sm, s, e = sm[order], s[order], e[order]
        total = 0.0
        # union of intervals per SM: running max of ends within each SM
        for x in np.unique(sm):
            sel = sm == x
            ss, ee = s[sel], e[sel]
            run_end = np.maximum.accumulate(ee)
            new = np.ones(ss.shape[0], dtype=bool)
            new[1:] = ss[1:] > run_end[:-1]
            idx = np.flatnonzero(new)
            seg_end = np.append(run_end[idx[1:] - 1], run_end[-1])
            total += float((seg_end - ss[idx]).sum())
        return total

    def max_concurrency(self) -> int:
        """Most blocks resident on one SM at any time (a check on the scheduler)."""
        best = 0
        for x in np.unique(self.block_sm):
            sel = self.block_sm == x
            ev = np.concatenate([np.stack([self.block_start[sel], np.ones(sel.sum())], 1),
                                 np.stack([self.block_end[sel], -np.ones(sel.sum())], 1)])
            ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]     # ends before starts at equal times
            best = max(best, int(np.cumsum(ev[:, 1]).max()))
        return best


def run_engine(num_sms: int, cap: np.ndarray, need: np.ndarray, blk_cfg, blk_latency, blk_bytes,
               blk_compute, stream_ptr, stream_ready, stream_phase, num_phases: int,
               gap_ns, sm_bw: float, hbm_bw: float, blk_l2=None,
               l2_bw: float = np.inf, blk_lead=None, stream_gate=None,
               blk_weight=None, cfg_class=None, hits_queue: bool = False):
    """Typed front door to the Numba loop; raises ``ValueError`` when a block fits no SM.

    ``gap_ns``: the wait (ns) between the end of one phase and the start of the next, one
    value for every phase or float64 [num_phases] (entry ``p``: before phase ``p`` starts;
    entry 0 is unused).
    ``blk_l2``: float64 [N] bytes of each block that hit in L2 (``0 <= blk_l2 <= blk_bytes``;
    default none).  ``blk_lead``: float64 [N] of those, the bytes a block streams before the
    rest (``0 <= blk_lead <= blk_l2``; default 0); the rest streams as a fixed mix of HBM bytes
    and the remaining hits.  ``l2_bw``: bytes/ns the L2 serves to all SMs together.
    ``stream_gate``: int [S], for each launch an earlier launch of the same phase whose blocks
    must all have been placed before any of its own is (a programmatic dependent launch), or
    -1 (default: none).
    ``blk_weight``: float64 [N] > 0, each block's loads in flight (default 1 each): where the
    blocks of an SM or of the GPU compete for bandwidth, each gets a share in proportion to its
    weight.
    ``cfg_class``: int [configs], each config's class (0 or 1; -1: any): a block is not placed
    on an SM that holds a block of the other class (default: every config -1).
    """
    blk_bytes = np.ascontiguousarray(blk_bytes, dtype=np.float64)
    blk_l2 = (np.zeros(blk_bytes.shape[0]) if blk_l2 is None
              else np.ascontiguousarray(blk_l2, dtype=np.float64))
    if blk_l2.shape != blk_bytes.shape or np.any((blk_l2 < 0) | (blk_l2 > blk_bytes)):
        raise ValueError("blk_l2 must hold one value in [0, blk_bytes] per block")
    blk_lead = (np.zeros(blk_bytes.shape[0]) if blk_lead is None
                else np.ascontiguousarray(blk_lead, dtype=np.float64))
    if blk_lead.shape != blk_bytes.shape or np.any((blk_lead < 0) | (blk_lead > blk_l2)):
        raise ValueError("blk_lead must hold one value in [0, blk_l2] per block")
    if not l2_bw > 0:
        raise ValueError("l2_bw must be positive")
    cap = np.ascontiguousarray(cap, dtype=np.int64)
    need = np.ascontiguousarray(need, dtype=np.int64)
    if need.size and np.any(need > cap[None, :]):
        bad = int(np.flatnonzero(np.any(need > cap[None, :], axis=1))[0])
        raise ValueError(f"block config {bad} needs {need[bad].tolist()} (smem, registers, "
                         f"threads, slots) but an SM offers only {cap.tolist()}")
    if sm_bw <= 0 or hbm_bw <= 0:
        raise ValueError("bandwidths must be positive")
    S = len(stream_ready)
    gate = (np.full(S, -1, dtype=np.int32) if stream_gate is None
            else np.ascontiguousarray(stream_gate, dtype=np.int32))
    ph = np.asarray(stream_phase)
    if gate.shape != (S,) or np.any(gate >= np.arange(S)) or np.any(gate < -1) or \
            np.any((gate >= 0) & (ph[np.maximum(gate, 0)] != ph)):
        raise ValueError("stream_gate must name, per launch, -1 or an earlier launch of its phase")
    w = (np.ones(blk_bytes.shape[0]) if blk_weight is None
         else np.ascontiguousarray(blk_weight, dtype=np.float64))
    if w.shape != blk_bytes.shape or not np.all(w > 0):
        raise ValueError("blk_weight must hold one positive value per block")
    ncfg = need.shape[0]
    cls = (np.full(ncfg, -1, dtype=np.int64) if cfg_class is None
           else np.ascontiguousarray(cfg_class, dtype=np.int64))
    if cls.shape != (ncfg,) or np.any((cls < -1) | (cls > 1)):
        raise ValueError("cfg_class must hold one class (-1, 0 or 1) per block config")
    gaps = np.ascontiguousarray(np.broadcast_to(np.asarray(gap_ns, dtype=np.float64),
                                                (max(int(num_phases), 1),)))
    if np.any(gaps < 0):
        raise ValueError("gap_ns must be >= 0")
    out = _simulate(int(num_sms), cap, need, np.ascontiguousarray(blk_cfg, dtype=np.int32),
                    np.ascontiguousarray(blk_latency, dtype=np.float64),
                    blk_bytes, blk_l2, blk_lead,
                    np.ascontiguousarray(blk_compute, dtype=np.float64),
                    np.ascontiguousarray(stream_ptr, dtype=np.int64),
                    np.ascontiguousarray(stream_ready, dtype=np.float64),
                    np.ascontiguousarray(stream_phase, dtype=np.int32), gate,
                    int(num_phases),
                    gaps, float(sm_bw), float(hbm_bw), float(l2_bw), w, cls, bool(hits_queue))
    status = out[0]
    if status != 0:
        raise RuntimeError("timeline stalled: a block could not be placed on any SM")
    return out[1:]
