"""The planner: block table -> forest -> packs -> long-KV split -> tiles -> :class:`Plan`.

:class:`Planner` runs that chain and keeps the last result so that the next decode step costs
little (PAT's lazy update):

* the same inputs again return the same Plan object;
* a step where only ``seq_lens`` grew, inside pages the table already lists, and only for
  requests whose last token sits in a CTA of their own, reuses the packing: only those CTAs'
  ends move, then the cheap vectorised tail (split, tiles, arrays) runs again.

Anything else re-plans from scratch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from .forest import PrefixForest
from .gpus import get_gpu
from .inputs import BlockTable, _check_seq_lens, as_block_table, check_heads, check_size
from .packers import (NARROW_SHARE, PACKERS, PARTIAL_WEIGHT, Packs, narrow_packing,
                      narrow_wins, pack, request_packing, request_share, request_wins)
from .plan import DTYPE_BYTES, Plan, dtype_name
from .split import auto_split_share, choose_split_share, split_long_kv, split_threshold
from .tiles import TileSelector


@dataclass
class Tuning:
    """Planner knobs measured by ``bench/kernel_lab.py --cases planner`` (defaults: the rules
    that measured best; see ``bench/NOTES.md``).

    ``max_rows``: cap on a CTA's query rows (``None``: the largest feasible tile).  Smaller
    caps cut shared nodes into more CTAs that re-read the same pages (mostly from L2).
    ``split_share``: resident thread blocks per SM assumed by the ``"sm"`` split rule
    (``None``: :func:`pat_core.split.choose_split_share`: the rule of
    :func:`pat_core.split.auto_split_share` (2; 3 when only packs of at most 16 rows are cut;
    at most 1, so that the cut CTAs make no more blocks than SMs, when a cut pack has more
    rows), or another share where the pull-launch model predicts it clearly faster).
    ``min_part``: shortest part the split makes (tokens).
    ``partial_weight``: multiplies the partial-result bytes in the ``pat`` profit model (above 1
    favours merging short nodes into their children's CTAs: fewer partials and thread blocks
    for more KV re-read; see :data:`pat_core.packers.PARTIAL_WEIGHT`).
    ``kv_tile_table``: replaces the GPU's KV-length -> ``n`` table of the tile selector
    (``None``: the GPU's own, :attr:`pat_core.gpus.GPUSpec.kv_tile_table`).
    ``split_by``: what the ``"sm"`` long-KV split shares out: ``"tokens"``, or ``"work"``
    (tokens times the measured time per token of the CTA's tile rows,
    :meth:`pat_core.tiles.TileSelector.row_time_weight`: 128-row tiles run slower per token).
    ``order``: order of the plan's tile groups and of the CTAs inside each: ``"tile"``
    (ascending ``(m, n)``, pack order inside) or ``"work"`` (groups by their largest per-CTA
    work, and longest KV first inside a group) or ``"shared"`` (groups ranked by the most
    requests one of their CTAs holds, and inside a group the most requests first, then the
    longest KV).  The CUDA backend launches the tiles in its own order (tallest first,
    :func:`pat_core.static_plan.order_tiles`) and each launch's blocks draw its CTAs in plan
    order, so inside a group ``"work"`` starts the CTAs that take longest first; the order of
    the groups themselves orders no launch.
    ``narrow_share``: the ``pat`` packer's narrow-packing rule
    (:func:`pat_core.packers.narrow_packing`): with no ``max_rows`` set and no forced tile,
    every CTA is packed into the narrowest tile's rows when that re-reads at most this share
    more KV tokens (``0``: off).
    ``request_share``: the ``pat`` packer's per-request rule
    (:func:`pat_core.packers.request_packing`): with no ``max_rows`` set, no forced tile and
    no serial plan, the step runs one CTA per request when that re-reads at most this share
    more KV tokens, its re-read pages fit the L2, and it needs no merge where the ``pat``
    packing does (each CTA then writes its request's output; ``None``:
    :func:`pat_core.packers.request_share` of the GQA group; ``0``: off).
    ``exclude_tiles``: ``(m, n)`` pairs the tile selector must not pick (``None``: none).
    Graph-safe mode sets it for a fused pull launch set
    (:func:`pat_core.static_plan.fused_pull_exclusions`).
    """

    max_rows: int | None = None
    split_share: float | None = None
    min_part: int = 256
    partial_weight: float = PARTIAL_WEIGHT
    kv_tile_table: tuple | None = None
    order: str = "work"
    split_by: str = "tokens"
    exclude_tiles: tuple | None = None
    narrow_share: float = NARROW_SHARE
    request_share: float | None = None

    def __post_init__(self):
        if self.max_rows is not None and (not isinstance(self.max_rows, (int, np.integer))
                                          or self.max_rows < 1):
            raise ValueError(f"max_rows must be None or a positive int, got {self.max_rows!r}")
        for name in ("split_share", "partial_weight"):
            v = getattr(self, name)
            if name == "split_share" and v is None:
                continue
            if not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not isinstance(self.narrow_share, (int, float, np.number)) or \
                not math.isfinite(self.narrow_share) or self.narrow_share < 0:
            raise ValueError(f"narrow_share must be a number >= 0, got {self.narrow_share!r}")
        if self.request_share is not None and (
                not isinstance(self.request_share, (int, float, np.number))
                or not math.isfinite(self.request_share) or self.request_share < 0):
            raise ValueError(f"request_share must be None or a number >= 0, got "
                             f"{self.request_share!r}")
        if not isinstance(self.min_part, (int, np.integer)) or self.min_part < 1:
            raise ValueError(f"min_part must be a positive int, got {self.min_part!r}")
        if self.split_by not in ("tokens", "work"):
            raise ValueError(f"split_by must be 'tokens' or 'work', got {self.split_by!r}")
        if self.order not in ("tile", "work", "shared"):
            raise ValueError(f"order must be 'tile', 'work' or 'shared', got {self.order!r}")
        if self.exclude_tiles is not None:
            try:
                ex = tuple((int(m), int(n)) for m, n in self.exclude_tiles)
            except (TypeError, ValueError):
                raise ValueError("exclude_tiles must be None or (m, n) pairs, got "
                                 f"{self.exclude_tiles!r}") from None
            self.exclude_tiles = ex
        if self.kv_tile_table is not None:
            t = tuple(tuple(x) for x in self.kv_tile_table)
            if not t or any(len(x) != 2 or x[1] < 16 for x in t) or \
                    any(a[0] >= b[0] for a, b in zip(t, t[1:])):
                raise ValueError("kv_tile_table must be (max_kv_len, n) pairs with increasing "
                                 f"max_kv_len and n >= 16, got {self.kv_tile_table!r}")


@njit(cache=True)
def _layout(req_indptr, reqs, src, kv_start, kv_len, order, table, page_size, batch):
    """Per-CTA arrays in launch order: requests, slots, pages (one pass, no temporaries).

    ``src [C]`` pack of each CTA, ``order [C]`` launch order.  Slots are numbered request by
    request (request ``r`` owns ``req_slot_indptr[r]:req_slot_indptr[r+1]``), in CTA order.
    """
    C = order.shape[0]
    req_ptr = np.zeros(C + 1, dtype=np.int32)
    page_ptr = np.zeros(C + 1, dtype=np.int32)
    per_req = np.zeros(batch + 1, dtype=np.int32)
    for i in range(C):
        c = order[i]
        p = src[c]
        req_ptr[i + 1] = req_ptr[i] + req_indptr[p + 1] - req_indptr[p]
        first = kv_start[c] // page_size
        last = (kv_start[c] + kv_len[c] - 1) // page_size
        page_ptr[i + 1] = page_ptr[i] + last - first + 1
        for k in range(req_indptr[p], req_indptr[p + 1]):
            per_req[reqs[k] + 1] += 1
    for r in range(batch):
        per_req[r + 1] += per_req[r]
    req_slot_indptr = per_req.copy()
    cta_req = np.empty(req_ptr[C], dtype=np.int32)
    cta_slot = np.empty(req_ptr[C], dtype=np.int32)
    pages = np.empty(page_ptr[C], dtype=np.int32)
    nxt = per_req[:batch].copy()
    for i in range(C):
        c = order[i]
        p = src[c]
        j = req_ptr[i]
        for k in range(req_indptr[p], req_indptr[p + 1]):
            r = reqs[k]
            cta_req[j] = r
            cta_slot[j] = nxt[r]
            nxt[r] += 1
            j += 1
        rep = reqs[req_indptr[p]]          # any member: they agree on the shared range
        first = kv_start[c] // page_size
        for k in range(page_ptr[i + 1] - page_ptr[i]):
            pages[page_ptr[i] + k] = table[rep, first + k]
    return req_ptr, cta_req, cta_slot, page_ptr, pages, req_slot_indptr


def assemble_plan(bt: BlockTable, packs: Packs, *, num_qo_heads: int, num_kv_heads: int,
                  head_dim: int, sm_scale: float, packer: str, selector: TileSelector,
                  kv_dtype: str, serial: bool = False, split=True,
                  tuning: Tuning | None = None) -> Plan:
    """Split, tile and lay out ``packs`` as a :class:`Plan` (no per-CTA Python)."""
    tuning = tuning or Tuning()
    group = num_qo_heads // num_kv_heads
    gpu = selector.gpu
    length = packs.kv_end - packs.kv_start
    weight = None
    if split:
        rule = split if isinstance(split, str) else "sm"
        if rule == "sm" and tuning.split_by == "work":
            weight = selector.row_time_weight(np.diff(packs.req_indptr) * group)
        share = tuning.split_share
        if share is None and weight is None and rule == "sm":
            share, _ = choose_split_share(length, np.diff(packs.req_indptr) * group,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          kv_bytes=DTYPE_BYTES[kv_dtype], gpu=gpu,
                                          selector=selector, min_part=tuning.min_part)
        elif share is None:
            share = auto_split_share(length, np.diff(packs.req_indptr) * group, num_kv_heads,
                                     gpu.num_sms, min_part=tuning.min_part)
        thr = split_threshold(length, num_kv_heads, gpu.num_sms, rule=rule,
                              min_part=tuning.min_part, share=share, weight=weight)
    else:
        thr = int(length.max()) if length.size else 1
    src, kv_start, kv_len = split_long_kv(packs, thr, weight, min_part=tuning.min_part)
    nreq = np.diff(packs.req_indptr)[src]
    mn = selector.select(nreq * group, kv_len)
    # distinct tile configs, then launch groups (cascade: one group per level and config)
    tkey = mn[:, 0].astype(np.int64) * 65536 + mn[:, 1]
    ukey, tile_idx = np.unique(tkey, return_inverse=True)
    tiles = np.stack([ukey // 65536, ukey % 65536], axis=1).astype(np.int32)
    tile_idx = tile_idx.reshape(-1).astype(np.int32)
    if packer == "cascade":
        serial = True
        gkey = packs.level[src].astype(np.int64) * len(tiles) + tile_idx
        order = np.argsort(gkey, kind="stable")
    elif tuning.order in ("work", "shared"):
        # rank tile groups by their largest CTA's work (rows x tokens) or request count,
        # biggest first; inside a group ("work") the longest KV first, so the CTAs that take
        # longest start first, or ("shared") the most requests first, then the longest KV
        work = (mn[:, 0].astype(np.int64) * kv_len if tuning.order == "work"
                else nreq.astype(np.int64))
        gwork = np.zeros(len(tiles), dtype=np.int64)
        np.maximum.at(gwork, tile_idx, work)
        grank = np.empty(len(tiles), dtype=np.int64)
        grank[np.argsort(-gwork, kind="stable")] = np.arange(len(tiles))
        gkey = grank[tile_idx]
        keys = (-kv_len.astype(np.int64), gkey) if tuning.order == "work" else \
            (-kv_len.astype(np.int64), -nreq.astype(np.int64), gkey)
        order = np.lexsort(keys)
    else:
        gkey = tile_idx.astype(np.int64)
        order = np.argsort(gkey, kind="stable")
    order = order.astype(np.int32)
    gkey = gkey[order]
    bounds = np.flatnonzero(np.diff(gkey)) + 1
    group_indptr = np.concatenate(([0], bounds, [gkey.shape[0]])).astype(np.int32)
    tile_idx = tile_idx[order]
    group_tile = tile_idx[group_indptr[:-1]].astype(np.int32)
    B = bt.batch_size
    # the Plan's arrays are int32: refuse a batch whose lists would not fit rather than wrap
    n_pages = int(((kv_start.astype(np.int64) + kv_len - 1) // bt.page_size
                   - kv_start // bt.page_size + 1).sum())
    n_pairs = int(nreq.astype(np.int64).sum())
    if max(n_pages, n_pairs) > np.iinfo(np.int32).max:
        raise ValueError(f"block_tables: the plan would list {n_pages} page entries and "
                         f"{n_pairs} (CTA, request) pairs; the int32 Plan holds at most 2^31 - 1")
    req_ptr, cta_req, cta_slot, page_ptr, pages, req_slot_indptr = _layout(
        packs.req_indptr, packs.reqs, src, kv_start, kv_len, order, bt.table, bt.page_size, B)
    plan = Plan(
        batch_size=B, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=bt.page_size, sm_scale=float(sm_scale), packer=packer, gpu=gpu.name,
        kv_dtype=kv_dtype, serial=bool(serial),
        tile_configs=tiles, group_indptr=group_indptr, group_tile=group_tile,
        cta_tile=tile_idx, cta_req_indptr=req_ptr, cta_req=cta_req, cta_slot=cta_slot,
        cta_kv_start=kv_start[order], cta_kv_len=kv_len[order],
        cta_page_indptr=page_ptr, cta_pages=pages, req_slot_indptr=req_slot_indptr,
        seq_lens=bt.seq_lens.astype(np.int32),
    )
    return plan


class Planner:
    """Plans decode batches for one packer and remembers the last one (lazy update).

    Parameters
    ----------
    packer : one of ``"pat"``, ``"query"``, ``"node"``, ``"compute"``, ``"cascade"``.
    gpu : GPU spec or name used by the tile solver and the split rule (default ``"h100"``).
    tuning : :class:`Tuning` knobs (default: the measured defaults); ``planner.tuning`` may be
        replaced between plans.
    """

    def __init__(self, packer: str = "pat", gpu="h100", tuning: Tuning | None = None):
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {PACKERS}, got {packer!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a pat_core.planner.Tuning, got {tuning!r}")
        self.packer = packer
        self.gpu = get_gpu(gpu)
        self.tuning = tuning or Tuning()
        self._cache = None
        self.last_path = None   # "full", "reuse" or "lengths": what the last plan() did

    def plan(self, block_tables, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, sm_scale: float | None = None, kv_data_type="float16",
             q_data_type=None, tile=None, serial: bool = False, split=True) -> Plan:
        """Make (or reuse) the Plan of one decode batch.  Arguments as
        :meth:`pat_core.PrefixAttentionWrapper.plan`."""
        num_qo_heads, num_kv_heads, head_dim = check_heads(num_qo_heads, num_kv_heads, head_dim)
        page_size = check_size(page_size, "page_size")
        kv_dtype = dtype_name(kv_data_type, "kv_data_type")
        q_dtype = dtype_name(q_data_type or kv_dtype, "q_data_type")
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(head_dim)
        try:
            sm_scale = float(sm_scale)
        except (TypeError, ValueError):
            raise TypeError(f"sm_scale must be a number, got {sm_scale!r}") from None
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
        if tile is not None:
            if len(tuple(tile)) != 2 or not all(isinstance(x, (int, np.integer))
                                                for x in tile):
                raise ValueError(f"tile must be a pair of ints (m, n), got {tile!r}")
        params = (num_qo_heads, num_kv_heads, head_dim, page_size, float(sm_scale), kv_dtype,
                  q_dtype, None if tile is None else tuple(int(x) for x in tile), bool(serial),
                  split, repr(self.tuning))
        raw = block_tables
        if hasattr(raw, "numpy") and hasattr(raw, "device") and str(raw.device) == "cpu":
            raw = raw.numpy()                   # CPU tensor: same memory, cacheable
        raw = raw if isinstance(raw, np.ndarray) else None
        c = self._cache
        if c is not None and raw is not None and c["params"] == params \
                and c["raw"].shape == raw.shape and c["raw"].dtype == raw.dtype \
                and np.array_equal(c["raw"], raw):
            sl = _check_seq_lens(seq_lens, raw.shape[0])
            if sl.shape == c["seq_lens"].shape and np.array_equal(sl, c["seq_lens"]):
                self.last_path = "reuse"
                return c["plan"]
            updated = self._length_update(c, sl)
            if updated is not None:
                self.last_path = "lengths"
                return updated
        bt = as_block_table(raw if raw is not None else block_tables, seq_lens, page_size)
        selector = self.tile_selector(head_dim, kv_dtype, tile)
        group = num_qo_heads // num_kv_heads
        if group > selector.max_rows:
            raise ValueError(
                f"num_qo_heads / num_kv_heads = {group} exceeds the largest tile "
                f"({selector.max_rows} rows for head_dim={head_dim}, {kv_dtype} on "
                f"{self.gpu.name}): the limit is {selector.max_rows}, as one request's query "
                "heads must fit one CTA (the CPU backend runs the same tiles)")
        forest = PrefixForest(bt)
        max_rows = selector.max_rows
        if self.tuning.max_rows is not None:
            max_rows = max(group, min(max_rows, int(self.tuning.max_rows)))
        packs = pack(forest, self.packer, group, max_rows,
                     head_dim, DTYPE_BYTES[kv_dtype], DTYPE_BYTES[q_dtype],
                     partial_weight=self.tuning.partial_weight)
        narrow = None
        if self.packer == "pat" and self.tuning.max_rows is None and tile is None:
            packs, narrow = narrow_packing(forest, packs, group, int(selector.m_values[0]),
                                           self.tuning.narrow_share, head_dim,
                                           DTYPE_BYTES[kv_dtype], DTYPE_BYTES[q_dtype],
                                           self.tuning.partial_weight)
        kw = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  sm_scale=sm_scale, packer=self.packer, selector=selector, kv_dtype=kv_dtype,
                  serial=serial, split=split, tuning=self.tuning)
        plan = assemble_plan(bt, packs, **kw)
        request = None
        # the per-request rule where the plan merges: one CTA per request, each writing its
        # request's output (no partials, no merge), is what the rule measured faster
        if self.packer == "pat" and self.tuning.max_rows is None and tile is None \
                and not serial and plan.num_slots > plan.batch_size:
            alt, tokens = request_packing(forest, packs, self._request_share(group), group,
                                          head_dim, num_kv_heads, self.gpu.l2_bytes,
                                          DTYPE_BYTES[kv_dtype])
            if tokens is not None:
                request = (tokens[0], tokens[1], False)
            if alt is not None:
                alt_plan = assemble_plan(bt, alt, **kw)
                if alt_plan.num_slots == alt_plan.batch_size:   # every request one slot
                    packs, plan, request = alt, alt_plan, (tokens[0], tokens[1], True)
        plan.q_dtype = q_dtype
        plan.extra["forest"] = forest
        plan.extra["block_table"] = bt
        self._cache = dict(params=params, serial=serial, split=split,
                           raw=None if raw is None else raw.copy(),
                           seq_lens=bt.seq_lens.copy(), bt=bt, packs=packs, plan=plan,
                           selector=selector, narrow=narrow, request=request)
        self.last_path = "full"
        return plan

    def _request_share(self, group: int) -> float:
        share = self.tuning.request_share
        return request_share(group) if share is None else float(share)

    def tile_selector(self, head_dim: int, kv_data_type="float16", tile=None) -> TileSelector:
        """The tile selector :meth:`plan` uses for this head_dim and dtype (the GPU's KV-length
        table, or the tuning's; the tuning's ``exclude_tiles`` left out; ``tile`` forces one
        config)."""
        gpu = self.gpu
        if self.tuning.kv_tile_table is not None:
            gpu = dataclasses.replace(gpu, kv_tile_table=tuple(self.tuning.kv_tile_table))
        return TileSelector(head_dim, dtype_name(kv_data_type, "kv_data_type"), gpu, fixed=tile,
                            exclude=None if tile is not None else self.tuning.exclude_tiles)

    def _length_update(self, c: dict, new_lens: np.ndarray):
        """Reuse the packing when only leaf lengths grew inside listed pages; else ``None``."""
        old = c["seq_lens"]
        if new_lens.ndim != 1 or new_lens.shape != old.shape:
            return None
        bt: BlockTable = c["bt"]
        new_lens = new_lens.astype(np.int64)
        changed = np.flatnonzero(new_lens != old)
        if changed.size == 0:
            return c["plan"]
        grow = new_lens[changed]
        if grow.min() <= 0 or np.any(grow < old[changed]):
            return None
        if np.any(grow > bt.num_pages[changed].astype(np.int64) * bt.page_size):
            return None                       # a new page is needed: the table must change
        packs: Packs = c["packs"]
        lp = packs.leaf_pack[changed]
        if np.any(lp < 0):
            return None                       # the request's last token is shared
        narrow = c.get("narrow")
        if narrow is not None:
            # both packings grow by the same tokens: re-check the narrow-packing choice
            added = int((grow - old[changed]).sum())
            share = self.tuning.narrow_share
            wide, thin = narrow[0] + added, narrow[1] + added
            if narrow_wins(wide, thin, share) != narrow_wins(narrow[0], narrow[1], share):
                return None                   # the choice flips: pack again
            narrow = (wide, thin)
        request = c.get("request")
        if request is not None:
            # both packings grow by the same tokens: re-check the per-request choice
            added = int((grow - old[changed]).sum())
            share = self._request_share(c["plan"].group_size)
            kv_pat, kv_req = request[0] + added, request[1] + added
            if request_wins(kv_pat, kv_req, share) != request_wins(request[0], request[1],
                                                                   share):
                return None                   # the choice may flip: pack again
            request = (kv_pat, kv_req, request[2])
        packs = packs.copy()
        packs.kv_end[lp] = grow.astype(np.int32)
        nbt = BlockTable(table=bt.table, seq_lens=new_lens.astype(np.int32),
                         num_pages=bt.num_pages, page_size=bt.page_size)
        p = c["plan"]
        plan = assemble_plan(nbt, packs, num_qo_heads=p.num_qo_heads,
                             num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                             sm_scale=p.sm_scale, packer=self.packer, selector=c["selector"],
                             kv_dtype=p.kv_dtype, serial=c["serial"], split=c["split"],
                             tuning=self.tuning)
        if request is not None and request[2] and plan.num_slots != plan.batch_size:
            return None                       # grown leaves now split: the choice is re-made
        plan.version = p.version + 1
        plan.q_dtype = p.q_dtype
        plan.extra["block_table"] = nbt
        c.update(seq_lens=nbt.seq_lens.copy(), bt=nbt, packs=packs, plan=plan, narrow=narrow,
                 request=request)
        return plan
