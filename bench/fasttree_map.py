"""A paged decode batch as FastTree's token tree (pure NumPy, no GPU).

FastTree (the Triton kernel of the FastTree paper, run as a baseline by ``bench/compare.py``)
does not read a paged cache.  It wants a tree of nodes, node 0 the single root, parents before
children, each node a run of tokens stored contiguously in one flat ``[tokens, kv_heads,
head_dim]`` tensor, every request a leaf whose root-to-leaf chain of nodes is its sequence.

:func:`batch_token_tree` derives that tree from the block table itself, so FastTree computes
exactly the batch every other method computes: a tree node is a maximal run of page slots that
the same set of requests reads (two requests share a slot when they name the same physical page
and read the same number of its tokens).  ``flat_src`` says which cache row (``page *
page_size + slot``) each flat token copies, so the flat K/V tensors are a gather of the same
values the paged methods read.  Batches FastTree cannot express raise :class:`Unsupported` with
the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class Unsupported(ValueError):
    """The batch has a shape FastTree cannot run; ``str(e)`` is the reason."""


@dataclass
class TokenTree:
    """A batch as FastTree's tree.

    ``parent`` int64 ``[nodes]`` (-1 for node 0, the root; ``parent[i] < i``), ``seqlen`` int64
    ``[nodes]`` tokens per node, ``num_children`` int64 ``[nodes]``, ``requests`` a list of
    ``nodes`` lists of batch rows (every request whose chain passes through the node, FastTree's
    ``KVTreeNode.requests``), ``kv_ptrs`` int64 ``[nodes + 1]`` node offsets in the flat token
    tensor, ``flat_src`` int64 ``[kv_ptrs[-1]]`` the cache row (``page * page_size + slot``) of
    each flat token, ``leaf_of`` int64 ``[batch]`` each request's leaf node, ``depth`` int64
    ``[nodes]`` (root 0).
    """

    parent: np.ndarray
    seqlen: np.ndarray
    num_children: np.ndarray
    requests: list
    kv_ptrs: np.ndarray
    flat_src: np.ndarray
    leaf_of: np.ndarray
    depth: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    def chain(self, r: int) -> list:
        """Node ids from the root to request ``r``'s leaf."""
        out = []
        x = int(self.leaf_of[r])
        while x != -1:
            out.append(x)
            x = int(self.parent[x])
        return out[::-1]


def batch_token_tree(block_tables, seq_lens, page_size: int) -> TokenTree:
    """FastTree's tree of a paged batch.

    ``block_tables`` int ``[batch, max_pages]`` (entries past a request's last page ignored),
    ``seq_lens`` int ``[batch]`` (each >= 1), ``page_size`` >= 1.  Nodes are numbered level by
    level (breadth first), children in the order of their first request, which reproduces
    FastTree's ``generate_tree`` numbering for the tree specs of ``pat_core.workloads``.

    Raises :class:`Unsupported` when the requests do not form one rooted tree with a request
    at every leaf and only there (FastTree's model): several roots, a request whose sequence
    is a prefix of another's, or two identical requests.
    """
    bt = np.asarray(block_tables)
    sl = np.asarray(seq_lens)
    if bt.ndim != 2 or not np.issubdtype(bt.dtype, np.integer):
        raise TypeError(f"block_tables must be a 2-D integer array, got {bt.dtype} {bt.shape}")
    if sl.ndim != 1 or sl.shape[0] != bt.shape[0] or not np.issubdtype(sl.dtype, np.integer):
        raise TypeError(f"seq_lens must be a 1-D integer array of length {bt.shape[0]}, "
                        f"got {sl.dtype} {sl.shape}")
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    B = bt.shape[0]
    if B == 0:
        raise ValueError("block_tables: empty batch")
    if np.any(sl < 1):
        raise ValueError("seq_lens: every request needs at least one token")
    npg = -(-sl.astype(np.int64) // page_size)
    if np.any(npg > bt.shape[1]):
        raise ValueError("block_tables: fewer columns than some request's pages")

    # a trie over (page id, tokens read from it); trie node 0 is a virtual super-root
    child = [{}]
    slot = [None]                      # (page, used) of each trie node
    users = [[]]                       # requests through each trie node
    ends = [[]]                        # requests ending at each trie node
    for r in range(B):
        n_p = int(npg[r])
        t = 0
        for k in range(n_p):
            used = page_size if k < n_p - 1 else int(sl[r]) - (n_p - 1) * page_size
            key = (int(bt[r, k]), used)
            nxt = child[t].get(key)
            if nxt is None:
                nxt = len(child)
                child[t][key] = nxt
                child.append({})
                slot.append(key)
                users.append([])
                ends.append([])
            t = nxt
            users[t].append(r)
        ends[t].append(r)

    if len(child[0]) != 1:
        raise Unsupported(f"{len(child[0])} roots: FastTree runs single-root trees only")
    for t in range(1, len(child)):
        if ends[t] and (child[t] or len(ends[t]) > 1):
            if len(ends[t]) > 1:
                what = "requests " + ", ".join(map(str, ends[t])) + " are identical"
            else:
                longer = next(u for u in users[t] if u != ends[t][0])
                what = f"request {ends[t][0]} is a prefix of request {longer}"
            raise Unsupported(f"{what}: FastTree keeps one request per leaf and none inside")

    # compress single-child chains into tree nodes, breadth first
    parent, seqlen, reqs, srcs, depth = [], [], [], [], []
    leaf_of = np.full(B, -1, dtype=np.int64)
    frontier = [(next(iter(child[0].values())), -1, 0)]
    while frontier:
        nxt_frontier = []
        for t, par, dep in frontier:
            node = len(parent)
            run = [t]
            while len(child[run[-1]]) == 1 and not ends[run[-1]]:
                run.append(next(iter(child[run[-1]].values())))
            rows = []
            for u in run:
                page, used = slot[u]
                rows.append(page * page_size + np.arange(used, dtype=np.int64))
            src = np.concatenate(rows)
            parent.append(par)
            seqlen.append(int(src.shape[0]))
            reqs.append(list(users[t]))
            srcs.append(src)
            depth.append(dep)
            last = run[-1]
            for r in ends[last]:
                leaf_of[r] = node
            kids = sorted(child[last].values(), key=lambda u: users[u][0])
            nxt_frontier.extend((u, node, dep + 1) for u in kids)
        frontier = nxt_frontier
    parent = np.asarray(parent, dtype=np.int64)
    n = parent.shape[0]
    num_children = np.bincount(parent[1:], minlength=n).astype(np.int64) if n > 1 else \
        np.zeros(1, dtype=np.int64)
    seqlen = np.asarray(seqlen, dtype=np.int64)
    kv_ptrs = np.concatenate([[0], np.cumsum(seqlen)]).astype(np.int64)
    return TokenTree(parent=parent, seqlen=seqlen, num_children=num_children, requests=reqs,
                     kv_ptrs=kv_ptrs, flat_src=np.concatenate(srcs), leaf_of=leaf_of,
                     depth=np.asarray(depth, dtype=np.int64))


def fasttree_nodes(tree: TokenTree, node_cls) -> list:
    """FastTree's node list: one ``node_cls()`` per node (FastTree's ``KVTreeNode``) with
    ``parent``, ``id``, ``seqlen``, ``num_children`` and ``requests`` set as FastTree's own
    ``generate_tree`` + ``qkv_preparation`` would (request ids are batch rows)."""
    nodes = []
    for i in range(tree.num_nodes):
        x = node_cls()
        x.parent = int(tree.parent[i])
        x.id = i
        x.seqlen = int(tree.seqlen[i])
        x.num_children = int(tree.num_children[i])
        x.requests = list(tree.requests[i])
        nodes.append(x)
    return nodes


def same_shape(tree: TokenTree, nodes) -> bool:
    """Whether FastTree nodes (e.g. from its ``generate_tree``) have ``tree``'s parents, token
    counts and child counts, node by node."""
    if len(nodes) != tree.num_nodes:
        return False
    return all(int(x.parent) == int(tree.parent[i]) and int(x.seqlen) == int(tree.seqlen[i])
               and int(x.num_children) == int(tree.num_children[i])
               for i, x in enumerate(nodes))


def fasttree_reason(tree_or_reason, num_qo_heads: int, num_kv_heads: int, head_dim: int):
    """Why FastTree does not run this configuration (a string), or ``None`` when it does.

    ``tree_or_reason``: a :class:`TokenTree`, or the reason string :class:`Unsupported`
    carried.  FastTree's authors give tile settings for GQA groups 1 and 4 only; its kernel
    asserts head_dim in {16, 32, 64, 128, 256}.
    """
    if isinstance(tree_or_reason, str):
        return tree_or_reason
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    g = num_qo_heads // num_kv_heads
    if g not in FASTTREE_Q_TILES:
        return f"GQA group {g}: FastTree's benchmark settings cover groups 1 and 4 only"
    if head_dim not in (16, 32, 64, 128, 256):
        return f"head_dim {head_dim}: FastTree's kernel takes 16, 32, 64, 128 or 256"
    return None


# FastTree's authors' benchmark settings (flashserve/PAT benchmark/benchmark_kernel.py)
FASTTREE_Q_TILES = {1: (64, 16), 4: (16, 4)}
FASTTREE_KV_TILES = (32, 32)
FASTTREE_KV_SPLITS = (1024, 128)
FASTTREE_PARA_THRESH1 = (132, 528)
FASTTREE_PARA_THRESH2 = (132, 132)
FASTTREE_COST = (0.66, 0.33, 0.1)     # alpha, beta, gamma of its cost model
