"""Graph-safe plans: one fixed device buffer that every later plan is written into.

A CUDA graph captured around ``run()`` replays the same launches with the same arguments every
time.  To stay correct while the batch changes, graph-safe mode fixes everything a launch's
arguments hold — buffer addresses, grid sizes, the set of kernels — and lets ``plan()`` change
only the *contents* of device memory:

* one launch per tile variant the planner can pick (:func:`reachable_tiles`), whether or not the
  current plan uses it, each with a fixed grid whose blocks pull work items until the live count
  (read from device memory) is reached;
* every Plan array at a fixed offset of one int32 buffer sized for the limits below;
* fp32 partial buffers sized for ``max_partials``;
* with ``max_num_qo_tokens`` (multi-token queries), each (CTA, query token) pair's causal limit
  and each CTA's causal flag (:meth:`pat_core.plan.Plan.token_view`), read by the multi-token
  kernel variants;
* a merge launch over a fixed grid that reads the live batch size from device memory.

This module is the pure-NumPy half (no CuPy): the limits, the buffer layout and the packing of a
Plan into it, shared by the CUDA backend and the CPU tests.

Buffer layout (int32; ``V`` variants, limits ``C`` CTAs, ``S`` partial rows, ``N`` query
tokens (``max_num_qo_tokens``, else ``max_batch_size``), ``P = max_num_pages + max_ctas`` page
entries; ``M = S`` and ``K = C`` with ``max_num_qo_tokens``, else 0)::

    live             [V, 2]   first CTA and CTA count of each variant's launch
    live_batch       [1]      query tokens of the batch (the merge kernel's rows)
    cta_req_indptr   [C + 1]
    cta_kv_start     [C]
    cta_kv_len       [C]
    cta_page_indptr  [C + 1]
    req_slot_indptr  [N + 1]
    cta_req          [S]
    cta_slot         [S]
    cta_kv_limit     [M]      multi-token layouts: each pair's causal limit
    cta_causal       [K]      multi-token layouts: each CTA's causal flag
    cta_pages        [P]      last, so a plan copies only up to its last page entry

The request tables are the plan's token view (:meth:`pat_core.plan.Plan.token_view`): every
query token a request of its own, ``cta_req`` its q row, ``cta_slot`` its partial row,
``req_slot_indptr`` each token's partial rows (with one token per request, the Plan's own
arrays).  CTAs are reordered so that each variant's CTAs are contiguous (a cascade plan
interleaves them by level); within a variant the Plan's order is kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .plan import Plan

MAX_VARIANTS = 64    # work counters one merge block zeroes (it has 128 threads)
FIELDS = ("live", "live_batch", "cta_req_indptr", "cta_kv_start", "cta_kv_len",
          "cta_page_indptr", "req_slot_indptr", "cta_req", "cta_slot", "cta_kv_limit",
          "cta_causal", "cta_pages")


@dataclass(frozen=True)
class StaticLimits:
    """Sizes a graph-safe wrapper allocates for once; a plan beyond any of them is refused.

    max_batch_size : requests per step.
    max_num_pages : bound on the block-table entries of a step (the sum over requests of
        ``ceil(seq_len / page_size)``); the plan's page list holds at most this plus one entry
        per CTA (a page cut by a split is listed by both parts).
    max_ctas : Plan CTAs (work items per KV head) per step.
    max_partials : partial result rows per step, ``Plan.num_partial_rows`` (one per (CTA,
        request) pair and query token of the request; ``Plan.num_slots`` with one token each).
    max_num_qo_tokens : query tokens per step (``Plan.num_qo_tokens``, the rows of ``q``), for
        multi-token queries (``qo_indptr``).  ``None`` (default): one token per request (a
        multi-token plan is refused); given, the layout also holds the causal limits and the
        launches run the multi-token kernel variants, for every step.
    """

    max_batch_size: int
    max_num_pages: int
    max_ctas: int
    max_partials: int
    max_num_qo_tokens: int | None = None

    def __post_init__(self):
        names = ("max_batch_size", "max_num_pages", "max_ctas", "max_partials") + \
            (("max_num_qo_tokens",) if self.max_num_qo_tokens is not None else ())
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
            if v > 2**30:
                raise ValueError(f"{name}={v} is too large (int32 device arrays)")
            object.__setattr__(self, name, int(v))
        if self.max_num_qo_tokens is not None and self.max_num_qo_tokens < self.max_batch_size:
            raise ValueError(f"max_num_qo_tokens={self.max_num_qo_tokens} is less than "
                             f"max_batch_size={self.max_batch_size} (every request has a token)")

    @classmethod
    def make(cls, max_batch_size, max_num_pages, max_ctas=None, max_partials=None,
             max_num_qo_tokens=None):
        """Limits with the documented defaults: ``max_ctas = 4 * max_batch_size + 256`` and
        ``max_partials = 4 * max_tokens + max_ctas`` (``max_tokens``: ``max_num_qo_tokens``,
        or ``max_batch_size`` without it)."""
        if max_batch_size is None or max_num_pages is None:
            raise ValueError("use_cuda_graph=True needs max_batch_size and max_num_pages")
        if max_ctas is None:
            max_ctas = 4 * int(max_batch_size) + 256
        if max_partials is None:
            tokens = max_num_qo_tokens if max_num_qo_tokens is not None else max_batch_size
            max_partials = 4 * int(tokens) + int(max_ctas)
        return cls(max_batch_size, max_num_pages, max_ctas, max_partials, max_num_qo_tokens)

    @property
    def multi_token(self) -> bool:
        """Sized for multi-token steps (``max_num_qo_tokens`` given)."""
        return self.max_num_qo_tokens is not None

    @property
    def max_tokens(self) -> int:
        """Query tokens (q rows) a step may hold: ``max_num_qo_tokens``, else one per
        request."""
        return self.max_num_qo_tokens if self.max_num_qo_tokens is not None \
            else self.max_batch_size

    @property
    def page_entries(self) -> int:
        return self.max_num_pages + self.max_ctas

    def max_cta_rows(self, group: int) -> int:
        """The most query rows one CTA can hold under these limits: every query token of the
        batch x the GQA ``group`` (the ``max_rows`` of :func:`reachable_tiles`)."""
        return self.max_tokens * int(group)


class StaticLayout:
    """Offsets of the Plan arrays in the fixed int32 buffer, for ``limits`` and ``tiles``.

    ``tiles`` is the fixed launch set: ``(m, n)`` pairs, launch ``v`` runs ``tiles[v]``.
    ``offset[name]`` / ``size[name]`` are in int32 elements; ``total`` is the buffer length.
    """

    def __init__(self, limits: StaticLimits, tiles):
        self.limits = limits
        self.tiles = tuple((int(m), int(n)) for m, n in tiles)
        self.tile_set = frozenset(self.tiles)
        if not self.tiles:
            raise ValueError("tiles: the launch set is empty")
        if len(set(self.tiles)) != len(self.tiles):
            raise ValueError(f"tiles: repeated entries in {self.tiles}")
        if len(self.tiles) > MAX_VARIANTS:     # the merge kernel's first block resets them
            raise ValueError(f"tiles: at most {MAX_VARIANTS} variants, got {len(self.tiles)}")
        N, C, S, P = limits.max_tokens, limits.max_ctas, limits.max_partials, \
            limits.page_entries
        mt = limits.multi_token
        self.size = {"live": 2 * len(self.tiles), "live_batch": 1, "cta_req_indptr": C + 1,
                     "cta_kv_start": C, "cta_kv_len": C, "cta_page_indptr": C + 1,
                     "req_slot_indptr": N + 1, "cta_req": S, "cta_slot": S,
                     "cta_kv_limit": S if mt else 0, "cta_causal": C if mt else 0,
                     "cta_pages": P}
        self.offset = {}
        at = 0
        for name in FIELDS:
            self.offset[name] = at
            at += self.size[name]
        self.total = at
        # what every pack() needs: the offsets in FIELDS order, each tile's launch index
        self._off = np.array([self.offset[f] for f in FIELDS], dtype=np.int64)
        self._vidx = {t: i for i, t in enumerate(self.tiles)}

    @property
    def num_variants(self) -> int:
        return len(self.tiles)

    def check(self, plan: Plan) -> None:
        """``ValueError`` naming the limit a plan exceeds (or the tile outside the launch set)."""
        lim = self.limits
        if plan.multi_token and not lim.multi_token:
            raise ValueError("the plan gives a request several query tokens (qo_indptr), but "
                             "this graph-safe wrapper was sized for one token per request; "
                             "create it with max_num_qo_tokens")
        checks = (("max_batch_size", plan.batch_size, "requests"),
                  ("max_num_qo_tokens" if lim.multi_token else "max_batch_size",
                   plan.num_qo_tokens, "query tokens"),
                  ("max_ctas", plan.num_ctas, "CTAs"),
                  ("max_partials", plan.num_partial_rows,
                   "partial result rows (CTA, request pairs x query tokens)"))
        for name, have, what in checks:
            if have > getattr(lim, "max_tokens" if name == "max_num_qo_tokens" else name):
                raise ValueError(f"the plan has {have} {what}, more than {name}="
                                 f"{getattr(lim, name)} of this graph-safe wrapper; create it "
                                 f"with a larger {name}")
        n_pages = int(plan.cta_pages.shape[0])
        if n_pages > lim.page_entries:
            raise ValueError(f"the plan lists {n_pages} page entries, more than max_num_pages + "
                             f"max_ctas = {lim.page_entries} of this graph-safe wrapper; create "
                             "it with a larger max_num_pages")
        for m, n in plan.tile_configs.tolist():
            if (m, n) not in self.tile_set:
                raise ValueError(f"the plan uses tile ({m}, {n}), which is not in the graph-safe "
                                 f"launch set {self.tiles}")

    def pack(self, plan: Plan, out: np.ndarray | None = None) -> np.ndarray:
        """The buffer's contents for ``plan``: int32 ``[n]`` with ``n <= total`` (everything up to
        the plan's last page entry; the rest of the buffer is never read for this plan), each
        array at its offset, the request tables those of the plan's token view, CTAs grouped by
        launch-set variant (stable), the unused tail of every array zeroed.  ``out``: int32 ``[>= n]`` to write into (pinned staging memory,
        say); the returned array is then ``out[:n]``."""
        self.check(plan)
        return self.pack_checked(plan, out)

    def pack_checked(self, plan: Plan, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`pack` of a plan that already passed :meth:`check` (the CUDA state checks
        before it waits for its staging memory, then packs)."""
        n = self.offset["cta_pages"] + plan.cta_pages.shape[0]
        if out is None:
            out = np.empty(n, dtype=np.int32)
        elif out.dtype != np.int32 or out.ndim != 1 or out.shape[0] < n:
            raise ValueError(f"out: expected int32 [>= {n}], got {out.dtype} {out.shape}")
        vidx = self._vidx
        tile_v = np.array([vidx[(m, n_)] for m, n_ in plan.tile_configs.tolist()],
                          dtype=np.int64)
        causal = self.limits.multi_token
        if plan.multi_token or causal:
            tv = plan.token_view()
            req = (tv.cta_req_indptr, tv.cta_req, tv.cta_slot, tv.req_slot_indptr,
                   tv.cta_kv_limit, tv.cta_causal)
        else:                              # the token view would be the plan's own arrays
            req = (plan.cta_req_indptr, plan.cta_req, plan.cta_slot, plan.req_slot_indptr,
                   _NONE, _NONE)           # (the causal arrays are not written)
        _pack_nb(out, self._off, tile_v, self.num_variants, int(plan.num_qo_tokens),
                 plan.cta_tile, req[0], req[1], req[2], plan.cta_kv_start, plan.cta_kv_len,
                 plan.cta_page_indptr, plan.cta_pages, req[3], req[4], req[5], causal)
        return out[:n]

    def unpack(self, buf: np.ndarray) -> dict:
        """The live arrays back out of a packed buffer (for tests and debugging);
        ``batch_size`` is the live query tokens (the batch with one token per request), the
        request tables the token view's, ``cta_kv_limit`` / ``cta_causal`` empty unless the
        layout is multi-token."""
        live = buf[self.offset["live"]:self.offset["live"] + 2 * self.num_variants]
        live = live.reshape(-1, 2)
        C = int(live[:, 1].sum())
        B = int(buf[self.offset["live_batch"]])

        def seg(name, n):
            o = self.offset[name]
            return buf[o:o + n].copy()

        req_ptr = seg("cta_req_indptr", C + 1)
        page_ptr = seg("cta_page_indptr", C + 1)
        mt = self.limits.multi_token
        causal = {"cta_kv_limit": seg("cta_kv_limit", int(req_ptr[-1]) if mt else 0),
                  "cta_causal": seg("cta_causal", C if mt else 0)}
        return {"live": live.copy(), "batch_size": B, "cta_req_indptr": req_ptr, **causal,
                "cta_kv_start": seg("cta_kv_start", C), "cta_kv_len": seg("cta_kv_len", C),
                "cta_page_indptr": page_ptr, "req_slot_indptr": seg("req_slot_indptr", B + 1),
                "cta_req": seg("cta_req", int(req_ptr[-1])),
                "cta_slot": seg("cta_slot", int(req_ptr[-1])),
                "cta_pages": seg("cta_pages", int(page_ptr[-1]))}


_NONE = np.zeros(0, dtype=np.int32)


@njit(cache=True, nogil=True)
def _pack_nb(out, off, tile_v, nvar, batch, cta_tile, cta_req_indptr, cta_req, cta_slot,
             cta_kv_start, cta_kv_len, cta_page_indptr, cta_pages, req_slot_indptr,
             cta_kv_limit, cta_causal, causal):
    """:meth:`StaticLayout.pack` into ``out`` in one pass; ``off``: int64 ``[12]``, the offsets
    of :data:`FIELDS` in order; ``batch``: the query tokens; the request tables (int32
    ``cta_req_indptr [C + 1]``, ``cta_req`` / ``cta_slot`` / ``cta_kv_limit [T]``,
    ``req_slot_indptr [batch + 1]``, ``cta_causal [C]``) are a token view's.  ``causal``: the
    layout holds ``cta_kv_limit`` / ``cta_causal`` (else they are not written).  Every element
    from 0 to the last page entry is written."""
    o_live, o_lb, o_rip, o_kvs, o_kvl, o_pip, o_rsi, o_req, o_slot, o_lim, o_caus, o_pages = \
        off[0], off[1], off[2], off[3], off[4], off[5], off[6], off[7], off[8], off[9], \
        off[10], off[11]
    C = cta_tile.shape[0]
    counts = np.zeros(nvar, dtype=np.int64)
    for c in range(C):
        counts[tile_v[cta_tile[c]]] += 1
    nxt = np.empty(nvar, dtype=np.int64)
    s = 0
    for v in range(nvar):
        nxt[v] = s
        out[o_live + 2 * v] = s
        out[o_live + 2 * v + 1] = counts[v]
        s += counts[v]
    order = np.empty(C, dtype=np.int64)          # CTAs grouped by variant, stable
    for c in range(C):
        v = tile_v[cta_tile[c]]
        order[nxt[v]] = c
        nxt[v] += 1
    out[o_lb] = batch
    out[o_rip] = 0
    out[o_pip] = 0
    r = 0
    pg = 0
    for i in range(C):
        c = order[i]
        out[o_kvs + i] = cta_kv_start[c]
        out[o_kvl + i] = cta_kv_len[c]
        if causal:
            out[o_caus + i] = cta_causal[c]
        for k in range(cta_req_indptr[c], cta_req_indptr[c + 1]):
            out[o_req + r] = cta_req[k]
            out[o_slot + r] = cta_slot[k]
            if causal:
                out[o_lim + r] = cta_kv_limit[k]
            r += 1
        out[o_rip + i + 1] = r
        p0, p1 = cta_page_indptr[c], cta_page_indptr[c + 1]
        out[o_pages + pg:o_pages + pg + p1 - p0] = cta_pages[p0:p1]      # one block copy
        pg += p1 - p0
        out[o_pip + i + 1] = pg
    nb = req_slot_indptr.shape[0]
    for b in range(nb):
        out[o_rsi + b] = req_slot_indptr[b]
    # the unused tail of every array up to the page list (never read; zeroed, not stale)
    nl = r if causal else 0
    nc = C if causal else 0
    ends = np.array([o_live + 2 * nvar, o_lb + 1, o_rip + C + 1, o_kvs + C, o_kvl + C,
                     o_pip + C + 1, o_rsi + nb, o_req + r, o_slot + r, o_lim + nl, o_caus + nc])
    for j in range(11):
        for x in range(ends[j], off[j + 1]):
            out[x] = 0
    return o_pages + pg


def reachable_tiles(selector, kv_tile_table=None, max_rows=None) -> tuple:
    """Every ``(m, n)`` the tile selector can give a CTA: for each feasible ``m``, the ``n`` it
    picks in each bucket of the KV-length table (and of its busy-step table, unless
    ``kv_tile_table`` replaces the selector's).  With ``max_rows`` (the most query rows a CTA
    can hold: ``max_batch_size x`` the GQA group), only the ``m`` up to the smallest one that
    holds ``max_rows`` (the selector never gives a CTA a larger tile).  Every launch of the set
    costs a graph replay ~1-2 us even when it has no work (bench/NOTES.md), so a graph captured
    for a small batch bucket should not carry the 128-row tiles.  Sorted by ``m`` descending
    (the largest tiles, usually the longest CTAs, are launched first), then ``n`` descending."""
    ms = [int(m) for m in selector.m_values]
    if max_rows is not None:
        if int(max_rows) < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        top = next((m for m in ms if m >= int(max_rows)), ms[-1])
        ms = [m for m in ms if m <= top]
    # the selector's busy-step table too, where it has one (TileSelector.for_step)
    sels = (selector,) if kv_tile_table or selector.busy is None else (selector, selector.busy)
    out = set()
    for sel in sels:
        for max_len, _ in tuple(kv_tile_table or sel.gpu.kv_tile_table):
            for m in ms:
                out.add((m, int(sel.pick_n(m, int(min(max_len, 1 << 30))))))
    return order_tiles(out)


def order_tiles(tiles) -> tuple:
    """``(m, n)`` tiles in launch-set order: ``m`` descending, then ``n`` descending."""
    return tuple(sorted({(int(m), int(n)) for m, n in tiles}, key=lambda t: (-t[0], -t[1])))


# KV-length table of a graph-safe wrapper whose CTAs all fit one 16-row tile: one n.
ONE_N_TABLE = ((1 << 62, 64),)
ONE_N_MAX_ROWS = 16
# KV-length table of a graph-safe bucket that runs as one fused pull launch: one n.
FUSED_TILE_TABLE = ONE_N_TABLE
# KV-length table and left-out tiles of the other graph-safe buckets at head_dim <= 128: the
# 32-token width for CTAs of at most 16 rows and at most 96 tokens (the leaves of wide trees),
# 64 tokens for everything else: five tiles where the GPU's table reaches eleven or twelve.
LEAN_TILE_TABLE = ((96, 32), (1 << 62, 64))
LEAN_EXCLUDED_TILES = tuple((m, n) for m in (32, 64, 128) for n in (16, 32))
LEAN_MAX_HEAD_DIM = 128


def graph_safe_tile_table(limits: StaticLimits, group: int, fused: bool = False,
                          head_dim: int = 128):
    """The KV-length -> ``n`` table a graph-safe wrapper plans with, and the tiles it leaves
    out: ``(table, exclude)``, ``(None, None)`` for the GPU's table.

    Every launch of a graph-safe set runs on every replay, and one that has no work still
    costs about a microsecond (H100 and H200, bench/NOTES.md), so the sets want few tiles.

    ``fused``: whether the bucket's launch set, with the GPU's table, would run as one fused
    pull launch (:func:`graph_safe_fused`).  Such a bucket plans with :data:`FUSED_TILE_TABLE`
    (one ``n``, 64): the fused kernel carries every tile of the set, and its time grows with
    their number beyond what residency explains (H100, ``bench/lab/graph_safe_cost.py``: same
    grid, occupancy and instruction count, 14.3 against 21.5 us for two against eight
    variants, with 54% of warp cycles stalled on instruction fetch against 35%), so the GPU's
    three ``n`` per ``m`` (eight tiles at 32:8) become one per ``m`` (three, after
    :func:`fused_pull_exclusions` swaps ``(32, 64)``, one block per SM, for ``(32, 32)``).
    Measured on 12- and 16-request steps at 32:8 and 64:8 (bench/NOTES.md):
    0.88-1.08x the step's exact plan, against 0.88-1.19x with two ``n`` per ``m``
    and 1.06-1.26x with the GPU's table.

    When every CTA fits one 16-row tile (``limits.max_cta_rows(group) <= 16``: at most four
    requests at GQA group 4, sixteen at group 1), the default table still gives three launches
    (n = 16, 32, 64), each costing a replay ~1-2 us when empty, where the exact plan usually
    has one.  A single ``n = 64`` makes that one launch; the short CTAs it then covers do a
    few masked MMA steps more, which costs less than the launches on such small steps
    (H100, ``bench/lab/graph_safe_cost.py --compact inf:64``: a 12k-token single request at 32:8
    39.3 -> 36.0 us against 33.3 for its exact plan; bench/NOTES.md).

    Every other bucket at ``head_dim <= 128`` plans with :data:`LEAN_TILE_TABLE` without
    :data:`LEAN_EXCLUDED_TILES`: ``n = 64`` for every CTA but those of at most 16 rows and 96
    tokens, which take ``n = 32``.  One width alone loses on wide trees of short leaves (their
    16-row leaf CTAs then hold a 4-warp block where two 2-warp blocks fit: ``64,512_512,64``
    and ``1,4,16,64,256_512,256,128,64,32`` at 32:8 on an H100 1.22x and 1.26x the exact plan,
    against 1.10x and 1.14x with the GPU's table); keeping the 32-token width for 16-row
    CTAs only keeps those leaves at their residency and drops six launches.  Measured on the
    development set (H200, bench/NOTES.md), bucket graphs over the plain launches in geometric
    mean: chat steps 1.037 -> 1.018, agent steps 1.021 -> 1.003, synthetic batches 1.114 ->
    1.061 (32:8), 1.021 -> 0.996 (32:32), fp8 1.141 -> 1.071, head_dim 64 1.164 -> 1.060.
    ``head_dim`` 256 keeps the GPU's tables: there the lean table gains on the agent steps but
    undoes the busy steps' narrow table (``32,256_1024,128`` 1.10x -> 1.26x the exact plan)."""
    if limits.max_cta_rows(group) <= ONE_N_MAX_ROWS:
        return ONE_N_TABLE, None
    if fused:
        return FUSED_TILE_TABLE, None
    if int(head_dim) <= LEAN_MAX_HEAD_DIM:
        return LEAN_TILE_TABLE, LEAN_EXCLUDED_TILES
    return None, None


GRAPH_FUSED_MODES = ("auto", "on", "off")
FUSED_MAX_BATCH = 16


def graph_safe_fused(limits: StaticLimits, num_tiles: int, mode: str = "auto") -> bool:
    """Whether a graph-safe launch set of ``num_tiles`` tiles runs as one fused pull launch.

    ``mode``: ``"on"``, ``"off"`` or ``"auto"``: fused when the bucket holds at most
    :data:`FUSED_MAX_BATCH` requests.  A fused launch replaces one launch per tile (each costing
    a replay ~1 us even when empty, and their join ~2 us more) with one, but every block gets
    the largest tile's size, so it holds fewer blocks per SM: it pays when a step has few work
    items.  Measured on the H100 (``bench/lab/graph_safe_cost.py``, bench/NOTES.md): with
    buckets of 12 and 16 requests, fused beat one launch per tile on 5 of 6 steps (by up to
    20%; the one loss 5%, 1024-token leaves at 32:8); steps of 64 requests lost 25-95%.  One
    tile needs no fusing."""
    if mode not in GRAPH_FUSED_MODES:
        raise ValueError(f"graph_fused must be one of {GRAPH_FUSED_MODES}, got {mode!r}")
    if num_tiles <= 1 or mode == "off":
        return False
    return mode == "on" or limits.max_batch_size <= FUSED_MAX_BATCH


FUSED_MIN_BLOCKS_PER_SM = 2


def fused_pull_exclusions(tiles, head_dim: int, dtype: str, gpu, feasible=None) -> tuple:
    """Tiles a fused pull launch set leaves out, so that its block stays small.

    The fused block takes the largest threads, registers and shared memory of its tiles, so one
    tile that alone fits fewer than :data:`FUSED_MIN_BLOCKS_PER_SM` blocks per SM makes every
    item run at that residency.  At head_dim 128 on the H100 that tile is ``(32, 64)``
    (256 threads, 104 KB: one block per SM); without it the bucket's block holds two.  A tile
    is left out only while another tile of its ``m`` that fits two blocks per SM remains, in
    ``tiles`` or, given ``feasible``, among the tile selector's feasible tiles (its CTAs then
    take a narrower ``n`` rather than a larger ``m``; the selector picks that ``n``).
    Measured (H100, 32:8, the GPU's KV tile table, graph µs, ``bench/lab/graph_safe_cost.py``;
    bench/NOTES.md): 16-request steps of many items gain (1024-token leaves 56.8 ->
    47.6, a 2048-token root 27.0 -> 24.0); a 12-request step whose items all fit the grid does
    not (18.0 -> 18.9).

    ``tiles``: ``(m, n)`` pairs (a launch set, :func:`reachable_tiles`); ``feasible``: more
    ``(m, n)`` pairs a left-out tile's CTAs may take instead (``TileSelector.feasible``).
    Returns the pairs to exclude, in ``tiles``' order (empty when none).
    """
    from .gpus import get_gpu
    gpu = get_gpu(gpu)
    tiles = [(int(m), int(n)) for m, n in tiles]
    cand = list(dict.fromkeys(tiles + [(int(m), int(n)) for m, n in (feasible or ())]))
    low = {t for t, res in zip(cand, _resources(cand, head_dim, dtype, gpu))
           if res.ctas_per_sm(gpu) < FUSED_MIN_BLOCKS_PER_SM}
    out = []
    for m, n in tiles:
        if (m, n) in low and any(mm == m and (mm, nn) not in low for mm, nn in cand):
            out.append((m, n))
    return tuple(out)


def _resources(tiles, head_dim, dtype, gpu) -> list:
    from .tiles import tile_resources
    return [tile_resources(m, n, head_dim, dtype, gpu) for m, n in tiles]


def fused_block_per_sm(tiles, head_dim: int, dtype: str, gpu) -> int:
    """Blocks of a fused launch of ``tiles`` one SM holds: the block takes the most threads,
    registers and shared memory any of its tiles needs."""
    from .gpus import get_gpu
    from .tiles import TileResources
    gpu = get_gpu(gpu)
    rs = _resources(tiles, head_dim, dtype, gpu)
    block = TileResources(m=0, n=0, threads=max(r.threads for r in rs),
                          registers=max(r.registers for r in rs), smem=max(r.smem for r in rs),
                          source="fused")
    return block.ctas_per_sm(gpu)


def fused_pull_max_rows(tiles, head_dim: int, dtype: str, gpu):
    """Row cap for a fused pull launch set whose block still fits fewer than
    :data:`FUSED_MIN_BLOCKS_PER_SM` per SM after :func:`fused_pull_exclusions`.

    The block takes each resource's maximum over the tiles, so two tiles that each fit two
    blocks per SM can together fit one (head_dim 128 on the H100: the 128-row tiles' 256
    threads with a 16-row tile's 206 registers per thread, in a 16-request bucket at 64:8).
    The cap drops the largest ``m`` until the block fits two (CTAs of more rows are split, the
    second reading the shared KV mostly from L2).  Measured (H100, 64:8, graph µs,
    ``bench/lab/graph_safe_cost.py --lean-max-rows 64``; bench/NOTES.md): a 16-request
    tree of 1024-token leaves 54.6 -> 47.2 (its exact plan 46.8); the 12- and 16-request steps
    without long leaves within noise (15.2 -> 14.6, 26.7 -> 27.0).

    ``tiles``: ``(m, n)`` pairs (the launch set after the exclusions).  Returns the cap (an
    ``m``), or ``None`` when the block already fits or one ``m`` is left.
    """
    tiles = [(int(m), int(n)) for m, n in tiles]
    ms = sorted({m for m, _ in tiles})
    cap = None
    while len(ms) > 1 and fused_block_per_sm(tiles, head_dim, dtype, gpu) \
            < FUSED_MIN_BLOCKS_PER_SM:
        cap = ms[-2]
        ms = ms[:-1]
        tiles = [t for t in tiles if t[0] <= cap]
    return cap


def graph_safe_max_rows(limits: StaticLimits, group: int, cap=None) -> int:
    """Most query rows a CTA of a graph-safe plan can hold: the limits' (every query token x
    the GQA ``group``) under a planner row cap ``cap`` (``Tuning.max_rows``), as
    :meth:`pat_core.planner.Planner.plan` applies it."""
    rows = limits.max_cta_rows(group)
    return rows if cap is None else min(rows, max(int(group), int(cap)))


def graph_safe_tuning(gpu, tuning, limits: StaticLimits, group: int, head_dim: int,
                      kv_dtype: str, mode: str = "auto", tile=None) -> dict:
    """The planner tuning fields a graph-safe wrapper with ``limits`` sets before its first
    plan, where ``tuning`` (a :class:`~pat_core.tuning.Tuning`) leaves them unset: the short
    parts of small merging plans off (``merge_min_part = min_part``: the limits are sized for
    the coarse parts), the KV tile table and the tiles it leaves out
    (:func:`graph_safe_tile_table`: one width when every CTA fits a 16-row tile or the bucket
    runs as one fused pull launch, else at head_dim <= 128 the lean table) and, for a fused
    bucket, the tiles left out and the row cap that keep its block at two per SM
    (:func:`fused_pull_exclusions`, :func:`fused_pull_max_rows`).  ``gpu``: the planner's
    :class:`~pat_core.gpus.GPUSpec`; ``mode``: the backend's ``graph_fused``; ``tile``: a forced tile (never fused).  Returns
    ``{field: value}`` (empty when nothing changes); each decision sees the ones before it."""
    import dataclasses
    from .planner import tile_selector_for
    auto = {}

    def selector():
        return tile_selector_for(gpu, dataclasses.replace(tuning, **auto), head_dim, kv_dtype)

    def tiles_now() -> tuple:
        cap = auto.get("max_rows", tuning.max_rows)
        return reachable_tiles(selector(), max_rows=graph_safe_max_rows(limits, group, cap))

    def fused_now() -> bool:
        return tile is None and graph_safe_fused(limits, len(tiles_now()), mode)

    if tuning.merge_min_part is None:
        # the limits' defaults (max_ctas, max_partials) are sized for min_part's parts
        auto["merge_min_part"] = int(tuning.min_part)
    if tuning.kv_tile_table is None:
        table, exclude = graph_safe_tile_table(limits, group, fused_now(), head_dim)
        if table is not None:
            auto["kv_tile_table"] = table
        if exclude is not None and tuning.exclude_tiles is None and tile is None:
            auto["exclude_tiles"] = exclude     # (a forced tile reads no exclusions)
    if not fused_now():
        return auto
    if tuning.exclude_tiles is None:
        ex = fused_pull_exclusions(tiles_now(), head_dim, kv_dtype, gpu,
                                   feasible=selector().feasible)
        if ex:
            auto["exclude_tiles"] = ex
    if tuning.max_rows is None:
        cap = fused_pull_max_rows(tiles_now(), head_dim, kv_dtype, gpu)
        if cap is not None and cap >= group:
            auto["max_rows"] = cap
    return auto


def graph_safe_launch_set(gpu, tuning, limits: StaticLimits, group: int, head_dim: int,
                          kv_dtype: str, mode: str = "auto", tile=None) -> tuple:
    """``(tiles, fused)``: the fixed launch set of a graph-safe wrapper whose planner has
    ``gpu`` and ``tuning`` (after :func:`graph_safe_tuning`): every tile its selector can give
    a CTA of at most :func:`graph_safe_max_rows` rows (or the forced ``tile``), and whether
    they run as one fused pull launch (:func:`graph_safe_fused` under ``mode``).  What
    ``sim.simulate(..., launch_set=)`` takes."""
    from .planner import tile_selector_for
    sel = tile_selector_for(gpu, tuning, head_dim, kv_dtype, tile)
    tiles = reachable_tiles(sel, max_rows=graph_safe_max_rows(limits, group, tuning.max_rows))
    return tiles, graph_safe_fused(limits, len(tiles), mode)


__all__ = ["FUSED_TILE_TABLE", "LEAN_EXCLUDED_TILES", "LEAN_TILE_TABLE", "StaticLayout",
           "StaticLimits", "fused_block_per_sm", "fused_pull_exclusions", "fused_pull_max_rows", "graph_safe_fused",
           "graph_safe_launch_set", "graph_safe_max_rows", "graph_safe_tile_table",
           "graph_safe_tuning", "reachable_tiles"]
