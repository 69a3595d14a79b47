"""Hypothesis strategies that draw random prefix forests as paged block tables.

A drawn batch has 1-3 roots, up to 6 levels, branching 1-8, node token counts that are rarely
multiples of the page size (1 included), requests that end at internal nodes, identical
requests, and requests forked inside a shared page (listing a longer request's partly covered
page).  Page ids are shuffled and padding columns hold junk.  :func:`assert_run_matches_dense`
runs a planned CPU wrapper on such a batch against float64 dense attention.
:func:`invariant_batches` draws one request and several batches around it (batch invariance).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from pat_core.workloads import block_tables_from_paths


@dataclass
class DrawnBatch:
    block_tables: np.ndarray   # int32 [B, W] with junk padding
    seq_lens: np.ndarray       # int32 [B]
    num_pages: int
    page_size: int
    paths: list

    @property
    def batch_size(self):
        return int(self.seq_lens.shape[0])


@st.composite
def prefix_batches(draw, max_requests=20, max_levels=6, page_sizes=(1, 2, 3, 4, 8, 16, 32, 64),
                   max_node_pages=3):
    ps = draw(st.sampled_from(page_sizes))
    max_len = max(1, max_node_pages * ps + draw(st.integers(0, ps)))
    node_lens = []
    children = []

    def new_node():
        node_lens.append(draw(st.integers(1, max_len)))
        children.append([])
        return len(node_lens) - 1

    roots = [new_node() for _ in range(draw(st.integers(1, 3)))]
    frontier = [(r, 1) for r in roots]
    budget = max_requests
    while frontier:
        u, lvl = frontier.pop()
        if lvl >= max_levels or len(node_lens) > 3 * max_requests:
            continue
        nchild = draw(st.integers(0, min(8, max(0, budget))))
        for _ in range(nchild):
            c = new_node()
            children[u].append(c)
            frontier.append((c, lvl + 1))
        budget -= max(0, nchild - 1)
    # requests: every leaf 1-2 times (identical requests), some internal nodes too
    paths = []

    def walk(u, path):
        path = path + [u]
        if not children[u]:
            for _ in range(draw(st.integers(1, 2))):
                paths.append(path)
        elif draw(st.booleans()) and draw(st.booleans()):
            paths.append(path)          # a request ending at an internal node
        for c in children[u]:
            walk(c, path)

    for r in roots:
        walk(r, [])
    paths = paths[:max_requests]
    if not paths:
        paths = [[roots[0]]]
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    extra = draw(st.integers(0, 3))
    table, seq, n = block_tables_from_paths(paths, np.array(node_lens), ps, rng=rng,
                                            pad_value=-1, extra_cols=extra)
    # fork inside a shared page: a request ending mid-page at an internal node may list the
    # page of a longer request that continues through the same tokens
    if draw(st.booleans()):
        for a in range(len(paths)):
            la = int(seq[a])
            if la % ps == 0:
                continue
            k = (la - 1) // ps
            for b in range(len(paths)):
                if b != a and paths[b][:len(paths[a])] == paths[a] and seq[b] > la:
                    table[a, k] = table[b, k]
                    break
    # junk in the padding, which the planner must ignore
    npg = -(-seq // ps)
    junk = rng.integers(-5, 10 * n + 5, size=table.shape).astype(np.int32)
    pad = np.arange(table.shape[1])[None, :] >= npg[:, None]
    table = np.where(pad, junk, table).astype(np.int32)
    return DrawnBatch(table, seq, n, ps, paths)


def head_configs():
    """(num_qo_heads, num_kv_heads) with GQA groups 1..8."""
    return st.tuples(st.integers(1, 8), st.integers(1, 2)).map(lambda t: (t[0] * t[1], t[1]))


def assert_run_matches_dense(w, b, hq: int, hk: int, d: int, tol: float = 1e-5) -> None:
    """Run the planned CPU wrapper ``w`` on batch ``b`` with a random float32 cache (seed 1)
    and queries (seed 2), and assert its output is within ``tol`` of dense attention."""
    from pat_core.reference import dense_attention, relative_error
    from pat_core.workloads import random_kv_cache
    k, v = random_kv_cache(b.num_pages, b.page_size, hk, d, seed=1)
    q = np.random.default_rng(2).standard_normal((b.batch_size, hq, d)).astype(np.float32)
    out = w.run(q, (k, v))
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size)
    assert relative_error(out, ref) < tol


POOL = 400            # pages in the KV pool of one invariant_batches example


@st.composite
def invariant_batches(draw, page_sizes=(1, 2, 3, 4, 8, 16), max_len=12 * 16, pool_pages=POOL):
    """``(page_size, target_pages, target_len, batches)``: one target request (at most
    ``max_len`` tokens) and 2-4 batches, each a list of ``(pages, seq_len)`` rows holding the
    target at ``pos`` (``(rows, pos)`` pairs); page ids below ``pool_pages``."""
    ps = draw(st.sampled_from(page_sizes))
    L = draw(st.integers(1, max_len))
    npg = -(-L // ps)
    pool = list(np.random.default_rng(draw(st.integers(0, 2**31 - 1))).permutation(pool_pages))
    target = [int(pool.pop()) for _ in range(npg)]
    batches = []
    for _ in range(draw(st.integers(2, 4))):
        rows = []
        for _ in range(draw(st.integers(0, 7))):
            kind = draw(st.sampled_from(("fork", "fork", "end_inside", "same", "other")))
            if kind == "same":
                rows.append((list(target), L))
                continue
            if kind == "other":
                n = draw(st.integers(1, max(1, max_len * 2 // 3)))
                if len(pool) < -(-n // ps):
                    continue
                rows.append(([int(pool.pop()) for _ in range(-(-n // ps))], n))
                continue
            f = draw(st.integers(1, L))                  # tokens shared with the target
            if kind == "end_inside":                     # ends at f, on the target's pages
                rows.append((target[:-(-f // ps)], f))
                continue
            extra = draw(st.integers(1, max(1, max_len // 2)))         # then tokens of its own
            full = f // ps                               # whole shared pages
            own = -(-(f + extra) // ps) - full           # the rest: copied / new pages
            if len(pool) < own:
                continue
            rows.append((target[:full] + [int(pool.pop()) for _ in range(own)], f + extra))
        pos = draw(st.integers(0, len(rows)))
        rows.insert(pos, (list(target), L))
        batches.append((rows, pos))
    return ps, target, L, batches


def invariant_table(rows):
    """``(table int32 [B, W], seq_lens int32 [B])`` of ``(pages, seq_len)`` rows, junk
    padding."""
    width = max(len(p) for p, _ in rows)
    t = np.full((len(rows), width + 1), -7, dtype=np.int32)   # junk padding
    for i, (p, _) in enumerate(rows):
        t[i, :len(p)] = p
    return t, np.array([n for _, n in rows], dtype=np.int32)


@st.composite
def qo_indptrs(draw, seq_lens, max_len=16):   # 16: pat_core.inputs.MAX_QO_LEN
    """A ragged query layout for ``seq_lens``: each request 1..min(max_len, seq_len) tokens,
    mixed (some batches all one length, as speculative decoding with a fixed draft count)."""
    if draw(st.booleans()):
        n = draw(st.integers(1, max_len))
        ql = [min(n, int(s)) for s in seq_lens]
    else:
        ql = [draw(st.integers(1, min(max_len, int(s)))) for s in seq_lens]
    return np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
