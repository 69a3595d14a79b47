"""The Plan: the single hand-off object between the planner and every executor.

A Plan says, for one decode batch, which CTAs run, what each reads and where each writes.  It is
made of plain NumPy ``int32`` arrays (ready to upload to a GPU in one copy each) plus a little
metadata.  The GPU kernels, the CPU executor and the simulator all read the same object.

Terminology
-----------
* **request** ``r`` (``0 <= r < batch_size``): one decode query; its KV cache is the token
  positions ``[0, seq_lens[r])``, token ``t`` stored at page ``block_table[r][t // page_size]``,
  slot ``t % page_size``.
* **query token**: a request brings ``q_len = qo_indptr[r + 1] - qo_indptr[r]`` query tokens
  (1 for plain decode; up to 16 for speculative decoding's draft verification), rows
  ``qo_indptr[r]:qo_indptr[r + 1]`` of ``q`` and of the output (FlashInfer's ragged layout).
  ``seq_lens`` include them; token ``j`` of the request sees the positions
  ``< seq_len - q_len + 1 + j`` (causal among the new tokens).
* **CTA**: one unit of work of the forward kernel for *one KV head*: a set of requests that share
  a contiguous token range ``[kv_start, kv_start + kv_len)`` (same page ids for all of them).  The
  kernel launches ``num_kv_heads`` thread blocks per Plan CTA (a 1-D grid, the KV heads of one
  CTA adjacent, so blocks reading the same pages run close together).  Its query rows are
  ``sum(q_len of its requests) * group`` where ``group = num_qo_heads // num_kv_heads``
  (:meth:`Plan.cta_rows`): the CTA's requests in order, each request's tokens in order, each
  token's ``group`` query heads in order; row ``(a + t) * group + j`` is token ``t`` of the
  CTA's request whose tokens start at ``a`` (``a`` = the q_lens of the CTA's earlier requests
  summed), query head ``kv_head * group + j``.  With one token per request that is row
  ``i * group + j`` for request ``i`` of the CTA.
* **partial slot**: one fp32 partial result of one request from one CTA: ``o_partial[slot, h, :]``
  (``[num_slots, num_qo_heads, head_dim]``, already normalised by its own softmax sum) and
  ``lse_partial[slot, h]`` (``[num_slots, num_qo_heads]``, natural-log LSE of the scaled scores,
  ``-inf`` when the CTA saw no key).  Slots are numbered request by request, so request ``r``
  owns slots ``req_slot_indptr[r] : req_slot_indptr[r + 1]``; each is written by exactly one CTA.
  A slot holds one partial *row* per query token of its request: the partial arrays are
  ``o_partial [num_partial_rows, num_qo_heads, head_dim]`` and ``lse_partial
  [num_partial_rows, num_qo_heads]``, and query token ``k`` (a row of ``q``) owns the partial
  rows ``token_slot_indptr[k]:token_slot_indptr[k + 1]``, one per slot of its request, in slot
  order: slot ``s`` of request ``r`` writes token ``j``'s partial to row
  ``token_slot_indptr[qo_indptr[r] + j] + s - req_slot_indptr[r]``
  (:meth:`Plan.partial_row`).  With one token per request, partial row = slot.
* **launch group**: CTAs that share a tile config ``(m, n)``.  CTAs are stored sorted by group;
  group ``g`` is ``group_indptr[g] : group_indptr[g + 1]`` and uses
  ``tile_configs[group_tile[g]]``.  The CUDA backend runs a plan as one pull-mode forward launch
  per tile config the plan uses (tallest tiles first, :func:`pat_core.static_plan.order_tiles`;
  a tile's CTAs in plan order), chained on the caller's stream, then the merge
  (:mod:`pat_core.launch`); the simulator lays out the same launches.  ``serial`` marks a
  level-by-level plan (the ``cascade`` packer's groups, one per level and tile); the launches
  are the same.
* **direct output**: a request of exactly one partial slot (``np.diff(req_slot_indptr) == 1``)
  gets its output from the CTA that holds all of its KV (no partial written, nothing to merge);
  the merge combines the other requests' slots and is skipped when every request has one slot
  (``num_slots == batch_size``) and no forward block drew a second work item
  (:func:`pat_core.launch.merge_needed`).

Arrays (``C`` CTAs, ``B`` requests, ``T`` tile configs, ``G`` groups, all ``np.int32``)
--------------------------------------------------------------------------------------
====================  ==============  ======================================================
name                  shape           meaning
====================  ==============  ======================================================
tile_configs          [T, 2]          ``(m, n)``: query rows and KV tokens per tile
group_indptr          [G + 1]         CTA range of each launch group
group_tile            [G]             tile config index of each group
cta_tile              [C]             tile config index of each CTA
cta_req_indptr        [C + 1]         CTA ``c``'s requests are ``cta_req[cta_req_indptr[c]:...]``
cta_req               [R]             request ids (R = total (CTA, request) pairs = num_slots)
cta_slot              [R]             partial slot written for the matching ``cta_req`` entry
cta_kv_start          [C]             first token position read by the CTA
cta_kv_len            [C]             number of tokens read (>= 1)
cta_page_indptr       [C + 1]         CTA ``c``'s pages are ``cta_pages[cta_page_indptr[c]:...]``
cta_pages             [P]             page ids for token positions ``kv_start // page_size`` ..
                                      ``(kv_start + kv_len - 1) // page_size``, in order
req_slot_indptr       [B + 1]         request ``r``'s partial slots (contiguous range)
seq_lens              [B]             KV length of each request (including its query tokens)
qo_indptr             [B + 1]         request ``r``'s query tokens: rows
                                      ``qo_indptr[r]:qo_indptr[r + 1]`` of ``q`` / output
                                      (``arange(B + 1)`` for one token per request)
token_slot_indptr     [N + 1]         query token ``k``'s partial rows (``N = qo_indptr[-1]``;
                                      equals ``req_slot_indptr`` with one token per request)
====================  ==============  ======================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# bytes of one element; float8_e4m3fn is a KV-cache dtype only (q and the output of an fp8
# plan are float16 or bfloat16, pat_core.fp8)
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
KV_ONLY_DTYPES = ("float8_e4m3fn",)
PARTIAL_BYTES = 4  # partial outputs and LSEs are fp32


_DTYPE_NAMES: dict = {}   # dtype object -> canonical name (run() checks dtypes on every call)


def dtype_name(dtype, name: str = "dtype") -> str:
    """Canonical name (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float8_e4m3fn"``) of a
    NumPy/torch/ml_dtypes dtype, a NumPy scalar type or a string; ``TypeError`` naming ``name``
    otherwise.  (Where fp8 may stand, a KV cache only, is the caller's check.)"""
    try:
        hit = _DTYPE_NAMES.get(dtype)
    except TypeError:                       # unhashable: take the slow path
        hit = None
    if hit is not None:
        return hit
    key = dtype
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        dtype = np.dtype(dtype)
    s = str(dtype).replace("torch.", "").replace("numpy.", "")
    aliases = {"half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16",
               "float": "float32", "fp32": "float32", "f32": "float32", "<f2": "float16",
               "<f4": "float32", "fp8_e4m3fn": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn"}
    s = aliases.get(s, s)
    if s not in DTYPE_BYTES:
        raise TypeError(f"{name}: unsupported dtype {dtype!r}; expected float16, bfloat16, "
                        f"float32 or (KV caches only) float8_e4m3fn")
    try:
        _DTYPE_NAMES[key] = s
    except TypeError:
        pass
    return s


@dataclass(frozen=True)
class TokenView:
    """A plan's CTAs with every query token as a request of its own (``Plan.token_view``):
    the same CTAs, KV ranges, pages and tiles, one (CTA, token) pair per query token of each
    of the CTA's requests (the Plan's row order: requests in order, each request's tokens in
    order).  With one token per request these are the Plan's own arrays.  All ``np.int32``;
    ``C`` CTAs, ``T`` pairs, ``N`` query tokens.

    * ``cta_req_indptr [C + 1]``: CTA ``c``'s pairs.
    * ``cta_req [T]``: the pair's query token, its row of ``q`` and of the output.
    * ``cta_slot [T]``: the pair's partial row (``o_partial`` / ``lse_partial`` row).
    * ``req_slot_indptr [N + 1]``: each token's partial rows (``Plan.token_slot_indptr``).
    * ``cta_kv_limit [T]``: positions of the CTA's range the token may see, from its start
      (``kv_len`` when it sees all; fewer where its causal limit falls inside the range).
    * ``cta_causal [C]``: 1 where some pair of the CTA sees fewer than ``kv_len`` positions
      (only those CTAs mask; the others run the one-token computation unchanged).
    """

    cta_req_indptr: np.ndarray
    cta_req: np.ndarray
    cta_slot: np.ndarray
    req_slot_indptr: np.ndarray
    cta_kv_limit: np.ndarray
    cta_causal: np.ndarray


@dataclass
class Plan:
    """Execution plan of one decode batch.  See the module docstring for every array."""

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    packer: str
    gpu: str
    kv_dtype: str
    serial: bool

    tile_configs: np.ndarray
    group_indptr: np.ndarray
    group_tile: np.ndarray
    cta_tile: np.ndarray
    cta_req_indptr: np.ndarray
    cta_req: np.ndarray
    cta_slot: np.ndarray
    cta_kv_start: np.ndarray
    cta_kv_len: np.ndarray
    cta_page_indptr: np.ndarray
    cta_pages: np.ndarray
    req_slot_indptr: np.ndarray
    seq_lens: np.ndarray

    # bumped whenever the arrays change in place (length-only update), so that an executor that
    # cached an upload of this Plan knows to upload again
    version: int = 0
    extra: dict = field(default_factory=dict)
    q_dtype: str | None = None      # query/output dtype when it differs from kv_dtype
    # made by plan(..., batch_invariant=True): every CTA reads inside one fixed KV chunk with
    # one tile, and the merge must take its fixed layout (pat_core.launch.merge_block_per_pair)
    batch_invariant: bool = False
    # ragged query tokens (module docstring); None: one token per request, filled in below
    qo_indptr: np.ndarray | None = None
    token_slot_indptr: np.ndarray | None = None

    ARRAY_FIELDS = ("tile_configs", "group_indptr", "group_tile", "cta_tile", "cta_req_indptr",
                    "cta_req", "cta_slot", "cta_kv_start", "cta_kv_len", "cta_page_indptr",
                    "cta_pages", "req_slot_indptr", "seq_lens", "qo_indptr",
                    "token_slot_indptr")

    def __post_init__(self):
        one_token = self.qo_indptr is None
        if one_token:
            self.qo_indptr = np.arange(self.batch_size + 1, dtype=np.int32)
        if self.token_slot_indptr is None:
            if one_token and self.req_slot_indptr.shape[0] > 0:
                # one token per request: its rows are the request's slots (what
                # token_slot_indptr gives, without its repeat and cumsum on every plan)
                r = self.req_slot_indptr
                self.token_slot_indptr = (r - r[0]).astype(np.int32)
            else:
                self.token_slot_indptr = token_slot_indptr(self.qo_indptr,
                                                           self.req_slot_indptr)

    # ------------------------------------------------------------------ query tokens
    @property
    def num_qo_tokens(self) -> int:
        """Query tokens of the batch, ``qo_indptr[-1]``: the rows of ``q`` and the output."""
        return int(self.qo_indptr[-1])

    @property
    def multi_token(self) -> bool:
        """Some request brings more than one query token."""
        return self.num_qo_tokens != self.batch_size

    @property
    def num_partial_rows(self) -> int:
        """Rows of the partial arrays: one per (slot, query token of the slot's request)."""
        return int(self.token_slot_indptr[-1])

    def q_lens(self) -> np.ndarray:
        """Query tokens of every request, int32 ``[B]``."""
        return np.diff(self.qo_indptr).astype(np.int32)

    def token_view(self) -> "TokenView":
        """This plan with every query token as a request of its own (:class:`TokenView`):
        what an executor reads to run a multi-token plan with one-token code plus a causal
        mask.  Computed once per plan and kept (the arrays are never written in place)."""
        cached = self.extra.get("_token_view")
        if cached is not None and cached[0] is self.cta_req and cached[1] is self.qo_indptr:
            return cached[2]
        C = self.num_ctas
        if not self.multi_token:
            tv = TokenView(cta_req_indptr=self.cta_req_indptr, cta_req=self.cta_req,
                           cta_slot=self.cta_slot, req_slot_indptr=self.req_slot_indptr,
                           cta_kv_limit=np.repeat(self.cta_kv_len,
                                                  np.diff(self.cta_req_indptr)),
                           cta_causal=np.zeros(C, dtype=np.int32))
        else:
            qlen = self.q_lens().astype(np.int64)
            pair_n = qlen[self.cta_req]                              # tokens of each pair
            cta_of = np.repeat(np.arange(C), np.diff(self.cta_req_indptr))
            tok_ptr = np.zeros(C + 1, dtype=np.int64)
            np.cumsum(np.bincount(cta_of, weights=pair_n, minlength=C).astype(np.int64),
                      out=tok_ptr[1:])
            pair = np.repeat(np.arange(pair_n.shape[0]), pair_n)     # pair of each entry
            first = np.cumsum(pair_n) - pair_n
            j = np.arange(pair.shape[0]) - first[pair]               # token within request
            r = self.cta_req[pair].astype(np.int64)
            k = self.qo_indptr[r].astype(np.int64) + j               # the token's q row
            slot = self.cta_slot[pair].astype(np.int64)
            prow = self.token_slot_indptr[k].astype(np.int64) + slot - self.req_slot_indptr[r]
            c = cta_of[pair]
            # positions of the CTA's range the token sees: its causal limit, relative, clipped
            lim = self.seq_lens[r].astype(np.int64) - qlen[r] + 1 + j - self.cta_kv_start[c]
            kv_len = self.cta_kv_len[c].astype(np.int64)
            lim = np.clip(lim, 0, kv_len)
            causal = np.zeros(C, dtype=np.int32)
            causal[np.unique(c[lim < kv_len])] = 1
            tv = TokenView(cta_req_indptr=tok_ptr.astype(np.int32), cta_req=k.astype(np.int32),
                           cta_slot=prow.astype(np.int32),
                           req_slot_indptr=self.token_slot_indptr,
                           cta_kv_limit=lim.astype(np.int32), cta_causal=causal)
        self.extra["_token_view"] = (self.cta_req, self.qo_indptr, tv)
        return tv

    def partial_row(self, slot, token) -> np.ndarray:
        """Partial row of query token ``token`` (0-based within its request) in slot ``slot``
        (int arrays of one shape, the slot's request owning at least ``token + 1`` tokens)."""
        slot = np.asarray(slot, dtype=np.int64)
        owner = np.searchsorted(self.req_slot_indptr, slot, side="right") - 1
        k = self.qo_indptr[owner].astype(np.int64) + token
        return self.token_slot_indptr[k].astype(np.int64) + slot - self.req_slot_indptr[owner]

    # ------------------------------------------------------------------ sizes
    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def num_ctas(self) -> int:
        return int(self.cta_kv_len.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.cta_slot.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.group_tile.shape[0])

    def cta_rows(self) -> np.ndarray:
        """Query rows of every CTA (its requests' query tokens x group), int32 ``[C]``."""
        if not self.multi_token:
            return (np.diff(self.cta_req_indptr) * self.group_size).astype(np.int32)
        tok = np.add.reduceat(self.q_lens()[self.cta_req].astype(np.int64),
                              self.cta_req_indptr[:-1].astype(np.int64))
        return (tok * self.group_size).astype(np.int32)

    def cta_mn(self) -> np.ndarray:
        """Tile ``(m, n)`` of every CTA, int32 ``[C, 2]``."""
        return self.tile_configs[self.cta_tile]

    @property
    def one_cta_per_request(self) -> bool:
        """Every request has one CTA of its own, which writes the request's output (the
        request rule's plans): no partials and no merge."""
        return (self.num_ctas == self.batch_size
                and bool(np.all(np.diff(self.cta_req_indptr) == 1)))

    def direct_requests(self) -> int:
        """Requests of one partial slot: the CTA that holds all of such a request's KV writes
        its output directly (no partial, nothing to merge)."""
        return int(np.count_nonzero(np.diff(self.req_slot_indptr) == 1))

    def groups(self):
        """Yield ``(group_index, (m, n), cta_begin, cta_end)`` for each launch group."""
        for g in range(self.num_groups):
            m, n = (int(x) for x in self.tile_configs[self.group_tile[g]])
            yield g, (m, n), int(self.group_indptr[g]), int(self.group_indptr[g + 1])

    @property
    def io_dtype(self) -> str:
        """Dtype of ``q`` and the output: ``q_dtype`` when set, else the KV dtype (``float16``
        for an fp8 cache, whose queries are never fp8)."""
        if self.q_dtype:
            return self.q_dtype
        return "float16" if self.kv_dtype in KV_ONLY_DTYPES else self.kv_dtype

    # ------------------------------------------------------------------ accounting
    def stats(self, kv_dtype=None, q_dtype=None) -> dict:
        """What this plan moves through HBM, for all heads, priced in ``kv_dtype`` / ``q_dtype``
        (default: the plan's).  Keys:

        * ``num_ctas``: CTAs of the plan (each runs once per KV head).
        * ``num_slots``: partial-result slots, one per (CTA, request) pair.
        * ``kv_tokens``: KV tokens the CTAs read, summed over CTAs, for one KV head.
        * ``kv_bytes``: K and V bytes the CTAs read, all KV heads
          (``kv_tokens x num_kv_heads x 2 x head_dim x`` the KV element size).
        * ``q_bytes``: query rows read by every CTA, all query heads (each of its requests'
          query tokens).
        * ``partial_bytes``: fp32 partial outputs and LSEs, written by the forward kernels and
          read back by the merge kernel (both directions counted), for requests of more than
          one slot (one partial row per slot and query token).
        * ``out_bytes``: the final output, written by the merge kernel or, for a request of one
          slot, by its CTA.
        * ``total_bytes``: the sum of the four byte counts.
        * ``tiles``: ``{"MxN": CTAs}``, the tile each CTA runs with.
        """
        kvb = DTYPE_BYTES[dtype_name(kv_dtype or self.kv_dtype)]
        qb = DTYPE_BYTES[dtype_name(q_dtype or self.q_dtype or
                                    (kv_dtype if kv_dtype not in KV_ONLY_DTYPES else None)
                                    or self.io_dtype)]
        d, hq, hk = self.head_dim, self.num_qo_heads, self.num_kv_heads
        kv_tokens = int(self.cta_kv_len.astype(np.int64).sum())
        kv_bytes = kv_tokens * hk * 2 * d * kvb
        qlen = self.q_lens().astype(np.int64)
        nslot = np.diff(self.req_slot_indptr).astype(np.int64)
        q_rows = int((qlen * nslot).sum())          # (slot, token) pairs: query rows read
        q_bytes = q_rows * hq * d * qb
        # a request of one slot gets its output from that CTA (no partial written)
        written = q_rows - int(qlen[nslot == 1].sum())
        partial_bytes = 2 * written * hq * (d + 1) * PARTIAL_BYTES
        out_bytes = self.num_qo_tokens * hq * d * qb
        tiles: dict = {}
        mn = self.cta_mn()
        for (m, n) in map(tuple, mn.tolist()):
            key = f"{m}x{n}"
            tiles[key] = tiles.get(key, 0) + 1
        return {
            "num_ctas": self.num_ctas,
            "num_slots": self.num_slots,
            "kv_tokens": kv_tokens,
            "kv_bytes": kv_bytes,
            "q_bytes": q_bytes,
            "partial_bytes": partial_bytes,
            "out_bytes": out_bytes,
            "total_bytes": kv_bytes + q_bytes + partial_bytes + out_bytes,
            "tiles": dict(sorted(tiles.items())),
        }

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check the structural invariants every executor relies on; raise ``AssertionError``.

        With the block table the plan was made from (``extra["block_table"]``, set by the
        planner), also check that every CTA reads, for each of its requests, exactly that
        request's pages.  Cheap (vectorised); the property tests call it on every plan they make.
        """
        C, B = self.num_ctas, self.batch_size
        for name in self.ARRAY_FIELDS:
            arr = getattr(self, name)
            assert isinstance(arr, np.ndarray) and arr.dtype == np.int32, name
        assert self.cta_req_indptr.shape == (C + 1,) and self.cta_req_indptr[0] == 0
        assert self.cta_req_indptr[-1] == self.cta_req.shape[0] == self.cta_slot.shape[0]
        assert np.all(np.diff(self.cta_req_indptr) >= 1), "every CTA has a request"
        assert np.all(self.cta_kv_len >= 1), "every CTA reads at least one token"
        assert self.req_slot_indptr.shape == (B + 1,) and self.req_slot_indptr[0] == 0
        assert self.req_slot_indptr[-1] == self.num_slots
        assert self.qo_indptr.shape == (B + 1,) and self.qo_indptr[0] == 0
        assert np.all(np.diff(self.qo_indptr) >= 1), "every request has a query token"
        assert np.all(np.diff(self.qo_indptr) <= self.seq_lens), "query tokens within seq_len"
        assert np.array_equal(self.token_slot_indptr,
                              token_slot_indptr(self.qo_indptr, self.req_slot_indptr)), \
            "token_slot_indptr"
        # slots: a permutation, and each slot lies in the range of the request it serves
        assert np.array_equal(np.sort(self.cta_slot), np.arange(self.num_slots)), "slots unique"
        owner = np.repeat(np.arange(B), np.diff(self.req_slot_indptr))
        assert np.array_equal(owner[self.cta_slot], self.cta_req), "slot owned by its request"
        # rows fit the tile
        rows = self.cta_rows()
        assert np.all(rows <= self.cta_mn()[:, 0]), "rows fit m"
        # pages cover the range
        first = self.cta_kv_start // self.page_size
        last = (self.cta_kv_start + self.cta_kv_len - 1) // self.page_size
        assert np.array_equal(np.diff(self.cta_page_indptr), last - first + 1)
        # groups
        assert self.group_indptr[0] == 0 and self.group_indptr[-1] == C
        for g, _, b, e in self.groups():
            assert np.all(self.cta_tile[b:e] == self.group_tile[g])
        # every request's tokens inside its length
        req_of = self.cta_req
        cta_of = np.repeat(np.arange(C), np.diff(self.cta_req_indptr))
        end = self.cta_kv_start[cta_of].astype(np.int64) + self.cta_kv_len[cta_of]
        assert np.all(end <= self.seq_lens[req_of]), "CTA reads past a request's end"
        assert self.cta_pages.size == 0 or self.cta_pages.min() >= 0, "negative page id"
        # every (CTA, request) pair reads exactly that request's own pages
        bt = self.extra.get("block_table")
        if bt is not None:
            assert bt.batch_size == B and np.array_equal(bt.seq_lens, self.seq_lens), \
                "block_table disagrees with seq_lens"
            npg = np.diff(self.cta_page_indptr).astype(np.int64)[cta_of]     # per pair
            pair = np.repeat(np.arange(cta_of.shape[0]), npg)
            k = np.arange(pair.shape[0]) - np.repeat(np.cumsum(npg) - npg, npg)
            col = first[cta_of].astype(np.int64)[pair] + k
            req = req_of[pair]
            assert np.all(col < bt.num_pages[req]), "CTA reads past a request's pages"
            got = self.cta_pages[self.cta_page_indptr[cta_of].astype(np.int64)[pair] + k]
            assert np.array_equal(got, bt.table[req, col]), \
                "a CTA reads pages that are not its request's"

    def check_inputs(self, q, k_cache, v_cache, kv_layout: str = "NHD") -> None:
        """Raise ``ValueError``/``TypeError`` naming the argument unless ``q`` and the 4-D caches
        fit this plan: shapes, page size, head counts, a shared dtype, and every page id the
        plan reads inside the cache.  Every executor calls it before it runs: the CPU executor on
        every run, the CUDA backend once per new input set (it caches validated inputs)."""
        if len(q.shape) != 3:
            raise ValueError(f"q must be [num_qo_tokens, num_qo_heads, head_dim], got shape "
                             f"{tuple(q.shape)}")
        want = (self.num_qo_tokens, self.num_qo_heads, self.head_dim)
        if tuple(int(x) for x in q.shape) != want:
            rows = "qo_indptr[-1]" if self.multi_token else "batch"
            raise ValueError(f"q has shape {tuple(q.shape)}, the plan expects {want} "
                             f"({rows} rows)")
        if len(k_cache.shape) != 4 or tuple(k_cache.shape) != tuple(v_cache.shape):
            raise ValueError("paged_kv_cache: k_cache and v_cache must be 4-D with equal shapes, "
                             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        n, a, b, d = (int(x) for x in k_cache.shape)
        num_pages, ps, hk = (n, a, b) if kv_layout == "NHD" else (n, b, a)
        if ps != self.page_size:
            raise ValueError(f"paged_kv_cache has page_size {ps}, the plan expects "
                             f"{self.page_size} (kv_layout={kv_layout!r})")
        if hk != self.num_kv_heads or d != self.head_dim:
            raise ValueError(f"paged_kv_cache has {hk} KV heads of dim {d}, the plan expects "
                             f"{self.num_kv_heads} of dim {self.head_dim}")
        qdt = dtype_name(getattr(q, "dtype", None), "q")
        from .fp8 import kv_cache_dtype
        kdt, vdt = kv_cache_dtype(k_cache), kv_cache_dtype(v_cache)
        if kdt != vdt:
            raise TypeError(f"paged_kv_cache: k_cache ({kdt}) and v_cache ({vdt}) must share a "
                            "dtype")
        if qdt in KV_ONLY_DTYPES:
            raise TypeError(f"q is {qdt}, a KV-cache-only dtype; q must be float16 or bfloat16")
        if kdt in KV_ONLY_DTYPES:
            # the one mixed-precision case: an fp8 cache read by fp16/bf16 queries
            want = self.q_dtype or "float16"
            if qdt != want:
                raise TypeError(f"q is {qdt} but the plan's q_data_type is {want!r} (fp8 KV "
                                "cache)")
        elif qdt != kdt:
            raise TypeError(f"q ({qdt}) and paged_kv_cache ({kdt}, {vdt}) must share a dtype")
        lo, hi = self.page_range()
        if hi >= num_pages:
            raise ValueError(f"block_tables uses page {hi} but paged_kv_cache holds only "
                             f"{num_pages} pages")
        if lo < 0:
            raise ValueError(f"the plan reads page {lo}: page ids must be >= 0")

    def page_range(self) -> tuple:
        """``(min, max)`` page id the plan reads (``(0, -1)`` when it reads none); computed once
        per ``cta_pages`` array and :attr:`version` (an in-place change bumps it), since every
        run checks it."""
        cached = self.extra.get("_page_range")
        if cached is not None and cached[0] is self.cta_pages and cached[1] == self.version:
            return cached[2]
        rng = ((int(self.cta_pages.min()), int(self.cta_pages.max())) if self.cta_pages.size
               else (0, -1))
        self.extra["_page_range"] = (self.cta_pages, self.version, rng)
        return rng

    def coverage_counts(self) -> list:
        """For each request, an int array ``[seq_len]`` counting the CTAs that read each token.

        A correct plan gives all ones.  O(total tokens): for tests and small batches.
        """
        counts = [np.zeros(int(s), dtype=np.int32) for s in self.seq_lens]
        for c in range(self.num_ctas):
            s, n = int(self.cta_kv_start[c]), int(self.cta_kv_len[c])
            for r in self.cta_req[self.cta_req_indptr[c]:self.cta_req_indptr[c + 1]]:
                counts[int(r)][s:s + n] += 1
        return counts

    def summary(self) -> str:
        st = self.stats()
        return (f"Plan(packer={self.packer}, gpu={self.gpu}, batch={self.batch_size}, "
                f"ctas={st['num_ctas']}, slots={st['num_slots']}, tiles={st['tiles']}, "
                f"total={st['total_bytes'] / 1e6:.2f} MB)")

    __repr__ = summary


def token_slot_indptr(qo_indptr: np.ndarray, req_slot_indptr: np.ndarray) -> np.ndarray:
    """Each query token's partial rows: int32 ``[N + 1]`` (``N = qo_indptr[-1]``) from the
    requests' tokens (``qo_indptr`` int ``[B + 1]``) and slots (``req_slot_indptr`` int
    ``[B + 1]``); every token of a request gets as many rows as the request has slots."""
    qlen = np.diff(qo_indptr).astype(np.int64)
    per_tok = np.repeat(np.diff(req_slot_indptr).astype(np.int64), qlen)
    out = np.zeros(per_tok.shape[0] + 1, dtype=np.int64)
    np.cumsum(per_tok, out=out[1:])
    return out.astype(np.int32)
