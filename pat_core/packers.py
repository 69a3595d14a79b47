"""Packers: turn a :class:`~pat_core.forest.PrefixForest` into CTAs ("packs").

A *pack* is a set of requests plus a token range ``[kv_start, kv_end)`` they all share; the
kernel reads that range once for all of them.  Every packer produces the same :class:`Packs`
type, and every (request, token) pair lands in exactly one pack.

All five packers are one walk, TreeHeuristic (PAT Algorithm 1), with a different rule for the
one question it asks at every parent ``u`` / child ``c`` edge: *merge* (``c``'s CTA also reads the
tokens accumulated down to ``u``, and ``c``'s requests leave ``u``'s CTA) or *split* (``u``'s CTA
keeps ``c``'s requests; each of them gets one more partial result to merge).

``pat``      memory-centric profit model (PAT §5.1), in bytes, GQA-aware: merge when the partial
             traffic saved (weighted by ``PARTIAL_WEIGHT``, below) beats the KV re-read,
             counting one re-read per CTA the child's rows need (rows = requests x group,
             capped by the largest tile).
``compute``  compute-oriented model (as FastTree): minimise padded tile rows x KV tokens,
             ignoring bytes; merges a child when taking its rows out of the parent's CTA drops
             that CTA to a smaller tile by more than the child's own padded tile costs.
``node``     never merge: one CTA per tree node holding every request below it.
``cascade``  ``node`` packing, its groups one per tree level and tile (multi-level cascade
             inference; a ``serial`` plan, launched as any other).
``query``    always merge, one request per CTA: the query-centric baseline.

A CTA never holds more requests than ``max_rows // group`` (the largest tile's rows): larger
sets are cut into chunks, each re-reading the range.  With multi-token queries a request counts
``q_len x group`` rows (every rule above prices rows, so a shared range is read once for every
token below it), and a chunk holds requests while their rows fit ``max_rows``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .forest import PrefixForest

PACKERS = ("pat", "query", "node", "compute", "cascade")

# Weight of the partial-result side of the ``pat`` profit model.  A partial costs more than its
# bytes: its rows hold a thread block's fixed latency (Q load, pipeline start, partial write)
# and the merge reads it back after the forward pass.  Measured on an H100 over nine
# multi-level sharing batches (``bench/lab/kernel_lab.py --cases planner``; bench/NOTES.md),
# weights 1 / 2 / 3 / 4 / 6 gave a geometric-mean step time of 0.87 / 0.85 / 0.84 / 0.79 / 0.80
# of the unweighted model's (all with the "work" launch order).  1 is the PAT paper's pure byte count.
PARTIAL_WEIGHT = 4.0

_MODE = {"pat": 0, "compute": 1, "node": 2, "cascade": 2, "query": 3}


@dataclass
class Packs:
    """CTAs before tiling and splitting (``K`` packs; all int32).

    ``req_indptr [K+1]`` / ``reqs``: requests of each pack.  ``kv_start, kv_end [K]``: token
    range.  ``level [K]``: forest level of the node that emitted the pack (for cascade groups).
    ``leaf_pack [B]``: the pack holding each request's last token when that pack holds only
    this request and the request has a leaf node of its own, else ``-1`` (the lazy length
    update may extend exactly those packs).  ``rows [K]`` (int64, or ``None`` with one query
    token per request, when a pack's rows are its requests x the GQA group): each pack's query
    rows, its requests' ``q_len x group`` summed.
    """

    req_indptr: np.ndarray
    reqs: np.ndarray
    kv_start: np.ndarray
    kv_end: np.ndarray
    level: np.ndarray
    leaf_pack: np.ndarray
    rows: np.ndarray | None = None

    @property
    def num_packs(self) -> int:
        return int(self.kv_start.shape[0])

    def copy(self) -> "Packs":
        return Packs(*(getattr(self, f).copy() for f in
                       ("req_indptr", "reqs", "kv_start", "kv_end", "level", "leaf_pack")),
                     rows=None if self.rows is None else self.rows.copy())

    def pack_rows(self, group: int) -> np.ndarray:
        """Query rows of every pack, int64 ``[K]`` (requests x ``group`` without ``rows``)."""
        if self.rows is not None:
            return self.rows
        return np.diff(self.req_indptr).astype(np.int64) * group


@njit(cache=True, nogil=True)
def _pad_rows(rows, max_rows):
    """Rows after padding to power-of-two tiles of at least 16 (full tiles of ``max_rows``)."""
    if rows <= 0:
        return 0
    full = (rows // max_rows) * max_rows
    rest = rows - full
    if rest == 0:
        return full
    p = 16
    while p < rest:
        p *= 2
    return full + p


@njit(cache=True, nogil=True)
def _tree_heuristic(start, end, lo, hi, child_indptr, children, order, level,
                    req_node, mode, rpre, max_rows, max_req, kv_tok_bytes, row_slot_bytes):
    """TreeHeuristic over every tree of the forest (iterative DFS).  See module docstring.
    ``rpre``: int64 ``[B + 1]``, query rows of the requests in sorted order, prefix-summed (a
    node's rows are ``rpre[hi] - rpre[lo]``); a CTA holds at most ``max_rows`` rows and
    ``max_req`` requests.  Returns ``(req_indptr, reqs, kv_start, kv_end, level, leaf_pack)``
    (int32; ``[K + 1]``, ``[R]``, ``[K]`` x 3, ``[B]``)."""
    B = order.shape[0]
    n = start.shape[0]
    cap_p = 2 * n + 16
    cap_r = 4 * B + 16
    np_, nr, p_ind, p_s, p_e, p_lv, p_r = _tree_walk(
        start, end, lo, hi, child_indptr, children, order, level, mode, rpre, max_rows,
        max_req, kv_tok_bytes, row_slot_bytes, cap_p, cap_r)
    if np_ > cap_p or nr > cap_r:
        # the buffers were short (the walk counted on without writing): once more, to size
        np_, nr, p_ind, p_s, p_e, p_lv, p_r = _tree_walk(
            start, end, lo, hi, child_indptr, children, order, level, mode, rpre, max_rows,
            max_req, kv_tok_bytes, row_slot_bytes, np_, nr)
    # leaf_pack: a single-request pack that ends at the request's own leaf
    leaf_pack = np.full(B, -1, dtype=np.int32)
    for p in range(np_):
        if p_ind[p + 1] - p_ind[p] == 1:
            r = p_r[p_ind[p]]
            u = req_node[r]
            if p_e[p] == end[u] and hi[u] - lo[u] == 1:
                leaf_pack[r] = p
    return (p_ind[:np_ + 1].astype(np.int32), p_r[:nr].copy(), p_s[:np_].copy(),
            p_e[:np_].copy(), p_lv[:np_].copy(), leaf_pack)


@njit(cache=True, nogil=True)
def _tree_walk(start, end, lo, hi, child_indptr, children, order, level, mode, rpre, max_rows,
               max_req, kv_tok_bytes, row_slot_bytes, cap_p, cap_r):
    """:func:`_tree_heuristic`'s walk into buffers of ``cap_p`` packs and ``cap_r`` request
    entries.  Returns ``(packs, entries, p_ind, p_s, p_e, p_lv, p_r)``; where the packing
    needs more than the buffers hold, the walk goes on counting without writing and the
    counts say how much (the caller walks again with those sizes).  The buffers are never
    replaced inside the walk: a reassigned array in the loop costs the compiled code about
    three times the walk's time."""
    B = order.shape[0]
    n = start.shape[0]
    p_ind = np.empty(cap_p + 1, dtype=np.int64)
    p_ind[0] = 0
    p_s = np.empty(cap_p, dtype=np.int32)
    p_e = np.empty(cap_p, dtype=np.int32)
    p_lv = np.empty(cap_p, dtype=np.int32)
    p_r = np.empty(cap_r, dtype=np.int32)
    np_ = 0
    nr = 0
    rem = np.zeros(B, dtype=np.int32)       # sorted positions of the current node's pack
    st_node = np.zeros(n, dtype=np.int32)
    st_acc = np.zeros(n, dtype=np.int32)
    sp = 0
    for k in range(child_indptr[1] - child_indptr[0]):   # every root starts its own walk
        st_node[sp] = children[child_indptr[0] + k]
        st_acc[sp] = start[children[child_indptr[0] + k]]
        sp += 1
    while sp > 0:
        sp -= 1
        u = st_node[sp]
        acc = st_acc[sp]
        L = end[u] - acc                    # tokens this node's CTA reads (own + inherited)
        nrem = 0
        pos = lo[u]
        # compute model: rows u's CTA would hold if every child split; shrinks as children merge
        rows_u = rpre[hi[u]] - rpre[lo[u]]
        pos = lo[u]
        for k in range(child_indptr[u], child_indptr[u + 1]):
            c = children[k]
            while pos < lo[c]:
                rem[nrem] = pos
                nrem += 1
                pos += 1
            rows_c = rpre[hi[c]] - rpre[lo[c]]
            if mode == 0:       # pat: bytes of partials saved vs bytes of KV re-read
                chunks = (rows_c + max_rows - 1) // max_rows
                merge = rows_c * row_slot_bytes > L * kv_tok_bytes * chunks
            elif mode == 1:     # compute: padded rows x L with and without c in u's CTA
                merge = (_pad_rows(rows_u - rows_c, max_rows) + _pad_rows(rows_c, max_rows)
                         < _pad_rows(rows_u, max_rows))
            elif mode == 2:
                merge = False
            else:
                merge = True
            st_node[sp] = c
            if merge:
                st_acc[sp] = acc
                rows_u -= rows_c
            else:
                st_acc[sp] = start[c]
                for q in range(lo[c], hi[c]):
                    rem[nrem] = q
                    nrem += 1
            sp += 1
            pos = hi[c]
        while pos < hi[u]:
            rem[nrem] = pos
            nrem += 1
            pos += 1
        # emit the node's pack, cut into chunks of at most max_req requests and max_rows rows
        # (always one request at least: the caller checked each request's rows fit)
        q0 = 0
        while q0 < nrem:
            q1 = q0 + 1
            used = rpre[rem[q0] + 1] - rpre[rem[q0]]
            while q1 < nrem and q1 - q0 < max_req:
                r_rows = rpre[rem[q1] + 1] - rpre[rem[q1]]
                if used + r_rows > max_rows:
                    break
                used += r_rows
                q1 += 1
            if np_ < cap_p and nr + (q1 - q0) <= cap_r:
                for q in range(q0, q1):
                    p_r[nr] = order[rem[q]]
                    nr += 1
                p_s[np_] = acc
                p_e[np_] = end[u]
                p_lv[np_] = level[u]
                p_ind[np_ + 1] = nr
            else:
                nr += q1 - q0                # short buffers: count only
            np_ += 1
            q0 = q1
    return np_, nr, p_ind, p_s, p_e, p_lv, p_r


def cost_constants(head_dim: int, kv_bytes: int, q_bytes: int) -> tuple[int, int]:
    """``(kv_tok_bytes, row_slot_bytes)`` of the profit model, per KV head.

    * ``kv_tok_bytes``: one token of K and V for one KV head: ``2 * head_dim * kv_bytes``.
    * ``row_slot_bytes``: what one extra partial result costs one query row: an fp32 output
      and LSE written then read back (``2 * 4 * (head_dim + 1)``), plus re-reading its query
      (``head_dim * q_bytes``).  Merge a child when ``rows * row_slot_bytes`` exceeds the
      re-read tokens times ``kv_tok_bytes`` (for fp16, d = 128, group 1: ``2.5 s > l``; the
      paper's element count gives ``4 s > l``).
    """
    return 2 * head_dim * kv_bytes, 8 * (head_dim + 1) + head_dim * q_bytes


# The narrow-packing rule (:func:`narrow_packing`): the most extra KV tokens, as a share of the
# packing's own, that packing every CTA into the narrowest tile may re-read.
NARROW_SHARE = 0.02


def narrow_packing(forest: PrefixForest, packs: Packs, group: int, narrow_rows: int,
                   share: float, head_dim: int, kv_bytes: int = 2, q_bytes: int = 2,
                   partial_weight: float = PARTIAL_WEIGHT, q_lens=None):
    """``(packs', tokens)``: ``packs`` (a ``pat`` packing), or ``forest`` packed again with at
    most ``narrow_rows`` query rows per CTA when some pack is wider and the narrow packing
    reads at most ``share`` more KV tokens than ``packs`` (:func:`narrow_wins`, tokens
    counted as ``sum(kv_end - kv_start)``).  ``tokens``: ``(wide, narrow)``, the two packings'
    KV tokens, or ``None`` when no pack is wider than ``narrow_rows`` (or ``share`` is 0, or a
    request's rows exceed ``narrow_rows``).  Growing leaves add the same tokens to both
    packings, so the lazy length update re-checks the choice from ``tokens`` alone.
    ``q_lens``: int ``[B]`` query tokens per request, as :func:`pack`'s.

    Why: on a batch of long private leaves under a short shared prefix (a system prompt), the
    few wide CTAs of the prefix run as a second tile variant, in a launch of their own whose
    blocks the GPU dispatches first; they hold the SMs while the leaves wait (an H100 timeline:
    the leaves' kernel started 8 µs into a 389 µs step) and save almost nothing.  Packed
    narrow, every CTA has the leaves' tile height, so the step runs one variant (where the KV
    widths agree) in one launch, and the prefix is re-read from L2 by a few more CTAs.  Where
    sharing saves much (a wide root over short leaves) the narrow packing re-reads far more
    than ``share`` and ``packs`` stays.  Measured in ``bench/NOTES.md`` ;
    ``share = 0`` turns the rule off.
    """
    rows = packs.pack_rows(group)
    one = group if q_lens is None else group * int(np.max(q_lens))   # a request's most rows
    if share <= 0 or one > narrow_rows or rows.size == 0 or int(rows.max()) <= narrow_rows:
        return packs, None
    alt = pack(forest, "pat", group, narrow_rows, head_dim, kv_bytes, q_bytes, partial_weight,
               q_lens=q_lens)
    kv = int((packs.kv_end.astype(np.int64) - packs.kv_start).sum())
    kv_alt = int((alt.kv_end.astype(np.int64) - alt.kv_start).sum())
    return (alt if narrow_wins(kv, kv_alt, share) else packs), (kv, kv_alt)


def narrow_wins(kv_wide: int, kv_narrow: int, share: float) -> bool:
    """Whether the narrow packing is taken: it reads at most ``share`` more KV tokens."""
    return kv_narrow <= kv_wide * (1.0 + share)


# The per-request rule (:func:`request_packing`): the most extra KV tokens, as a share of the
# ``pat`` packing's own, that one CTA per request may re-read: REQUEST_SHARE_PER_ROW per query
# head of the GQA group, at most REQUEST_SHARE_MAX (:func:`request_share`); and the largest
# share of the L2 the pages it re-reads (every KV head) may fill.
REQUEST_SHARE_PER_ROW = 0.075
REQUEST_SHARE_MAX = 0.4
REQUEST_L2_SHARE = 0.25
# the smallest GQA group the rule runs at by default (request_share)
REQUEST_MIN_GROUP = 2


def request_share(group: int) -> float:
    """The per-request rule's default share for GQA group ``group``.  What the rule saves, the
    partial results and the merge, grows with the query heads; what it costs, the re-read
    tokens, with the KV heads: so the share grows with the group.  Measured on an H100
    (``bench/NOTES.md``): at 32:8 re-reading 12-25% more won 1-5%, at 64:8 re-reading
    37% more won 1% and 50% lost 2%, at 16:8 12% won 0.4% and 25% tied.  Below
    :data:`REQUEST_MIN_GROUP` the share is 0 (the rule is off): at 32:32 eight of nine measured
    steps lost, the synthetic batches by 2-5% at 12-25% more tokens and six real-trace steps,
    which were not used to set the share, by 4-7% at only 4-5% more; ``1,512_64,512`` won by
    0.8% (``bench/lab/request_rule_check.py``)."""
    if int(group) < REQUEST_MIN_GROUP:
        return 0.0
    return min(REQUEST_SHARE_MAX, REQUEST_SHARE_PER_ROW * int(group))


def shared_tokens(forest: PrefixForest) -> int:
    """Token positions of the forest's nodes that more than one request reads (each once)."""
    n = np.arange(1, forest.start.shape[0])              # node 0: the virtual root
    multi = (forest.hi[n] - forest.lo[n]) > 1
    return int((forest.end[n][multi].astype(np.int64) - forest.start[n][multi]).sum())


def request_packing(forest: PrefixForest, packs: Packs, share: float, group: int,
                    head_dim: int, num_kv_heads: int, l2_bytes: int, kv_bytes: int = 2,
                    q_lens=None):
    """``(packs', tokens)``: the per-request (``query``) packing of ``forest`` when it is a
    candidate to replace ``packs`` (a ``pat`` packing), else ``None``; ``tokens``:
    ``(pat, per_request)``, the two packings' KV tokens (``sum(kv_end - kv_start)``), or
    ``None`` when the rule does not apply.

    A candidate: some pack of ``packs`` holds several requests; the per-request packing reads
    at most ``share`` more tokens (:func:`request_wins`); and the pages it reads more than once
    (every KV head) fill at most ``REQUEST_L2_SHARE`` of ``l2_bytes``.  The planner takes it
    only where, split and tiled, it needs no merge (every request one CTA, which writes its
    request's output directly), while ``packs`` does.

    ``share``: see :func:`request_share`.  ``q_lens``: as :func:`pack`'s.

    Why: on a batch of long private leaves under short shared levels, sharing the levels costs
    a partial result per request and level, a merge launch, and the shared CTAs' own blocks,
    while the per-request CTAs re-read the shared pages from L2 (they are read by CTAs running
    side by side).  Measured on an H100 (``bench/NOTES.md``): ``1,32,256_64,64,1024``
    at 64:8, 393.0 µs shared against 380.8 per request; re-reading 50% more tokens, 395.3
    against 401.8; at 32:32 it lost 2-5% (:func:`request_share`).  The L2 bound keeps it off
    where the shared pages could not stay resident while the leaves stream (that batch at
    32:32: 34 MB over 32 KV heads).  ``share = 0`` turns the rule off.
    """
    if share <= 0 or packs.num_packs == 0 or int(np.diff(packs.req_indptr).max()) <= 1:
        return None, None
    foot = shared_tokens(forest) * num_kv_heads * 2 * head_dim * kv_bytes
    if foot > REQUEST_L2_SHARE * l2_bytes:
        return None, None
    one = group if q_lens is None else group * int(np.max(q_lens))   # a request's most rows
    alt = pack(forest, "query", group, one, head_dim, kv_bytes, q_lens=q_lens)
    kv = int((packs.kv_end.astype(np.int64) - packs.kv_start).sum())
    kv_alt = int((alt.kv_end.astype(np.int64) - alt.kv_start).sum())
    return (alt if request_wins(kv, kv_alt, share) else None), (kv, kv_alt)


def request_wins(kv_pat: int, kv_request: int, share: float) -> bool:
    """Whether the per-request packing is a candidate: it reads at most ``share`` more KV
    tokens than the ``pat`` packing."""
    return share > 0 and kv_request <= kv_pat * (1.0 + share)


def pack(forest: PrefixForest, packer: str, group: int, max_rows: int, head_dim: int,
         kv_bytes: int = 2, q_bytes: int = 2,
         partial_weight: float = PARTIAL_WEIGHT, q_lens=None) -> Packs:
    """Run one packer over ``forest``.

    ``group``: query heads per KV head.  ``max_rows``: the largest tile's ``m``; a CTA holds at
    most ``max_rows // group`` requests (``query`` holds exactly one).  ``partial_weight``
    scales the partial-result bytes of the ``pat`` profit model.  ``q_lens``: int ``[B]``,
    query tokens of each request (``None``: one each); request ``r`` is then
    ``q_lens[r] x group`` rows, a CTA holds requests while their rows fit ``max_rows``, and
    the packs carry their rows (:attr:`Packs.rows`).
    """
    if packer not in PACKERS:
        raise ValueError(f"packer must be one of {PACKERS}, got {packer!r}")
    f = forest
    B = f.order.shape[0]
    if q_lens is None:
        one = group
        req_rows = None
        max_req = 1 if packer == "query" else max(1, max_rows // group)
        cap = max_req * group
        rpre = np.arange(B + 1, dtype=np.int64) * group
    else:
        req_rows = np.asarray(q_lens, dtype=np.int64) * group
        one = int(req_rows.max()) if B else group
        max_req = 1 if packer == "query" else max(1, B)
        cap = max_rows
        rpre = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(req_rows[f.order], out=rpre[1:])
    if one > max_rows:
        what = ("num_qo_heads / num_kv_heads" if q_lens is None
                else "a request's query tokens x num_qo_heads / num_kv_heads")
        raise ValueError(f"{what} = {one} exceeds the largest tile ({max_rows} rows): one "
                         "request would not fit a CTA")
    kv_tok, row_slot = cost_constants(head_dim, kv_bytes, q_bytes)
    row_slot = int(round(row_slot * float(partial_weight)))
    ind, reqs, s, e, lv, leaf = _tree_heuristic(
        f.start, f.end, f.lo, f.hi, f.child_indptr, f.children, f.order, f.level,
        f.req_node, _MODE[packer], rpre, cap, max_req, kv_tok, row_slot)
    rows = None
    if req_rows is not None:
        rows = (np.add.reduceat(req_rows[reqs], ind[:-1].astype(np.int64)) if ind.shape[0] > 1
                else np.zeros(0, dtype=np.int64))
    return Packs(req_indptr=ind, reqs=reqs, kv_start=s, kv_end=e, level=lv, leaf_pack=leaf,
                 rows=rows)


@njit(cache=True, nogil=True)
def _chunk_packs_nb(order, lcp, lens, chunk, max_req):
    """:func:`chunk_packs` on the forest's sorted order: int32 ``order [B]`` and ``lcp [B]``
    (token LCP of sorted neighbours), int ``lens [B]`` (by request id)."""
    B = order.shape[0]
    total = 0
    kmax = 0
    for r in range(B):
        k = (np.int64(lens[r]) + chunk - 1) // chunk
        total += k
        if k > kmax:
            kmax = k
    req_indptr = np.zeros(total + 1, dtype=np.int32)
    reqs = np.empty(total, dtype=np.int32)
    kv_start = np.empty(total, dtype=np.int32)
    kv_end = np.empty(total, dtype=np.int32)
    level = np.empty(total, dtype=np.int32)
    npk = 0
    nr = 0
    big = np.int64(1) << 62
    for k in range(kmax):
        c0 = np.int64(k) * chunk
        prev_end = np.int64(-1)
        low = big          # smallest neighbour LCP since the last request that reads chunk k
        cnt = 0
        for i in range(B):
            r = order[i]
            if lens[r] > c0:
                e = min(np.int64(lens[r]), c0 + chunk)
                # the previous reader of this chunk reads exactly these tokens: the same end,
                # and (sorted order: LCPs of non-neighbours are the minimum in between) the
                # same pages up to it
                if not (prev_end == e and low >= e and cnt < max_req):
                    if cnt > 0:
                        npk += 1
                        req_indptr[npk] = nr
                    kv_start[npk] = c0
                    kv_end[npk] = e
                    level[npk] = k
                    cnt = 0
                reqs[nr] = r
                nr += 1
                cnt += 1
                prev_end = e
                low = big
            if i + 1 < B and lcp[i] < low:
                low = lcp[i]
        if cnt > 0:
            npk += 1
            req_indptr[npk] = nr
    return (req_indptr[:npk + 1].copy(), reqs, kv_start[:npk].copy(), kv_end[:npk].copy(),
            level[:npk].copy())


def chunk_packs(forest: PrefixForest, chunk: int, group: int, max_rows: int) -> Packs:
    """The batch-invariant packing: packs inside fixed KV chunks ``[k * chunk, (k + 1) *
    chunk)`` of absolute token positions.

    Each request reads chunk ``k`` (for every ``k < ceil(seq_len / chunk)``) from the chunk's
    start to ``min((k + 1) * chunk, seq_len)``; requests that read exactly the same tokens of
    a chunk (the same pages, the same end) share one pack, at most ``max_rows // group`` of
    them (more make more packs over the same tokens).  So the forest is cut at chunk
    boundaries, a node that ends inside a chunk is not shared for the rest of that chunk, and
    every request's packs (their token ranges, hence its partials and their order) are a
    function of its own ``seq_len`` alone, whatever else is in the batch.  ``level`` holds
    the chunk index; ``leaf_pack`` is all ``-1`` (no length-only update in this mode).
    """
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if group > max_rows:
        raise ValueError(f"num_qo_heads / num_kv_heads = {group} exceeds the tile's "
                         f"{max_rows} rows: one request would not fit a CTA")
    lens = forest.block_table.seq_lens
    ind, reqs, s, e, lv = _chunk_packs_nb(forest.order, forest.lcp, lens, int(chunk),
                                          max(1, max_rows // group))
    return Packs(req_indptr=ind, reqs=reqs, kv_start=s, kv_end=e, level=lv,
                 leaf_pack=np.full(lens.shape[0], -1, dtype=np.int32))
