"""PrefixForest against brute-force token comparison."""
import itertools

import numpy as np
from hypothesis import given

from pat_core.forest import PrefixForest
from pat_core.inputs import BlockTable
from strategies import prefix_batches


def brute_lcp(bt: BlockTable, a: int, b: int) -> int:
    """Tokens shared by requests a and b, token by token (the slow, obvious definition)."""
    n = 0
    ps = bt.page_size
    while n < min(bt.seq_lens[a], bt.seq_lens[b]) and \
            bt.table[a, n // ps] == bt.table[b, n // ps]:
        n += 1
    return n


def lca(f: PrefixForest, u: int, v: int) -> int:
    anc = set()
    while u >= 0:
        anc.add(u)
        u = int(f.parent[u])
    while v not in anc:
        v = int(f.parent[v])
    return v


def brute_unique_tokens(bt: BlockTable) -> int:
    seen = set()
    ps = bt.page_size
    for r in range(bt.batch_size):
        for t in range(int(bt.seq_lens[r])):
            seen.add((t, tuple(bt.table[r, : t // ps + 1].tolist())))
    return len(seen)


def check_forest(bt: BlockTable):
    f = PrefixForest(bt)
    B = bt.batch_size
    # every request ends at the node holding its last token, and nodes tile [0, len)
    for r in range(B):
        u = int(f.req_node[r])
        assert f.end[u] == bt.seq_lens[r]
        pos = f.end[u]
        while u > 0:
            assert f.end[u] == pos and f.start[u] < f.end[u]
            pos = f.start[u]
            assert r in f.node_requests(u)
            u = int(f.parent[u])
        assert pos == 0
    # the LCA of two requests ends exactly where their tokens stop agreeing
    for a, b in itertools.combinations(range(B), 2):
        w = lca(f, int(f.req_node[a]), int(f.req_node[b]))
        assert f.end[w] == brute_lcp(bt, a, b), (a, b)
    assert f.unique_tokens() == brute_unique_tokens(bt)
    # subtree ranges nest and children are ordered
    for u in range(1, f.num_nodes):
        p = int(f.parent[u])
        assert f.lo[p] <= f.lo[u] < f.hi[u] <= f.hi[p]
        assert f.start[u] == f.end[p]
    return f


@given(prefix_batches(max_requests=12, page_sizes=(1, 2, 3, 16)))
def test_forest_matches_brute_force(b):
    bt = BlockTable.from_padded(b.block_tables, b.seq_lens, b.page_size)
    check_forest(bt)


def test_request_ending_inside_shared_page():
    # request 1 covers 1 token of page 2; request 0 covers 8 of it
    bt = BlockTable.from_lists([[7, 8, 2], [7, 8, 2], [7, 9]], [28, 21, 20], 10)
    f = check_forest(bt)
    assert f.end[f.req_node[1]] == 21
    assert f.unique_tokens() == 28 + 10


def test_identical_requests_share_one_node():
    bt = BlockTable.from_lists([[1, 2], [1, 2], [1, 2]], [20, 20, 20], 16)
    f = check_forest(bt)
    assert len(set(f.req_node.tolist())) == 1
    assert f.num_nodes == 2


def test_several_roots_and_page_size_one():
    bt = BlockTable.from_lists([[1, 2, 3], [1, 2, 4], [5], [6, 7]], [3, 3, 1, 2], 1)
    f = check_forest(bt)
    assert len(f.roots()) == 3
