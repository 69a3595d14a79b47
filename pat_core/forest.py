"""PrefixForest: the radix tree of a decode batch's KV caches, token accurate.

Every request is a string of tokens; token ``t`` of request ``r`` is identified by its page id
``table[r, t // page_size]`` and its position.  Two requests share token ``t`` exactly when their
first ``t // page_size + 1`` page ids agree and both are longer than ``t``.  The forest is the
compacted trie of those strings:

* a **node** is a maximal run of token positions ``[start, end)`` read by exactly the same set of
  requests (its *subtree*);
* each root is a distinct first page (children of the virtual root, node 0, which holds no
  tokens);
* a request ends at a leaf, or at an internal node when another request continues past it (a
  prefix of a longer request, or a request covering fewer tokens of a shared last page);
  identical requests end at the same node.

Construction (O(batch log batch) for the sort, then O(total pages)): sort the requests
lexicographically by their page rows (shorter-is-smaller, ties by length), compute the token
LCP of each adjacent pair, and build the LCP-interval tree with one stack pass (the same
bottom-up traversal that turns a suffix array into a suffix tree).  In sorted order every node's
subtree is a contiguous range ``[lo, hi)``, which the packers use to name request sets cheaply.

Arrays (``N`` nodes including the virtual root, ``B`` requests; all int32)
------------------------------------------------------------------------
``order [B]``        request id at each sorted position
``parent [N]``       parent node (``-1`` for the virtual root)
``start, end [N]``   token positions ``[start, end)`` the node holds (``start == parent's end``)
``lo, hi [N]``       sorted-position range of the requests in the subtree
``child_indptr [N+1]``, ``children``   children of each node, ordered by ``lo``
``req_node [B]``     node holding each request's last token
``level [N]``        distance from the virtual root (roots are level 1)
``lcp [B]``          token LCP of each adjacent pair in sorted order (last entry 0)
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .inputs import BlockTable
from .sorting import stable_argsort


@njit(cache=True, nogil=True)
def _adjacent_lcp(table, npages, lens, order, page_size):
    """Token LCP of each adjacent pair in sorted order: int32 ``[B]`` (last entry 0)."""
    B = order.shape[0]
    lcp = np.zeros(B, dtype=np.int32)
    for i in range(B - 1):
        a = order[i]
        b = order[i + 1]
        m = min(npages[a], npages[b])
        k = 0
        while k < m and table[a, k] == table[b, k]:
            k += 1
        lcp[i] = min(k * page_size, lens[a], lens[b])
    return lcp


@njit(cache=True, nogil=True)
def _build_intervals(lcp, lens, order):
    """One stack pass over the LCP array; returns per-node arrays (see module docstring)."""
    B = order.shape[0]
    cap = 2 * B + 2
    parent = np.full(cap, -1, dtype=np.int32)
    depth = np.zeros(cap, dtype=np.int32)
    lo = np.zeros(cap, dtype=np.int32)
    hi = np.zeros(cap, dtype=np.int32)
    req_node = np.zeros(B, dtype=np.int32)
    stack = np.zeros(B + 2, dtype=np.int32)
    sp = 0
    stack[0] = 0            # virtual root: depth 0, covers every request
    hi[0] = B
    nn = 1
    for i in range(B):
        l = lcp[i]
        # the deepest interval containing position i has depth max(lcp[i-1], lcp[i]); the stack top
        # has depth lcp[i-1]; a deeper one, if any, is the interval opened just below
        top = stack[sp]
        opens = l > depth[top]
        last = -1
        lb = i
        while depth[stack[sp]] > l:          # close intervals that end at position i
            t = stack[sp]
            sp -= 1
            hi[t] = i + 1
            if last != -1:
                parent[last] = t
            last = t
            lb = lo[t]
        if depth[stack[sp]] < l:             # open the interval shared by i and i + 1
            new = nn
            nn += 1
            depth[new] = l
            lo[new] = lb
            sp += 1
            stack[sp] = new
            if last != -1:
                parent[last] = new
        elif last != -1:
            parent[last] = stack[sp]
        leaf_parent = stack[sp] if opens else top
        if lens[order[i]] > depth[leaf_parent]:
            leaf = nn
            nn += 1
            depth[leaf] = lens[order[i]]
            lo[leaf] = i
            hi[leaf] = i + 1
            parent[leaf] = leaf_parent
            req_node[order[i]] = leaf
        else:                                 # the request ends where another continues
            req_node[order[i]] = leaf_parent
    return parent[:nn], depth[:nn], lo[:nn], hi[:nn], req_node


def sort_requests(bt: BlockTable) -> np.ndarray:
    """Lexicographic order of the requests' page rows (a row that is a prefix of another
    first; ties: shorter first, then by row index); int32 ``[B]``.

    A most-significant-column-first radix sort (:func:`_radix_order`): a group of rows is
    compared against its first row, row by row (contiguous reads), up to the first column
    where one of them differs or ends, then split by that column's page ids with a stable
    sort.  It reads each row's shared prefix about once, so a batch under a few long shared
    prompts costs about its block-table entries.
    """
    return _radix_order(bt.table, bt.num_pages, bt.seq_lens)


@njit(cache=True, nogil=True)
def _radix_order(table, npages, lens):
    """:func:`sort_requests` (see there); ``table`` int32 ``[B, W]``, ``npages``, ``lens`` int
    ``[B]``."""
    B = table.shape[0]
    order = np.arange(B).astype(np.int32)
    st_lo = np.empty(B + 1, dtype=np.int64)
    st_hi = np.empty(B + 1, dtype=np.int64)
    st_col = np.empty(B + 1, dtype=np.int64)
    sp = 0
    st_lo[0] = 0
    st_hi[0] = B
    st_col[0] = 0
    sp = 1
    while sp > 0:
        sp -= 1
        lo = st_lo[sp]
        hi = st_hi[sp]
        col = st_col[sp]
        if hi - lo < 2:
            continue
        # the first column, from col, where a row of the group differs from its first row or
        # ends (rows of the group agree on every column before col)
        r0 = order[lo]
        c = npages[r0]
        for k in range(lo + 1, hi):
            r = order[k]
            m = min(npages[r], c)
            cc = col
            while cc < m and table[r, cc] == table[r0, cc]:
                cc += 1
            c = min(c, cc)
        if c < col:
            c = col
        # stable sort of the group by that column (page + 1; 0 for a row that ended)
        n = hi - lo
        key = np.empty(n, dtype=np.int64)
        for k in range(n):
            r = order[lo + k]
            key[k] = np.int64(table[r, c]) + 1 if c < npages[r] else 0
        perm = stable_argsort(key)
        grp = order[lo:hi].copy()
        skey = key[perm]
        for k in range(n):
            order[lo + k] = grp[perm[k]]
        k = 0
        while k < n:
            e = k + 1
            while e < n and skey[e] == skey[k]:
                e += 1
            if skey[k] == 0:
                # rows that ended here hold the same pages: shorter first, stable
                if e - k > 1:
                    sub = order[lo + k:lo + e].copy()
                    ln = np.empty(e - k, dtype=np.int64)
                    for q in range(e - k):
                        ln[q] = lens[sub[q]]
                    p2 = stable_argsort(ln)
                    for q in range(e - k):
                        order[lo + k + q] = sub[p2[q]]
            elif e - k > 1:
                st_lo[sp] = lo + k
                st_hi[sp] = lo + e
                st_col[sp] = c + 1
                sp += 1
            k = e
    return order


class PrefixForest:
    """The prefix forest of a :class:`~pat_core.inputs.BlockTable` (see module docstring)."""

    def __init__(self, bt: BlockTable, order: np.ndarray | None = None,
                 lcp: np.ndarray | None = None):
        """``order``, ``lcp`` (int32 ``[B]``, optional): the sorted request order and the
        adjacent token LCPs, when the caller already has them exactly as
        :func:`sort_requests` and ``_adjacent_lcp`` give them (the incremental planner,
        :mod:`pat_core.incremental`); otherwise computed here."""
        self.block_table = bt
        self.page_size = bt.page_size
        if order is None or lcp is None:
            order = sort_requests(bt)
            lcp = _adjacent_lcp(bt.table, bt.num_pages, bt.seq_lens, order, bt.page_size)
        parent, end, lo, hi, req_node = _build_intervals(lcp, bt.seq_lens, order)
        self.lcp = lcp
        self.order = order
        self.parent = parent
        self.end = end
        self.start = np.where(parent >= 0, end[np.maximum(parent, 0)], 0).astype(np.int32)
        self.lo = lo
        self.hi = hi
        self.req_node = req_node
        # children CSR, ordered by lo within each parent
        n = parent.shape[0]
        kids = np.arange(1, n, dtype=np.int32)
        kids = kids[np.lexsort((lo[1:], parent[1:]))]
        self.children = kids
        self.child_indptr = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.bincount(parent[1:], minlength=n), out=self.child_indptr[1:])
        # level: parents are created before... not necessarily; compute by walking from roots
        self.level = _levels(self.child_indptr, self.children, n)

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        """Nodes including the virtual root."""
        return int(self.parent.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.order.shape[0])

    def node_len(self) -> np.ndarray:
        """Tokens held by each node, int32 ``[N]``."""
        return (self.end - self.start).astype(np.int32)

    def node_size(self) -> np.ndarray:
        """Requests in each node's subtree, int32 ``[N]``."""
        return (self.hi - self.lo).astype(np.int32)

    def node_children(self, u: int) -> np.ndarray:
        return self.children[self.child_indptr[u]:self.child_indptr[u + 1]]

    def node_requests(self, u: int) -> np.ndarray:
        """Request ids in node ``u``'s subtree (sorted order)."""
        return self.order[self.lo[u]:self.hi[u]]

    def roots(self) -> np.ndarray:
        return self.node_children(0)

    def unique_tokens(self) -> int:
        """Distinct (page, position) tokens in the batch: what an ideal kernel reads once."""
        return int(self.node_len()[1:].astype(np.int64).sum())

    def node_pages(self, u: int) -> np.ndarray:
        """Page ids holding node ``u``'s tokens (taken from any request of its subtree)."""
        r = self.order[self.lo[u]]
        ps = self.page_size
        return self.block_table.table[r, self.start[u] // ps:(self.end[u] - 1) // ps + 1]

    def describe(self, max_nodes: int = 50) -> str:
        """Indented text picture of the forest (for tutorials and debugging)."""
        lines = []
        stack = [(int(u), 0) for u in self.roots()[::-1]]
        while stack and len(lines) < max_nodes:
            u, d = stack.pop()
            ends = np.nonzero(self.req_node == u)[0]
            tag = f" ends: {ends.tolist()}" if ends.size else ""
            lines.append(f"{'  ' * d}node {u}: tokens [{self.start[u]}, {self.end[u]}) "
                         f"x{self.hi[u] - self.lo[u]} requests{tag}")
            stack.extend((int(c), d + 1) for c in self.node_children(u)[::-1])
        if stack:
            lines.append("...")
        return "\n".join(lines)


@njit(cache=True, nogil=True)
def _levels(child_indptr, children, n):
    level = np.zeros(n, dtype=np.int32)
    stack = np.zeros(n, dtype=np.int32)
    sp = 0
    stack[0] = 0
    sp = 1
    while sp > 0:
        sp -= 1
        u = stack[sp]
        for k in range(child_indptr[u], child_indptr[u + 1]):
            c = children[k]
            level[c] = level[u] + 1
            stack[sp] = c
            sp += 1
    return level
