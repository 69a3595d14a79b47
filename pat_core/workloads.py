"""Synthetic decode batches: prefix trees -> paged block tables.

Tree spec (the PAT paper's format): ``"1,4,16_128,256,1024"`` means three levels with 1, 4 and
16 nodes holding 128, 256 and 1024 tokens each; the last level's nodes are the requests; node
``j`` of level ``i`` hangs below node ``j * n[i-1] // n[i]`` of level ``i-1``.

Page ids are handed out as a serving engine with prefix caching would: a page is shared by the
requests whose tokens agree over the whole page prefix they cover, and a partly filled page at
the end of a shared node is copied for each child that continues it (copy-on-write).  Physical
ids are shuffled so that sharing is visible only through the table.

Size limits (checked from the spec alone, before any array is built, so that a mistyped spec
fails at once instead of exhausting memory): at most :data:`MAX_TREE_LEVELS` levels, at most
:data:`MAX_TREE_NODES` nodes per level (so at most that many requests), at most
``2^31 - 1`` tokens per request (``seq_lens`` are int32), and, for a page size,
at most :data:`MAX_TREE_TABLE_ENTRIES` block-table entries (requests times the pages of the
longest request): :func:`check_tree_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TreeBatch:
    """A synthetic batch.

    ``block_tables`` int32 ``[batch, max_pages]`` (padding ``-1`` or junk), ``seq_lens`` int32
    ``[batch]``, ``num_pages`` the cache size needed, ``paths`` each request's node path.
    """

    block_tables: np.ndarray
    seq_lens: np.ndarray
    num_pages: int
    page_size: int
    paths: list
    node_lens: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


MAX_TREE_LEVELS = 64
MAX_TREE_NODES = 65536                 # per level; the last level's nodes are the requests
MAX_TREE_TABLE_ENTRIES = 2**24         # requests x pages of the longest request (~0.4 GB peak)
MAX_SEQ_LEN = 2**31 - 1                # seq_lens are int32


def parse_tree_spec(spec: str):
    """``"1,4,16_128,256,1024"`` -> ``([1, 4, 16], [128, 256, 1024])``; ``ValueError`` for a
    malformed spec or one past the level, node or token limits (module docstring)."""
    if not isinstance(spec, str) or spec.count("_") != 1:
        raise ValueError(f"tree spec must look like '1,4,16_128,256,1024', got {spec!r}")
    a, b = spec.split("_")
    try:
        counts = [int(x) for x in a.split(",")]
        lens = [int(x) for x in b.split(",")]
    except ValueError:
        raise ValueError(f"tree spec {spec!r}: counts and lengths must be integers") from None
    if len(counts) != len(lens) or not counts:
        raise ValueError(f"tree spec {spec!r}: as many node counts as lengths are needed")
    if any(c < 1 for c in counts) or any(x < 1 for x in lens):
        raise ValueError(f"tree spec {spec!r}: counts and lengths must be >= 1")
    _check_spec_limits(spec, counts, lens)
    return counts, lens


def _check_spec_limits(spec: str, counts, lens) -> None:
    """The limits that need no page size (module docstring), in Python ints (no overflow)."""
    if len(counts) > MAX_TREE_LEVELS:
        raise ValueError(f"tree spec {spec!r}: {len(counts)} levels; the limit is "
                         f"{MAX_TREE_LEVELS}")
    if max(counts) > MAX_TREE_NODES:
        raise ValueError(f"tree spec {spec!r}: {max(counts)} nodes in one level; the limit is "
                         f"{MAX_TREE_NODES} (per level, so also the most requests)")
    if sum(lens) > MAX_SEQ_LEN:
        raise ValueError(f"tree spec {spec!r}: {sum(lens)} tokens per request; the limit is "
                         f"2^31 - 1 = {MAX_SEQ_LEN}")


def tree_size(spec: str, page_size: int) -> dict:
    """What a tree spec needs, from the spec alone: ``requests``, ``nodes``, ``tokens``
    (of every request: all paths have the same length), ``table_entries`` (requests x pages,
    the block table's size) and ``pages`` (the distinct KV pages :func:`build_tree_batch`
    hands out: a page belongs to the node holding its last token, so a node spanning tokens
    ``[s, e)`` owns the pages that end in it: ``e // p - s // p`` of them, and a leaf also
    its partly filled last page; an upper bound where a level has more nodes than the next,
    as nodes no request passes through hold no pages)."""
    counts, lens = parse_tree_spec(spec)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    page_size = int(page_size)
    tokens = sum(lens)
    return {"requests": counts[-1], "nodes": sum(counts), "tokens": tokens,
            "table_entries": counts[-1] * -(-tokens // page_size),
            "pages": _tree_pages(counts, lens, page_size)}


def _tree_pages(counts, lens, page_size: int) -> int:
    """Distinct pages of a tree (see :func:`tree_size`), in Python ints."""
    pages, start = 0, 0
    for i, (c, n) in enumerate(zip(counts, lens)):
        end = start + n
        last = -(-end // page_size) if i == len(counts) - 1 else end // page_size
        pages += c * (last - start // page_size)
        start = end
    return pages


def check_tree_size(spec: str, page_size: int) -> dict:
    """:func:`tree_size` of ``spec``, or ``ValueError`` with the number and the limit when it
    is past one (module docstring)."""
    size = tree_size(spec, page_size)
    if size["table_entries"] > MAX_TREE_TABLE_ENTRIES:
        per = size["table_entries"] // size["requests"]
        raise ValueError(f"tree spec {spec!r} at page size {page_size}: {size['requests']} "
                         f"requests x {per} pages = {size['table_entries']} block-table "
                         f"entries; the limit is {MAX_TREE_TABLE_ENTRIES}")
    return size


def paths_from_spec(spec: str):
    """Node paths and node token counts of a tree spec: ``(paths, node_lens)``."""
    counts, lens = parse_tree_spec(spec)
    node_lens = []
    level_ids = []
    for lvl, (c, l) in enumerate(zip(counts, lens)):
        level_ids.append(list(range(len(node_lens), len(node_lens) + c)))
        node_lens.extend([l] * c)
    paths = []
    for j in range(counts[-1]):
        path = [level_ids[-1][j]]
        idx = j
        for lvl in range(len(counts) - 1, 0, -1):
            idx = idx * counts[lvl - 1] // counts[lvl]
            path.append(level_ids[lvl - 1][idx])
        paths.append(path[::-1])
    return paths, np.array(node_lens, dtype=np.int64)


def block_tables_from_paths(paths, node_lens, page_size: int, rng=None, pad_value=-1,
                            extra_cols: int = 0):
    """Block tables for requests given as node paths (see module docstring for page sharing).

    ``paths``: list of lists of node ids (root first).  ``node_lens``: tokens per node.
    Returns ``(block_tables int32 [B, max_pages + extra_cols], seq_lens int32 [B], num_pages)``.
    """
    node_lens = np.asarray(node_lens, dtype=np.int64)
    B = len(paths)
    seq = np.array([int(node_lens[p].sum()) for p in paths], dtype=np.int64)
    npg = -(-seq // page_size)
    width = int(npg.max())
    keys = np.full((B, width), -1, dtype=np.int64)
    num_nodes = int(node_lens.shape[0])
    for r, p in enumerate(paths):
        ends = np.cumsum(node_lens[p])
        k = np.arange(npg[r])
        last_pos = np.minimum((k + 1) * page_size, seq[r]) - 1
        node = np.asarray(p)[np.searchsorted(ends, last_pos, side="right")]
        keys[r, : npg[r]] = k * num_nodes + node
    used = keys >= 0
    uniq, inv = np.unique(keys[used], return_inverse=True)
    ids = np.arange(uniq.shape[0])
    if rng is not None:
        ids = rng.permutation(uniq.shape[0])
    table = np.full((B, width + extra_cols), pad_value, dtype=np.int64)
    sub = table[:, :width]
    sub[used] = ids[inv.reshape(-1)]
    table[:, :width] = sub
    return table.astype(np.int32), seq.astype(np.int32), int(uniq.shape[0])


def build_tree_batch(spec: str, page_size: int = 16, seed: int | None = 0) -> TreeBatch:
    """A :class:`TreeBatch` from a tree spec (shuffled page ids when ``seed`` is not None);
    ``ValueError`` before anything is built when the spec is past a size limit (module
    docstring)."""
    check_tree_size(spec, page_size)
    paths, node_lens = paths_from_spec(spec)
    rng = None if seed is None else np.random.default_rng(seed)
    table, seq, n = block_tables_from_paths(paths, node_lens, page_size, rng)
    return TreeBatch(block_tables=table, seq_lens=seq, num_pages=n, page_size=page_size,
                     paths=paths, node_lens=node_lens)


def random_kv_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype=np.float32, kv_layout: str = "NHD", seed: int = 0, scale: float = 1.0):
    """Random ``(k_cache, v_cache)`` NumPy arrays in ``kv_layout``."""
    rng = np.random.default_rng(seed)
    shape = ((num_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD"
             else (num_pages, num_kv_heads, page_size, head_dim))
    k = (rng.standard_normal(shape) * scale).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return k, v


DESIGN_WORKLOADS = (
    "1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32", "3,24,96_1024,64,512",
    "1,32,256_64,64,1024", "1,1024_1024,16", "1,8,64,512_128,512,64,32", "128_2048", "256_4096",
)
HEAD_CONFIGS = ((32, 32), (16, 8), (32, 8), (64, 8))

# Deep single-root trees whose lower levels are many short (32-token) nodes: the shape where a
# fixed cost per work item dominates.  5 levels / 256 leaves, 6 levels / 1024 leaves, 7 levels /
# 64 leaves (a binary tree), 7 levels / 1024 leaves (from the PAT paper's kernel benchmark).
DEEP_WORKLOADS = (
    "1,4,16,64,256_512,256,128,64,32",
    "1,4,16,64,256,1024_1024,256,128,64,32,32",
    "1,2,4,8,16,32,64_256,128,64,64,32,32,32",
    "1,8,16,32,64,128,1024_256,128,64,32,32,32,32",
)
# One long shared prefix over 16 or 32 short requests (64 and 128 query rows at GQA 4).
LONG_PREFIX_WORKLOADS = ("1,16_16384,16", "1,32_16384,16")
DEEP_HEAD_CONFIGS = ((32, 32), (32, 8))
# name -> (tree specs, head configs); the development set of the benchmarks is "design" + "deep"
WORKLOAD_SETS = {
    "design": (DESIGN_WORKLOADS, HEAD_CONFIGS),
    "deep": (DEEP_WORKLOADS, DEEP_HEAD_CONFIGS),
    "long": (LONG_PREFIX_WORKLOADS, DEEP_HEAD_CONFIGS),
}


# ---------------------------------------------------------------------------------------------
# A serving loop: one block table per decode step
# ---------------------------------------------------------------------------------------------

SERVING_ORDERS = ("keep", "swap", "shuffle")


class ServingLoop:
    """A continuous-batching decode loop under a few shared prompts, as a paged engine with
    prefix caching runs it: one ``(block_tables, seq_lens)`` per step.

    ``requests`` requests run at every step.  Each holds one of ``shared_prompts`` prompts of
    ``prompt_len`` tokens (the prompt's full pages are shared by its requests; a partly filled
    last prompt page is copied into a page of the request's own, copy-on-write) and a private
    part that grows by one token per step, taking a fresh page when its last page is full.  A
    request leaves after its private part reaches a length drawn from ``private`` (an
    inclusive ``(lo, hi)`` range); a new request takes its place with a private part of
    ``1..lo`` tokens (its question) under a prompt drawn at random.  At the start every
    request is at a random point of its life.  Freed pages return to a free list that hands
    out the most recently freed page first, so a joining request often gets the pages of one
    that just left.

    Rows of the block table, as an engine's persistent batch keeps them (``order``):
    ``"keep"`` removes a leaving request's row and keeps the others in order, joiners at the
    end; ``"swap"`` moves the last row into the hole (vLLM's condensing); ``"shuffle"``
    permutes the rows at random every step.

    :meth:`step` returns views of one int32 buffer ``[requests, width]`` (padding
    ``pad_value``) and of an int32 ``[requests]`` length array that the next call overwrites
    in place, as an engine's buffers are; copy them to keep a step.
    """

    def __init__(self, requests: int, shared_prompts: int = 4, prompt_len: int = 2048,
                 private=(128, 3072), page_size: int = 16, seed: int = 0,
                 order: str = "keep", pad_value: int = 0):
        for name, v in (("requests", requests), ("shared_prompts", shared_prompts),
                        ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) \
                or prompt_len < 0:
            raise ValueError(f"prompt_len must be an int >= 0, got {prompt_len!r}")
        try:
            lo, hi = (int(x) for x in private)
        except (TypeError, ValueError):
            raise ValueError(f"private must be a (lo, hi) pair of ints, got {private!r}") \
                from None
        if not 1 <= lo <= hi:
            raise ValueError(f"private must satisfy 1 <= lo <= hi, got {private!r}")
        if order not in SERVING_ORDERS:
            raise ValueError(f"order must be one of {SERVING_ORDERS}, got {order!r}")
        self.requests, self.page_size = int(requests), int(page_size)
        self.prompt_len, self.private = int(prompt_len), (lo, hi)
        self.order, self.pad_value = order, int(pad_value)
        self.rng = np.random.default_rng(seed)
        ps = self.page_size
        self.shared_pages = self.prompt_len // ps        # full prompt pages, shared
        self.width = -(-(self.prompt_len + hi) // ps)
        self._next_page = 0
        self._free: list = []
        self.prompts = [self._alloc(self.shared_pages) for _ in range(int(shared_prompts))]
        self.table = np.full((self.requests, self.width), self.pad_value, dtype=np.int32)
        self.seq_lens = np.zeros(self.requests, dtype=np.int32)
        self.final = np.zeros(self.requests, dtype=np.int64)   # length at which a row leaves
        self.steps = 0
        for r in range(self.requests):
            final = int(self.rng.integers(lo, hi + 1))
            self._admit(r, int(self.rng.integers(1, final + 1)), final)

    def _alloc(self, n: int) -> list:
        out = []
        while len(out) < n and self._free:
            out.append(self._free.pop())
        k = n - len(out)
        out.extend(range(self._next_page, self._next_page + k))
        self._next_page += k
        return out

    @property
    def num_pages(self) -> int:
        """Page ids handed out so far are ``< num_pages`` (the KV cache size a run needs)."""
        return self._next_page

    def _admit(self, row: int, private: int, final: int) -> None:
        ps = self.page_size
        prompt = self.prompts[int(self.rng.integers(len(self.prompts)))]
        n = self.prompt_len + private
        own = -(-n // ps) - self.shared_pages
        self.table[row] = self.pad_value
        self.table[row, :self.shared_pages] = prompt
        self.table[row, self.shared_pages:self.shared_pages + own] = self._alloc(own)
        self.seq_lens[row] = n
        self.final[row] = self.prompt_len + final

    def _release(self, row: int) -> None:
        npg = -(-int(self.seq_lens[row]) // self.page_size)
        self._free.extend(int(p) for p in self.table[row, self.shared_pages:npg][::-1])

    def _move(self, dst: int, src: int) -> None:
        self.table[dst] = self.table[src]
        self.seq_lens[dst] = self.seq_lens[src]
        self.final[dst] = self.final[src]

    def step(self):
        """``(block_tables int32 [requests, width], seq_lens int32 [requests])`` of the next
        decode step (the first call: the starting batch)."""
        if self.steps > 0:
            self._advance()
        self.steps += 1
        return self.table, self.seq_lens

    def _advance(self) -> None:
        ps = self.page_size
        lo = self.private[0]
        done = np.flatnonzero(self.seq_lens >= self.final)
        for r in done[::-1]:
            self._release(int(r))
        B = self.requests
        if self.order == "keep" and done.size:
            keep = np.setdiff1d(np.arange(B), done)
            n = keep.shape[0]
            self.table[:n] = self.table[keep]
            self.seq_lens[:n] = self.seq_lens[keep]
            self.final[:n] = self.final[keep]
            fresh = range(n, B)
        elif self.order == "swap" and done.size:
            # fill the lowest holes with the highest living rows, as a condensing batch does
            alive = np.ones(B, dtype=bool)
            alive[done] = False
            n = B - done.size
            last = B - 1
            for h in done.tolist():
                if h >= n:
                    break
                while not alive[last]:
                    last -= 1
                self._move(h, last)
                alive[h], alive[last] = True, False
            fresh = range(n, B)
        else:
            fresh = done.tolist()
        # every running request appends its next token (a fresh page when the last is full)
        grow = np.ones(B, dtype=bool)
        grow[list(fresh)] = False
        full = grow & (self.seq_lens % ps == 0)
        for r in np.flatnonzero(full):
            self.table[r, int(self.seq_lens[r]) // ps] = self._alloc(1)[0]
        self.seq_lens[grow] += 1
        for r in fresh:
            final = int(self.rng.integers(lo, self.private[1] + 1))
            self._admit(int(r), int(self.rng.integers(1, lo + 1)), final)
        if self.order == "shuffle":
            perm = self.rng.permutation(B)
            self.table[:] = self.table[perm]
            self.seq_lens[:] = self.seq_lens[perm]
            self.final[:] = self.final[perm]
